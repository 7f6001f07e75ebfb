//! Tensors joined along their rows on CUDA: a layer's query,
//! key and value weights and biases for their one product, a LayerNorm's weight and bias for its
//! kernel, the embeddings' small tables, at every pass. One launch moves every part's bytes 16 a
//! thread (`join_rows` in `kernels.cu`), where candle's concatenation (and stack) launches a copy
//! a part, an element a thread. As a graph op its backward is views of its gradient, each part's
//! elements; the twin is candle's concatenation (the same bytes).

use candle_core::cuda_backend::cudarc::driver::DevicePtr;

use super::*;

/// The most parts one launch joins (`JOIN_PARTS` in `kernels.cu`): a custom op's inputs.
const JOIN_PARTS: usize = 3;

/// The parts as the kernel takes them (`struct JoinParts` in `kernels.cu`): each one's first
/// 16-byte piece, and the piece of the output each one ends at.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct JoinParts {
    src: [u64; JOIN_PARTS],
    end: [u64; JOIN_PARTS],
    count: i32,
}

// SAFETY: a plain `#[repr(C)]` value, laid out as the kernel's `struct JoinParts`.
unsafe impl DeviceRepr for JoinParts {}

/// Whether the kernel takes `parts`: two or three contiguous tensors of one dtype, each whole
/// 16-byte pieces from a 16-byte boundary of its buffer (the buffers themselves are aligned).
pub(crate) fn join_takes(parts: &[&Tensor]) -> bool {
    let whole = |t: &Tensor| {
        t.is_contiguous()
            && (t.elem_count() * t.dtype().size_in_bytes()).is_multiple_of(16)
            && starts_on_16_bytes(t)
    };
    (2..=JOIN_PARTS).contains(&parts.len())
        && parts
            .iter()
            .all(|t| t.dtype() == parts[0].dtype() && whole(t))
}

/// `parts` (which [`join_takes`]) one after another as one tensor of `shape` (their
/// concatenation's along dimension 0 or their stack's: the same elements in the same order).
pub(crate) fn join(parts: &[&Tensor], shape: Shape) -> Result<Tensor> {
    let elements: usize = parts.iter().map(|t| t.elem_count()).sum();
    if elements != shape.elem_count() {
        bail!("join: parts of {elements} elements into {:?}", shape.dims())
    }
    let op = JoinRows { shape };
    match parts {
        [a, b] => a.apply_op2(b, op),
        [a, b, c] => a.apply_op3(b, c, op),
        _ => bail!("join: 2 or 3 parts, not {}", parts.len()),
    }
}

/// The join as one node of candle's graph (under autograd; a tape records its own node). Two
/// parts or three: one op for both arities (so `name` is spelt with its trait).
struct JoinRows {
    shape: Shape,
}

impl JoinRows {
    fn run<T: Element>(&self, parts: &[(&CudaStorage, &Layout)]) -> Result<(CudaStorage, Shape)> {
        let name = "bertkit-cuda-join";
        let dev = &parts[0].0.device;
        let stream = dev.cuda_stream();
        let mut table = JoinParts {
            count: parts.len() as i32,
            ..JoinParts::default()
        };
        let mut pieces = 0u64;
        for (i, &(storage, layout)) in parts.iter().enumerate() {
            let part = view::<T>(name, "a part", storage, layout)?;
            let bytes = (part.len() * std::mem::size_of::<T>()) as u64;
            let address = part.device_ptr(&stream).0;
            if !bytes.is_multiple_of(16) || !address.is_multiple_of(16) {
                bail!("{name}: a part of {bytes} bytes at {address:#x}, not whole 16-byte pieces")
            }
            pieces += bytes / 16;
            table.src[i] = address;
            table.end[i] = pieces;
        }
        // SAFETY: the kernel writes every piece of the output (its bytes are the parts', as
        // many as the shape's: `join` checked).
        let mut out = unsafe { dev.alloc::<T>(self.shape.elem_count())? };
        let pieces = pieces as usize;
        launch!(
            T,
            dev,
            "join_rows",
            config(pieces.div_ceil(256).min(65_535), 256, 0),
            |b| {
                b.arg(&table).arg(&mut out);
            }
        )?;
        Ok((wrap(out, dev), self.shape.clone()))
    }
}

/// Each part's gradient: its elements of the join's, as a view in the part's shape.
fn part_gradients(grad: &Tensor, parts: &[&Tensor]) -> Result<Vec<Option<Tensor>>> {
    let flat = grad.flatten_all()?;
    let mut offset = 0;
    parts
        .iter()
        .map(|part| {
            let n = part.elem_count();
            let g = flat.narrow(0, offset, n)?.reshape(part.shape())?;
            offset += n;
            Ok(Some(g))
        })
        .collect()
}

impl CustomOp2 for JoinRows {
    fn name(&self) -> &'static str {
        "bertkit-cuda-join"
    }

    cuda_only!(2);

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let parts = [(a, al), (b, bl)];
        by_dtype!(CustomOp2::name(self), a, self_run(self, &parts))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = part_gradients(grad, &[a, b])?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

impl CustomOp3 for JoinRows {
    fn name(&self) -> &'static str {
        "bertkit-cuda-join"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
        c: &CudaStorage,
        cl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let parts = [(a, al), (b, bl), (c, cl)];
        by_dtype!(CustomOp3::name(self), a, self_run(self, &parts))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = part_gradients(grad, &[a, b, c])?.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
    }
}

/// [`JoinRows::run`] for `T` (a function `by_dtype!` can name).
fn self_run<T: Element>(
    op: &JoinRows,
    parts: &[(&CudaStorage, &Layout)],
) -> Result<(CudaStorage, Shape)> {
    op.run::<T>(parts)
}
