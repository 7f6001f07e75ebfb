//! Reproducible dropout.
//!
//! candle's CPU random generator cannot be seeded, so its dropout masks differ from run to run.
//! Training needs them reproducible: a resumed run must draw the masks the uninterrupted run
//! drew, and activation checkpointing recomputes a layer with the masks of its first pass.
//!
//! A [`DropoutSource`] numbers its masks and draws them in *streams*: a stream starts at a
//! marked position ([`DropoutSource::mark`], [`DropoutSource::set_position`]) and continues
//! while masks are drawn in order. Callers mark where they may later rewind to: the start of
//! each micro-batch's forward pass and of each checkpointed segment. On CUDA a stream is the
//! device generator seeded once with a hash of `(seed, position)` and then drawn from without
//! reseeding (seeding builds a new cuRAND generator, far too costly for every one of a
//! forward pass's ~37–73 masks); on the CPU mask `n` is a counter-based function of
//! `(seed, n)` alone (splitmix64 of the seed, the mask number and the element index). Either
//! way, rewinding to a marked position replays the same masks, and the stream bookkeeping is
//! the same code on every device ([`DropoutSource::streams_started`] counts the streams).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Result, Tensor};

use bertkit_rng::splitmix64 as splitmix;

/// Where training-mode dropout masks come from.
#[derive(Debug)]
pub struct DropoutSource {
    seed: u64,
    position: AtomicU64,
    /// The mask number the current stream draws next (`None`: the next mask starts a stream).
    stream_next: Mutex<Option<u64>>,
    streams: AtomicU64,
}

impl DropoutSource {
    /// Masks drawn from `seed`, starting at mask 0.
    pub fn new(seed: u64) -> Self {
        DropoutSource {
            seed,
            position: AtomicU64::new(0),
            stream_next: Mutex::new(None),
            streams: AtomicU64::new(0),
        }
    }

    /// How many masks were drawn.
    pub fn position(&self) -> u64 {
        self.position.load(Ordering::SeqCst)
    }

    /// Continues from mask number `position` (to replay or resume), starting a new stream
    /// there. Replays are exact when `position` was marked (or set) when first drawn from.
    pub fn set_position(&self, position: u64) {
        self.position.store(position, Ordering::SeqCst);
        *self.stream_next.lock().expect("dropout stream lock") = None;
    }

    /// Marks the current position as one a later pass may rewind to (a new stream starts
    /// here) and returns it.
    pub fn mark(&self) -> u64 {
        let position = self.position();
        self.set_position(position);
        position
    }

    /// Streams started so far: on CUDA, how many times the device generator was seeded.
    pub fn streams_started(&self) -> u64 {
        self.streams.load(Ordering::SeqCst)
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Takes mask number `n`; returns whether it starts a stream.
    fn take(&self, n: u64) -> bool {
        let mut next = self.stream_next.lock().expect("dropout stream lock");
        let starts = *next != Some(n);
        *next = Some(n + 1);
        if starts {
            self.streams.fetch_add(1, Ordering::SeqCst);
        }
        starts
    }

    /// `x` with each element zeroed with probability `p` and the rest scaled by `1 / (1 - p)`.
    pub fn apply(&self, x: &Tensor, p: f64) -> Result<Tensor> {
        if p <= 0.0 {
            return Ok(x.clone());
        }
        let n = self.position.fetch_add(1, Ordering::SeqCst);
        let starts_stream = self.take(n);
        let key = splitmix(self.seed ^ splitmix(n));
        let scale = 1.0 / (1.0 - p);
        let mask = match x.device() {
            Device::Cpu => {
                // Keep an element when its 24-bit uniform is at least p.
                let threshold = (p * (1u64 << 24) as f64) as u64;
                let values: Vec<f32> = (0..x.elem_count() as u64)
                    .map(|i| {
                        if (splitmix(key.wrapping_add(i)) >> 40) >= threshold {
                            scale as f32
                        } else {
                            0.0
                        }
                    })
                    .collect();
                Tensor::from_vec(values, x.shape(), &Device::Cpu)?
            }
            device => {
                if starts_stream {
                    device.set_seed(key)?;
                }
                let uniform = Tensor::rand(0f32, 1f32, x.shape(), device)?;
                (uniform.ge(p)?.to_dtype(DType::F32)? * scale)?
            }
        };
        x.mul(&mask.to_dtype(x.dtype())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_replay_from_a_position_and_keep_the_expected_share() {
        let x = Tensor::ones((200, 50), DType::F32, &Device::Cpu).unwrap();
        let d = DropoutSource::new(42);
        let a = d.apply(&x, 0.1).unwrap();
        let b = d.apply(&x, 0.1).unwrap();
        d.set_position(0);
        let a2 = d.apply(&x, 0.1).unwrap();
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(v(&a), v(&a2));
        assert_ne!(v(&a), v(&b));
        let kept = v(&a).iter().filter(|&&x| x > 0.0).count() as f64 / 10_000.0;
        assert!((kept - 0.9).abs() < 0.02, "{kept}");
        // Kept values are scaled so the expectation is unchanged.
        assert!((v(&a).iter().sum::<f32>() / 10_000.0 - 1.0).abs() < 0.03);
    }

    /// Masks drawn in order continue one stream; marking or rewinding starts the next.
    #[test]
    fn streams_start_only_where_a_pass_may_rewind_to() {
        let x = Tensor::ones(8, DType::F32, &Device::Cpu).unwrap();
        let d = DropoutSource::new(1);
        for _ in 0..5 {
            d.apply(&x, 0.1).unwrap();
        }
        assert_eq!((d.position(), d.streams_started()), (5, 1));
        assert_eq!(d.mark(), 5);
        d.apply(&x, 0.1).unwrap();
        d.apply(&x, 0.1).unwrap();
        assert_eq!(d.streams_started(), 2);
        d.set_position(5);
        d.apply(&x, 0.1).unwrap();
        assert_eq!((d.position(), d.streams_started()), (6, 3));
        // p = 0 draws nothing.
        d.apply(&x, 0.0).unwrap();
        assert_eq!((d.position(), d.streams_started()), (6, 3));
    }
}
