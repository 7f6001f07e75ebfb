//! GLUE metrics: accuracy, F1 of the positive class (MRPC), Matthews correlation (CoLA).

/// Share of predictions equal to the labels.
pub fn accuracy(predictions: &[usize], labels: &[usize]) -> f64 {
    let right = predictions
        .iter()
        .zip(labels)
        .filter(|(p, l)| p == l)
        .count();
    right as f64 / labels.len().max(1) as f64
}

fn confusion(predictions: &[usize], labels: &[usize]) -> (f64, f64, f64, f64) {
    let (mut tp, mut tn, mut fp, mut fn_) = (0f64, 0f64, 0f64, 0f64);
    for (&p, &l) in predictions.iter().zip(labels) {
        match (p == 1, l == 1) {
            (true, true) => tp += 1.0,
            (false, false) => tn += 1.0,
            (true, false) => fp += 1.0,
            (false, true) => fn_ += 1.0,
        }
    }
    (tp, tn, fp, fn_)
}

/// F1 of class 1 (0 when there are no true positives).
pub fn f1(predictions: &[usize], labels: &[usize]) -> f64 {
    let (tp, _, fp, fn_) = confusion(predictions, labels);
    if tp == 0.0 {
        return 0.0;
    }
    2.0 * tp / (2.0 * tp + fp + fn_)
}

/// Matthews correlation coefficient of a binary task (0 when a margin is empty).
pub fn matthews(predictions: &[usize], labels: &[usize]) -> f64 {
    let (tp, tn, fp, fn_) = confusion(predictions, labels);
    let denominator = ((tp + fp) * (tp + fn_) * (tn + fp) * (tn + fn_)).sqrt();
    if denominator == 0.0 {
        0.0
    } else {
        (tp * tn - fp * fn_) / denominator
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_hand() {
        let labels = [1, 1, 0, 0, 1, 0];
        let preds = [1, 0, 0, 1, 1, 0];
        assert!((accuracy(&preds, &labels) - 4.0 / 6.0).abs() < 1e-12);
        // tp 2, fp 1, fn 1: F1 = 4 / 6.
        assert!((f1(&preds, &labels) - 4.0 / 6.0).abs() < 1e-12);
        // (2·2 − 1·1) / sqrt(3·3·3·3) = 1/3.
        assert!((matthews(&preds, &labels) - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(matthews(&[1, 1], &[1, 1]), 0.0);
        assert_eq!(matthews(&labels, &labels), 1.0);
    }
}
