//! Python's `repr(float)`, which `json.dumps` uses: the shortest digits that round-trip, with
//! `.0` on integral values and scientific notation below 1e-4 and from 1e16 on.

/// `repr(x)` as CPython prints it.
pub fn repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let a = x.abs();
    if (1e-4..1e16).contains(&a) {
        let s = format!("{x}");
        if s.contains('.') { s } else { format!("{s}.0") }
    } else {
        // Rust: 1.5e-5 / 1e16; Python: 1.5e-05 / 1e+16.
        let s = format!("{x:e}");
        let (mantissa, exponent) = s.split_once('e').expect("scientific notation");
        let (sign, digits) = match exponent.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exponent),
        };
        format!("{mantissa}e{sign}{digits:0>2}")
    }
}

#[cfg(test)]
mod tests {
    use super::repr;

    #[test]
    fn like_python() {
        assert_eq!(repr(100.0), "100.0");
        assert_eq!(repr(0.28382213812677387), "0.28382213812677387");
        assert_eq!(repr(7.019554367694658), "7.019554367694658");
        assert_eq!(repr(0.0), "0.0");
        assert_eq!(repr(1.5e-5), "1.5e-05");
        assert_eq!(repr(0.0001), "0.0001");
        assert_eq!(repr(1e16), "1e+16");
        assert_eq!(repr(123456789.5), "123456789.5");
        assert_eq!(repr(-2.0), "-2.0");
    }
}
