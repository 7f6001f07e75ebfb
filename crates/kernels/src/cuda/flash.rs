//! Attention in one pass over key tiles on CUDA (`flash.cu`): bf16, heads of 64, rows up to
//! [`MAX_SEQ`], the products on tensor cores. The twin of `cpu::Attention`, as the kernels
//! around cuBLAS (`attention.rs`) are: the same probabilities, the same dropout masks.
//!
//! Where `attention.rs` writes the padded queries, keys and values, the scores and the
//! probabilities of every head of the batch (at BERT-large's phase 1, 100 MB of padded heads and
//! 67 MB of scores and probabilities a layer, each written and read again, and recomputed in the
//! backward), these kernels read the tokens' `[tokens, 3 · hidden]` in place, keep a tile of
//! scores in shared memory and write the context to the tokens' rows. What the backward needs
//! besides `qkv` and the context is each query's log-sum-exp (`[batch, heads, seq]` f32, handed
//! from the forward to the backward); it recomputes the probabilities from it, and sums every
//! gradient in one block in a fixed order (no atomics: a run repeats its bits).
//!
//! The forward takes a block of eight warps for each pair of query tiles (each key tile copied
//! once for both), its scores in registers (`mma.sync`), its exponentials by `ex2`. Where it
//! drops, it writes each kept element's bit, and the backward reads them rather than drawing
//! the keeps again. The backward is one launch for rows of at most [`JOINT_ROWS`] places
//! (a block a row's head, the delta its own) where the device gives a block the shared memory
//! it needs, else three: each query's delta, the keys' and values' gradients, the queries'.

use super::attention::Heads;
use super::*;

/// The entry point of `kernel` (`forward`, `backward_kv`, `backward_q`, `backward_joint`):
/// `_bits` where the pass drops (the forward writes the keep bits, the backwards read them).
fn entry(kernel: &str, dropout: &DeviceDropout) -> String {
    if dropout.on != 0 {
        format!("flash_{kernel}_bits")
    } else {
        format!("flash_{kernel}")
    }
}

/// Places a row the joint backward takes (`FR_PAIR_ROWS`: two tiles).
const JOINT_ROWS: usize = 2 * TILE;
/// The joint backward's dynamic shared memory (`FrJointShared`, whose size
/// `flash_registers.cu` asserts): the row's four tiles, dSᵀ and each place's values.
const JOINT_SHARED_BYTES: usize = 113_152;

/// The joint backward's entry point where it takes this batch (rows of at most
/// [`JOINT_ROWS`] places, a device that gives a block [`JOINT_SHARED_BYTES`]), its function
/// allowed them; `None` for the delta and the two backwards.
fn joint_entry(dev: &CudaDevice, h: &Heads) -> Result<Option<String>> {
    if h.places.seq > JOINT_ROWS {
        return Ok(None);
    }
    let name = entry("backward_joint", &h.dropout);
    Ok(allow_dynamic_shared::<half::bf16>(dev, &name, JOINT_SHARED_BYTES)?.then_some(name))
}

/// Elements of a 16-byte load, the kernels' unit: each input's first element must sit on one.
const ALIGN: usize = 8;
/// Queries (or keys) a block of the kernels covers (`FLASH_TILE`).
const TILE: usize = 64;
/// Threads a block (`FLASH_THREADS`).
const THREADS: u32 = 128;
/// Query tiles and threads a block of the forward and of the joint backward.
const PAIR: usize = 2;

/// Whether the forward hands the dropout's keep bits to the backward: where it drops.
fn keeps_bits(dropout: &DeviceDropout) -> bool {
    dropout.on != 0
}

/// The keep bits' `u32` words of a pass (`[batch, heads, tiles, tiles, THREADS]`, `tiles` of
/// 64 places a row: a lane's bits of a pair of query and key tiles a word).
fn keep_words(h: &Heads) -> usize {
    let tiles = h.places.seq.div_ceil(TILE);
    h.places.batch * h.heads * tiles * tiles * THREADS as usize
}

/// Whether the one-pass kernels take attention over `qkv` at these shapes: bf16, heads of 64,
/// `qkv` contiguous from an aligned element.
pub(super) fn takes(qkv: &Tensor, h: &Heads) -> bool {
    qkv.dtype() == DType::BF16 && h.head == 64 && aligned(qkv)
}

fn aligned(t: &Tensor) -> bool {
    t.is_contiguous() && t.layout().start_offset().is_multiple_of(ALIGN)
}

/// `t` contiguous from an aligned element: itself, or a copy from the first element of a
/// fresh buffer (`Tensor::copy` would keep the layout, offset and all).
fn aligned_copy(t: &Tensor) -> Result<Tensor> {
    if aligned(t) {
        Ok(t.clone())
    } else {
        t.force_contiguous()
    }
}

/// The attention of `qkv` (`[tokens, 3 · hidden]` bf16) within the packed rows of `h`, to the
/// tokens' `[tokens, hidden]`.
pub(super) fn attention(qkv: &Tensor, h: Heads) -> Result<Tensor> {
    let op = Flash {
        heads: h,
        saved: Handoff::empty(),
    };
    tape::apply_op1(qkv, op)
}

/// The kernels' grid: (query or key tiles, heads, rows).
fn grid(h: &Heads) -> LaunchConfig {
    tiles_grid(h, 1)
}

/// The grid of blocks of `tiles` query tiles each (the pair forward's two, with twice the
/// threads).
fn tiles_grid(h: &Heads, tiles: usize) -> LaunchConfig {
    let p = &h.places;
    LaunchConfig {
        grid_dim: (
            p.seq.div_ceil(TILE * tiles).max(1) as u32,
            h.heads as u32,
            p.batch as u32,
        ),
        block_dim: (THREADS * tiles as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The shape arguments every kernel takes after its buffers.
fn shape_args(h: &Heads) -> [i32; 4] {
    let p = &h.places;
    [p.tokens, p.batch, h.heads, p.seq].map(|v| v as i32)
}

/// The arguments each backward kernel takes after its buffers: the padded places, the shape,
/// the scale and the dropout, then the forward's keep bits where it reads them.
fn backward_tail<'a, 'c: 'a>(
    b: &mut LaunchArgs<'a>,
    scatter: &'a CudaView<'c, u32>,
    args: &'a [i32; 4],
    h: &'a Heads,
    keep: Option<&'a CudaSlice<u32>>,
) {
    b.arg(scatter);
    for a in args {
        b.arg(a);
    }
    b.arg(&h.scale).arg(&h.dropout);
    if let Some(keep) = keep {
        b.arg(keep);
    }
}

/// Checks a bf16 input of `[tokens, cols]` from an aligned element and returns its elements.
fn input<'a>(
    name: &str,
    what: &str,
    s: &'a CudaStorage,
    l: &Layout,
    tokens: usize,
    cols: usize,
) -> Result<CudaView<'a, half::bf16>> {
    if l.dims() != [tokens, cols] {
        bail!(
            "{name}: {what} [{tokens}, {cols}] expected, got {:?}",
            l.dims()
        )
    }
    if !l.start_offset().is_multiple_of(ALIGN) {
        bail!("{name}: {what} must start on a 16-byte boundary")
    }
    view::<half::bf16>(name, what, s, l)
}

/// The forward, holding what it hands to the backward.
struct Flash {
    heads: Heads,
    saved: Handoff<Saved>,
}

/// What the forward hands to the backward: each query's log-sum-exp (`[batch, heads, seq]`),
/// and the dropout's keep bits where it wrote them ([`keeps_bits`]).
struct Saved {
    lse: CudaSlice<f32>,
    keep: Option<CudaSlice<u32>>,
}

impl CustomOp1 for Flash {
    fn name(&self) -> &'static str {
        "bertkit-cuda-flash-attention"
    }

    cuda_only!(1);

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let name = self.name();
        let h = &self.heads;
        let p = &h.places;
        let qkv = input(name, "qkv", s, l, p.tokens, 3 * h.hidden())?;
        let dev = &s.device;
        // SAFETY: every token's context and every place's log-sum-exp is written.
        let mut context = unsafe { dev.alloc::<half::bf16>(p.tokens * h.hidden())? };
        let mut lse = unsafe { dev.alloc::<f32>(p.batch * h.heads * p.seq)? };
        // SAFETY: the forward writes the words of every pair of tiles the backward reads (both
        // before the row's end); the others are never read.
        let mut keep = if keeps_bits(&h.dropout) {
            Some(unsafe { dev.alloc::<u32>(keep_words(h))? })
        } else {
            None
        };
        let args = shape_args(h);
        with_view::<u32, _>(name, "padded places", &p.scatter, |scatter| {
            launch!(
                half::bf16,
                dev,
                entry("forward", &h.dropout),
                tiles_grid(h, PAIR),
                |b| {
                    b.arg(&qkv).arg(&mut context).arg(&mut lse).arg(&scatter);
                    for a in &args {
                        b.arg(a);
                    }
                    b.arg(&h.scale).arg(&h.dropout);
                    if let Some(keep) = &mut keep {
                        b.arg(keep);
                    }
                }
            )
        })?;
        self.saved.put(name, Saved { lse, keep })?;
        Ok((wrap(context, dev), Shape::from((p.tokens, h.hidden()))))
    }

    fn bwd(&self, qkv: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        crate::profiled_backward("attention", grad.device(), || {
            let saved = self.saved.take(self.name())?;
            let op = FlashBackward {
                heads: &self.heads,
                saved,
            };
            let grad = aligned_copy(&grad.detach())?;
            let grad_qkv = aligned_copy(&qkv.detach())?.apply_op3_no_bwd(
                &aligned_copy(&out.detach())?,
                &grad,
                &op,
            )?;
            Ok(Some(grad_qkv))
        })
    }
}

/// The backward from `qkv`, the context and its gradient: `qkv`'s gradient.
struct FlashBackward<'a> {
    heads: &'a Heads,
    saved: Saved,
}

impl CustomOp3 for FlashBackward<'_> {
    fn name(&self) -> &'static str {
        "bertkit-cuda-flash-attention-backward"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        l: &Layout,
        o: &CudaStorage,
        ol: &Layout,
        g: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let name = self.name();
        let h = self.heads;
        let p = &h.places;
        let hidden = h.hidden();
        let qkv = input(name, "qkv", s, l, p.tokens, 3 * hidden)?;
        let context = input(name, "context", o, ol, p.tokens, hidden)?;
        let grad = input(name, "gradient", g, gl, p.tokens, hidden)?;
        let dev = &s.device;
        let queries = p.batch * h.heads * p.seq;
        // SAFETY: the joint backward, or the last two launches, write every token's query, key
        // and value gradients (each token is one place of the padded batch).
        let mut grad_qkv = unsafe { dev.alloc::<half::bf16>(p.tokens * 3 * hidden)? };
        let args = shape_args(h);
        let keep = self.saved.keep.as_ref();
        if let Some(entry) = joint_entry(dev, h)? {
            let grid = LaunchConfig {
                grid_dim: (1, h.heads as u32, p.batch as u32),
                block_dim: (THREADS * PAIR as u32, 1, 1),
                shared_mem_bytes: JOINT_SHARED_BYTES as u32,
            };
            with_view::<u32, _>(name, "padded places", &p.scatter, |scatter| {
                launch!(half::bf16, dev, entry, grid, |b| {
                    b.arg(&qkv).arg(&context).arg(&grad).arg(&self.saved.lse);
                    b.arg(&mut grad_qkv);
                    backward_tail(b, &scatter, &args, h, keep);
                })
            })?;
            return Ok((wrap(grad_qkv, dev), Shape::from((p.tokens, 3 * hidden))));
        }
        // SAFETY: the first launch writes every place's delta.
        let mut delta = unsafe { dev.alloc::<f32>(queries)? };
        // The delta: eight threads a query's head, 16 bytes each (its 32-bit index needs the
        // threads under 2^32).
        let delta_threads = queries * (h.head / ALIGN);
        if u32::try_from(delta_threads).is_err() {
            bail!("{name}: {queries} query heads, more than the delta kernel's index holds")
        }
        let delta_config = config(delta_threads.div_ceil(256).min(65_535), 256, 0);
        with_view::<u32, _>(name, "padded places", &p.scatter, |scatter| {
            launch!(half::bf16, dev, "flash_delta", delta_config, |b| {
                b.arg(&context).arg(&grad).arg(&mut delta).arg(&scatter);
                for a in &args {
                    b.arg(a);
                }
            })?;
            for kernel in ["backward_kv", "backward_q"] {
                let kernel_name = entry(kernel, &h.dropout);
                launch!(half::bf16, dev, kernel_name, grid(h), |b| {
                    b.arg(&qkv).arg(&grad).arg(&self.saved.lse).arg(&delta);
                    b.arg(&mut grad_qkv);
                    backward_tail(b, &scatter, &args, h, keep);
                })?;
            }
            Ok(())
        })?;
        Ok((wrap(grad_qkv, dev), Shape::from((p.tokens, 3 * hidden))))
    }
}
