//! The one seeded mixing function bertkit's training code draws from: splitmix64
//! (Steele, Lea and Flood), which turns any 64-bit counter or key into well-mixed bits.
//! Initialisation, dropout masks, data shuffles and fine-tuning order all derive their draws
//! from it, so a seed fixes a run.

/// splitmix64 of `z`: add the golden-ratio increment, then the finaliser.
pub fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The increment splitmix64 adds: a stream's state advances by it per draw.
pub const SPLITMIX_INCREMENT: u64 = 0x9E37_79B9_7F4A_7C15;

/// Fisher–Yates shuffle of `items`, its draws a chain of splitmix64 from `key`.
pub fn shuffle<T>(items: &mut [T], key: u64) {
    let mut state = key;
    for i in (1..items.len()).rev() {
        state = splitmix64(state);
        let j = (state % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_and_permutations() {
        // The reference sequence of splitmix64 seeded with 0 starts 0xE220A8397B1DCDAF.
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        let mut v: Vec<u32> = (0..50).collect();
        shuffle(&mut v, 9);
        assert_ne!(v, (0..50).collect::<Vec<_>>());
        v.sort();
        assert_eq!(v, (0..50).collect::<Vec<_>>());
    }
}
