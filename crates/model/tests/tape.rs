//! The encoder's backward pass run by hand over the fused kernels' recorded ops
//! (`BertModel::encode_taped`) hands back what candle's autograd computes over the same ops:
//! the same outputs, the same gradients for the input and every parameter, bit for bit, with
//! dropout on;
//! and kernels the tape cannot follow fall back to candle's autograd with the same results.

use std::sync::Arc;

use bertkit_model::bert::{BertForPreTraining, init};
use bertkit_model::kernels::{Composed, Kernels};
use bertkit_model::{BertConfig, DropoutSource, Gelu, Inputs, Mode};
use candle_core::{DType, Device, Tensor, Var};

/// The reference kernels, claiming to record: every op falls back to candle's, so a
/// recording is refused at run time.
#[derive(Debug)]
struct ClaimsToRecord;

impl Kernels for ClaimsToRecord {
    fn records(&self, _: DType, _: &Device) -> bool {
        true
    }
    fn layer_norm(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        eps: f64,
    ) -> candle_core::Result<Tensor> {
        Composed.layer_norm(x, w, b, eps)
    }
    fn gelu(&self, x: &Tensor, form: Gelu) -> candle_core::Result<Tensor> {
        Composed.gelu(x, form)
    }
    fn softmax_last_dim(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Composed.softmax_last_dim(x)
    }
}

fn inputs(config: &BertConfig) -> Inputs {
    let cpu = &Device::Cpu;
    let ids = Tensor::new(
        &[
            [2u32, 11, 12, 13, 3, 21, 22, 3, 0, 0],
            [2, 31, 32, 33, 34, 35, 3, 41, 42, 3],
            [2, 51, 52, 3, 53, 0, 0, 0, 0, 0],
        ],
        cpu,
    )
    .unwrap();
    let mask = ids.ne(0u32).unwrap().to_dtype(DType::U32).unwrap();
    let types = Tensor::new(
        &[
            [0u32, 0, 0, 0, 0, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
            [0, 0, 0, 0, 1, 0, 0, 0, 0, 0],
        ],
        cpu,
    )
    .unwrap();
    Inputs::new(config, &ids, Some(&types), Some(&mask)).unwrap()
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The largest difference between `a` and `b`, relative to `b`'s largest magnitude.
fn relative_difference(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (to_f64(a), to_f64(b));
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(&b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Runs layers 0..n both ways from the same input and masks; returns whether the first ran
/// by hand and the worst relative difference of the output, the input's gradient and each
/// parameter's (by name), after checking that every layer parameter got a gradient both ways.
fn compare(
    dtype: DType,
    kernels: Option<Arc<dyn Kernels>>,
) -> (bool, Option<String>, f64, Vec<(String, f64)>) {
    let config = BertConfig::tiny(60);
    let mut loaded = init::<BertForPreTraining>(&config, dtype, &Device::Cpu, 7).unwrap();
    if let Some(kernels) = kernels {
        loaded.model.bert.set_kernels(kernels);
    }
    let bert = &loaded.model.bert;
    let inputs = inputs(&config);
    let source = DropoutSource::new(11);
    source.start_batch(3, 0);
    let mode = Mode::Train(&source);
    let x = bert.embed(&inputs, mode).unwrap().detach();
    let start = source.position();
    let layers = 0..bert.num_layers();
    let upstream = Tensor::randn(0f32, 1.0, x.shape(), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();

    let (y, backward) = bert
        .encode_taped(&x, &inputs, layers.clone(), mode)
        .unwrap();
    let by_hand = backward.by_hand();
    assert!(!y.track_op(), "the output is handed back detached");
    let (grad_x, grads) = backward.backward(&upstream).unwrap();

    source.set_position(start);
    let input = Var::from_tensor(&x).unwrap();
    let reference = bert
        .encode(input.as_tensor(), &inputs, layers, mode)
        .unwrap();
    let store = (&reference * &upstream)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();

    let mut worst = relative_difference(&y, &reference);
    worst = worst.max(relative_difference(
        &grad_x,
        store.get(input.as_tensor()).unwrap(),
    ));
    let mut params = Vec::new();
    for (name, var) in loaded.params.vars() {
        if !name.starts_with("encoder.layer.") {
            assert!(grads.get(var.as_tensor()).is_none(), "{name}");
            continue;
        }
        let ours = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        let theirs = store.get(var.as_tensor()).unwrap();
        assert!(
            to_f64(ours).iter().any(|&g| g != 0.0),
            "{name}: a zero gradient"
        );
        params.push((name.clone(), relative_difference(ours, theirs)));
    }
    assert_eq!(params.len(), 16 * config.num_hidden_layers);
    let refused = bert.tape_refused().map(str::to_string);
    (by_hand, refused, worst, params)
}

#[test]
fn the_encoders_backward_by_hand_is_candles_autograd_over_the_same_kernels() {
    let (by_hand, refused, worst, params) = compare(DType::F32, None);
    assert!(by_hand, "the fused f32 kernels record");
    assert_eq!(refused, None);
    // The same ops in the same order, bit for bit: where a residual's two gradients meet,
    // candle adds both into a zeroed tensor and the tape the second to the first, which
    // rounds the same.
    assert_eq!(worst, 0.0, "output or input gradient");
    for (name, d) in params {
        assert_eq!(d, 0.0, "{name}");
    }
}

#[test]
fn kernels_the_tape_cannot_follow_run_under_autograd_with_the_same_gradients() {
    // Kernels that do not record: the reference ones, and the fused ones in bf16 on the CPU
    // (candle's linear layers there).
    for (dtype, kernels) in [
        (DType::F32, Some(Arc::new(Composed) as Arc<dyn Kernels>)),
        (DType::BF16, None),
    ] {
        let (by_hand, refused, worst, params) = compare(dtype, kernels);
        assert!(!by_hand, "{dtype:?}");
        assert_eq!(refused, None, "never tried");
        assert_eq!(worst, 0.0);
        assert!(params.iter().all(|(_, d)| *d == 0.0), "{params:?}");
    }
    // Kernels that claim to record and fall back to candle's ops: the recording is refused,
    // the pass runs again under autograd with the same dropout masks (the output and the
    // gradients are the reference's to the bit), and the model says why and stops trying.
    let (by_hand, refused, worst, params) = compare(DType::F32, Some(Arc::new(ClaimsToRecord)));
    assert!(!by_hand);
    let why = refused.expect("a reason");
    assert!(why.contains("candle's ops"), "{why}");
    assert_eq!(worst, 0.0);
    assert!(params.iter().all(|(_, d)| *d == 0.0), "{params:?}");
}

#[test]
fn the_device_check_compares_the_backward_by_hand_with_autograd() {
    use bertkit_model::encoder_check::{NAME, check_encoder_backward};
    use bertkit_model::kernels::check::CheckShape;
    let shapes = CheckShape::defaults();
    let checks = check_encoder_backward(&Device::Cpu, DType::F32, &shapes[..1]).unwrap();
    let values: Vec<&str> = checks.iter().map(|c| c.value).collect();
    assert_eq!(values, ["output", "x", "params"], "{checks:?}");
    for c in &checks {
        assert_eq!(c.kernel, NAME);
        assert!(c.passed(), "{c:?}");
    }
    // In bf16 the CPU's fused kernels do not record: nothing to compare, nothing reported.
    assert!(
        check_encoder_backward(&Device::Cpu, DType::BF16, &shapes[..1])
            .unwrap()
            .is_empty()
    );
}
