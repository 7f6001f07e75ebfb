//! Data-parallel training across processes: the [`GradientReducer`] a run's launcher calls for.
//!
//! One process per device (or per CPU socket), started by a launcher that tells each its place
//! ([`Ranks::from_env`]: `mpirun`, `srun`, or `RANK`/`WORLD_SIZE`). Every rank holds the whole
//! model, trains on its share of each step's global batch ([`crate::data`]), and the ranks sum
//! their gradients once per optimiser step before every rank applies the same update
//! ([`crate::step`]). The collectives are MPI's `MPI_Allreduce` (the `mpi` feature, OpenMPI
//! from the distribution's packages) for CPU runs, and NCCL's `ncclAllReduce` (the `nccl`
//! feature) for CUDA runs: one process per GPU, the GPU picked by the local rank, the
//! all-reduce in place on the device's stream. NCCL's id goes from rank 0 to the others over
//! MPI when the ranks were started by `mpirun`/`srun` and the build has `mpi`, else through
//! [`rendezvous`] at `MASTER_ADDR:MASTER_PORT` (torchrun-style launchers). bertkit has no
//! collective of its own.
//!
//! A rank that dies is the launcher's to notice: `mpirun` and `srun` stop the other ranks
//! and exit non-zero, naming the rank. A launcher that dies (killed with SIGKILL, its node
//! lost) is noticed by the MPI ranks at their next collective: they stop rather than go on
//! writing checkpoints beside a restarted job. A rank that fails with an error stops every rank
//! through [`GradientReducer::abort`] (`MPI_Abort`) rather than leave them waiting.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::rc::Rc;
use std::time::{Duration, Instant};

use bertkit_stage_io::Ranks;

use crate::TrainError;
use crate::step::{GradientReducer, Local};

/// Joins the data-parallel world the launcher started, for a run on `device` (`cpu`, `cuda`):
/// [`Local`] for one process; for several, NCCL's for CUDA in a build with `nccl`, else MPI's
/// (with the `mpi` feature; without either, several ranks are refused with how to build).
/// Call once per process, before any work; the world ends when the last handle drops.
pub fn join(ranks: Ranks, device: &str) -> Result<Rc<dyn GradientReducer>, TrainError> {
    if ranks.world_size == 1 {
        return Ok(Rc::new(Local));
    }
    #[cfg(feature = "nccl")]
    if device.starts_with("cuda") {
        return Ok(Rc::new(nccl_world::NcclReducer::join(ranks, device)?));
    }
    #[cfg(feature = "mpi")]
    {
        let _ = device;
        Ok(Rc::new(mpi_world::MpiReducer::join(ranks)?))
    }
    #[cfg(not(feature = "mpi"))]
    {
        Err(TrainError::Config(format!(
            "{ranks}: data-parallel training on {device} sums gradients over {}, and this \
             bertkit was built without it: build with `cargo build --release --features {}` \
             (MPI needs libopenmpi-dev and libclang-dev), or run one process (unset the \
             launcher's RANK/WORLD_SIZE)",
            if device.starts_with("cuda") {
                "NCCL (or MPI)"
            } else {
                "MPI"
            },
            if device.starts_with("cuda") {
                "cuda,nccl"
            } else {
                "mpi"
            },
        )))
    }
}

/// The launchers' variables for a process's rank among those of its machine, in the order
/// they are looked up: torchrun, Open MPI's mpirun, Slurm's srun.
pub const LOCAL_RANK_VARIABLES: [&str; 3] =
    ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"];

/// This process's rank on its machine (which GPU it takes), from the launcher's variables.
pub fn local_rank(get: impl Fn(&str) -> Option<String>) -> Result<usize, TrainError> {
    for name in LOCAL_RANK_VARIABLES {
        if let Some(v) = get(name) {
            return v
                .trim()
                .parse()
                .map_err(|_| TrainError::Config(format!("{name}={v:?} is not a number")));
        }
    }
    Err(TrainError::Config(format!(
        "several ranks on GPUs need the local rank to pick each one's GPU, and none of {} is \
         set: start the ranks with torchrun-style LOCAL_RANK, mpirun or srun",
        LOCAL_RANK_VARIABLES.join(", ")
    )))
}

/// How long ranks wait for each other at the [`rendezvous`] before giving up.
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// Hands rank 0's `payload` (`len` bytes: NCCL's unique id) to every rank through TCP at
/// `address` (`MASTER_ADDR:MASTER_PORT`), as torchrun-style launchers expect: rank 0 listens
/// there and answers each other rank once; the others connect, retrying until `timeout`.
/// Each message carries the world size, so ranks of different launches refuse each other.
/// Only a bootstrap: the collectives are NCCL's.
pub fn rendezvous(
    address: &str,
    ranks: Ranks,
    payload: Option<&[u8]>,
    len: usize,
    timeout: Duration,
) -> Result<Vec<u8>, TrainError> {
    let failed = |what: &str, e: &dyn std::fmt::Display| {
        TrainError::Config(format!("rendezvous at {address} ({ranks}): {what}: {e}"))
    };
    let deadline = Instant::now() + timeout;
    let header = |rank: usize| {
        let mut h = [0u8; 16];
        h[..8].copy_from_slice(&(ranks.world_size as u64).to_le_bytes());
        h[8..].copy_from_slice(&(rank as u64).to_le_bytes());
        h
    };
    if ranks.rank == 0 {
        let payload = payload.ok_or_else(|| failed("rank 0", &"has nothing to share"))?;
        let port = address.rsplit_once(':').map_or(address, |(_, p)| p);
        let listener = TcpListener::bind((
            "0.0.0.0",
            port.parse::<u16>().map_err(|e| failed("port", &e))?,
        ))
        .map_err(|e| failed("listening", &e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| failed("listening", &e))?;
        let mut answered = vec![false; ranks.world_size];
        answered[0] = true;
        while answered.iter().any(|a| !a) {
            match listener.accept() {
                Ok((mut peer, _)) => {
                    peer.set_nonblocking(false)
                        .and_then(|_| peer.set_read_timeout(Some(Duration::from_secs(30))))
                        .map_err(|e| failed("a peer", &e))?;
                    let mut h = [0u8; 16];
                    peer.read_exact(&mut h)
                        .map_err(|e| failed("reading a peer", &e))?;
                    let world = u64::from_le_bytes(h[..8].try_into().expect("8 bytes"));
                    let rank = u64::from_le_bytes(h[8..].try_into().expect("8 bytes")) as usize;
                    if world != ranks.world_size as u64 || rank == 0 || rank >= ranks.world_size {
                        return Err(failed(
                            "a peer",
                            &format!("says rank {rank} of {world}, not one of this launch's ranks"),
                        ));
                    }
                    peer.write_all(&header(0))
                        .and_then(|_| peer.write_all(payload))
                        .map_err(|e| failed("answering a peer", &e))?;
                    answered[rank] = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<String> = (0..ranks.world_size)
                            .filter(|&r| !answered[r])
                            .map(|r| r.to_string())
                            .collect();
                        return Err(failed(
                            "waiting",
                            &format!("ranks {} never came", missing.join(", ")),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(failed("accepting", &e)),
            }
        }
        return Ok(payload.to_vec());
    }
    let mut peer = loop {
        match TcpStream::connect(address) {
            Ok(peer) => break peer,
            Err(e) if Instant::now() > deadline => return Err(failed("connecting to rank 0", &e)),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    peer.set_read_timeout(Some(timeout))
        .map_err(|e| failed("connecting to rank 0", &e))?;
    peer.write_all(&header(ranks.rank))
        .map_err(|e| failed("writing to rank 0", &e))?;
    let mut h = [0u8; 16];
    peer.read_exact(&mut h)
        .map_err(|e| failed("reading rank 0", &e))?;
    if h != header(0) {
        return Err(failed("rank 0", &"answered for another world size"));
    }
    let mut received = vec![0u8; len];
    peer.read_exact(&mut received)
        .map_err(|e| failed("reading rank 0", &e))?;
    Ok(received)
}

#[cfg(feature = "mpi")]
mod mpi_world {
    use mpi::collective::SystemOperation;
    use mpi::environment::Universe;
    use mpi::topology::SimpleCommunicator;
    use mpi::traits::{Communicator, CommunicatorCollectives, Equivalence};

    use bertkit_stage_io::Ranks;
    use candle_core::{DType, Storage, Tensor, WithDType};

    use crate::TrainError;
    use crate::step::GradientReducer;

    /// Elements per `MPI_Allreduce` call: MPI counts are C ints, and a BERT-large bucket is
    /// 335 M.
    const CHUNK: usize = 1 << 28;

    /// MPI's world: `MPI_COMM_WORLD`, finalised when dropped.
    pub(super) struct MpiReducer {
        world: SimpleCommunicator,
        ranks: Ranks,
        /// The process that started this rank (mpirun's daemon, slurmstepd).
        launcher: u32,
        // Declared last: finalises MPI after the communicator is gone.
        _universe: Universe,
    }

    impl std::fmt::Debug for MpiReducer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "MPI, {}", self.ranks)
        }
    }

    impl MpiReducer {
        /// Initialises MPI (funnelled: only the training thread calls it; the data thread
        /// never does) and checks that its world is the one the launcher's variables describe.
        pub(super) fn join(expected: Ranks) -> Result<Self, TrainError> {
            let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Funneled)
                .ok_or_else(|| {
                    TrainError::Config("MPI is already initialised in this process".into())
                })?;
            let world = universe.world();
            let ranks = Ranks::new(world.rank() as usize, world.size() as usize)
                .map_err(TrainError::Config)?;
            if ranks != expected {
                return Err(TrainError::Config(format!(
                    "the launcher's variables say {expected}, but MPI's world is {ranks}: start \
                     the ranks with mpirun (`mpirun -np N bertkit …`) or srun \
                     (`srun --mpi=pmix …`), which set up both"
                )));
            }
            Ok(MpiReducer {
                world,
                ranks,
                launcher: std::os::unix::process::parent_id(),
                _universe: universe,
            })
        }

        /// Fails once the launcher is gone (this rank was handed to another parent): a rank
        /// must not go on writing a run folder that a restarted job is already using. Open MPI's
        /// ranks otherwise outlive a SIGKILLed `mpirun` by about half a second, training and
        /// checkpointing all the while.
        fn check_launcher(&self) -> Result<(), TrainError> {
            let parent = std::os::unix::process::parent_id();
            if parent == self.launcher {
                return Ok(());
            }
            Err(TrainError::World(format!(
                "{}: the launcher (process {}) is gone; stopping",
                self.ranks, self.launcher
            )))
        }

        /// Rank 0's `bytes`, on every rank.
        #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
        pub(super) fn broadcast(&self, bytes: &mut [u8]) {
            use mpi::traits::Root;
            self.world.process_at_rank(0).broadcast_into(bytes);
        }

        /// `send` summed over the ranks, into a new vector.
        fn sum<T: Equivalence + Copy + Default>(&self, send: &[T]) -> Vec<T> {
            let mut received = vec![T::default(); send.len()];
            for (send, received) in send.chunks(CHUNK).zip(received.chunks_mut(CHUNK)) {
                self.world
                    .all_reduce_into(send, received, SystemOperation::sum());
            }
            received
        }

        /// A bucket summed over the ranks: sent straight from a contiguous CPU tensor's
        /// memory; other devices' buckets go through a host copy (without NCCL, a CUDA bucket
        /// crosses PCIe twice).
        fn sum_tensor<T: Equivalence + Copy + Default + WithDType>(
            &self,
            bucket: &Tensor,
        ) -> Result<Tensor, TrainError> {
            let n = bucket.elem_count();
            let summed = {
                let (storage, layout) = bucket.storage_and_layout();
                match (&*storage, layout.contiguous_offsets()) {
                    (Storage::Cpu(cpu), Some((start, end))) => {
                        self.sum(&cpu.as_slice::<T>()?[start..end])
                    }
                    _ => {
                        drop(storage);
                        self.sum(&bucket.flatten_all()?.to_vec1::<T>()?)
                    }
                }
            };
            Ok(Tensor::from_vec(summed, n, bucket.device())?)
        }
    }

    impl GradientReducer for MpiReducer {
        fn all_reduce_sum(&self, bucket: &mut Tensor) -> Result<(), TrainError> {
            self.check_launcher()?;
            *bucket = match bucket.dtype() {
                DType::F32 => self.sum_tensor::<f32>(bucket)?,
                DType::F64 => self.sum_tensor::<f64>(bucket)?,
                other => {
                    return Err(TrainError::Config(format!(
                        "gradient bucket in {other:?}: the optimiser keeps f32 or f64 masters"
                    )));
                }
            };
            Ok(())
        }

        fn all_reduce_sum_host(&self, values: &mut [f64]) -> Result<(), TrainError> {
            self.check_launcher()?;
            let summed = self.sum(values);
            values.copy_from_slice(&summed);
            Ok(())
        }

        fn ranks(&self) -> Ranks {
            self.ranks
        }

        fn abort(&self, code: i32) {
            self.world.abort(code)
        }
    }
}

#[cfg(feature = "nccl")]
mod nccl_world {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, ReduceOp};
    use candle_core::cuda_backend::{CudaStorage, cudarc};
    use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor};

    use bertkit_stage_io::Ranks;

    use crate::TrainError;
    use crate::step::GradientReducer;

    /// NCCL's communicator over one GPU per rank, on the device's stream.
    pub(super) struct NcclReducer {
        comm: Comm,
        device: Device,
        ranks: Ranks,
        /// MPI, when it bootstrapped NCCL (and stops every rank on an error).
        #[cfg(feature = "mpi")]
        mpi: Option<super::mpi_world::MpiReducer>,
    }

    impl std::fmt::Debug for NcclReducer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "NCCL on {:?}, {}", self.device.location(), self.ranks)
        }
    }

    fn nccl_err(what: &str) -> impl Fn(cudarc::nccl::result::NcclError) -> TrainError + '_ {
        move |e| TrainError::Config(format!("NCCL {what}: {e:?}"))
    }

    impl NcclReducer {
        /// Opens the local rank's GPU, shares NCCL's id from rank 0 (over MPI when `mpirun` or
        /// `srun` started the ranks and the build has MPI, else through the TCP rendezvous at
        /// `MASTER_ADDR:MASTER_PORT`) and builds the communicator on the GPU's stream.
        pub(super) fn join(ranks: Ranks, device: &str) -> Result<Self, TrainError> {
            if device != "cuda" {
                return Err(TrainError::Config(format!(
                    "device {device:?} with {ranks}: say `cuda` and each rank takes the GPU of \
                     its local rank"
                )));
            }
            let env = |name: &str| std::env::var(name).ok();
            let local = super::local_rank(env)?;
            let device = bertkit_model::parse_device(&format!("cuda:{local}"))?;
            let Device::Cuda(gpu) = &device else {
                return Err(TrainError::Config(
                    "NCCL needs a CUDA build (--features cuda,nccl)".into(),
                ));
            };
            let mut id = [0u8; 128];
            if ranks.rank == 0 {
                let fresh = Id::new().map_err(nccl_err("unique id"))?;
                for (byte, &c) in id.iter_mut().zip(fresh.internal()) {
                    *byte = c as u8;
                }
            }
            let mpi_launched = env("OMPI_COMM_WORLD_SIZE").is_some()
                || env("PMI_SIZE").is_some()
                || env("PMIX_RANK").is_some();
            #[cfg(feature = "mpi")]
            let mpi = if mpi_launched && env("MASTER_ADDR").is_none() {
                let world = super::mpi_world::MpiReducer::join(ranks)?;
                world.broadcast(&mut id);
                Some(world)
            } else {
                None
            };
            #[cfg(feature = "mpi")]
            let shared = mpi.is_some();
            #[cfg(not(feature = "mpi"))]
            let shared = false;
            if !shared {
                let (Some(addr), Some(port)) = (env("MASTER_ADDR"), env("MASTER_PORT")) else {
                    return Err(TrainError::Config(format!(
                        "{ranks} on GPUs: NCCL's id goes to the ranks over MPI (a build with \
                         --features mpi, started by mpirun or srun{}) or through MASTER_ADDR \
                         and MASTER_PORT (torchrun-style), and neither is there",
                        if mpi_launched { "; this one was" } else { "" }
                    )));
                };
                let shared = super::rendezvous(
                    &format!("{addr}:{port}"),
                    ranks,
                    (ranks.rank == 0).then_some(&id[..]),
                    id.len(),
                    super::RENDEZVOUS_TIMEOUT,
                )?;
                id.copy_from_slice(&shared);
            }
            let mut internal = [0 as core::ffi::c_char; 128];
            for (c, &byte) in internal.iter_mut().zip(&id) {
                *c = byte as core::ffi::c_char;
            }
            let comm = Comm::from_rank(
                gpu.cuda_stream(),
                ranks.rank,
                ranks.world_size,
                Id::uninit(internal),
            )
            .map_err(nccl_err("communicator"))?;
            Ok(NcclReducer {
                comm,
                device,
                ranks,
                #[cfg(feature = "mpi")]
                mpi,
            })
        }
    }

    /// The in-place sum of a contiguous CUDA tensor over the ranks, queued on the device's
    /// stream after the ops that wrote it (no host wait).
    struct AllReduceSum<'a>(&'a Comm);

    impl InplaceOp1 for AllReduceSum<'_> {
        fn name(&self) -> &'static str {
            "nccl-all-reduce-sum"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
            candle_core::bail!("NCCL sums CUDA tensors only")
        }

        fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
            if layout.contiguous_offsets() != Some((0, layout.shape().elem_count())) {
                candle_core::bail!("NCCL sums a contiguous tensor from its storage's start");
            }
            let status = match storage.dtype() {
                DType::F32 => self
                    .0
                    .all_reduce_in_place(storage.as_cuda_slice_mut::<f32>()?, &ReduceOp::Sum),
                DType::F64 => self
                    .0
                    .all_reduce_in_place(storage.as_cuda_slice_mut::<f64>()?, &ReduceOp::Sum),
                other => candle_core::bail!("NCCL sum of {other:?}: f32 or f64 buckets only"),
            };
            status
                .map(|_| ())
                .map_err(|e| candle_core::Error::Msg(format!("ncclAllReduce: {e:?}")))
        }
    }

    impl GradientReducer for NcclReducer {
        fn all_reduce_sum(&self, bucket: &mut Tensor) -> Result<(), TrainError> {
            if !bucket.is_contiguous() {
                *bucket = bucket.contiguous()?;
            }
            bucket.inplace_op1(&AllReduceSum(&self.comm))?;
            Ok(())
        }

        fn all_reduce_sum_host(&self, values: &mut [f64]) -> Result<(), TrainError> {
            let on_device = Tensor::from_slice(values, values.len(), &self.device)?;
            on_device.inplace_op1(&AllReduceSum(&self.comm))?;
            values.copy_from_slice(&on_device.to_vec1::<f64>()?);
            Ok(())
        }

        fn ranks(&self) -> Ranks {
            self.ranks
        }

        fn device(&self) -> Option<Device> {
            Some(self.device.clone())
        }

        fn abort(&self, code: i32) {
            #[cfg(feature = "mpi")]
            if let Some(mpi) = &self.mpi {
                mpi.abort(code);
            }
            // Without MPI the launcher (torchrun-style) stops the other ranks when this one
            // exits; the communicator is aborted on the way out.
            std::process::exit(code);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A local address nothing listens on (the port the system just handed out).
    fn free_address() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        format!("127.0.0.1:{}", listener.local_addr().unwrap().port())
    }

    /// Rank 0's bytes reach every rank through the TCP rendezvous, whichever rank comes
    /// first; a rank of another world size is refused by name.
    #[test]
    fn the_rendezvous_hands_rank_zeros_bytes_to_every_rank() {
        let address = free_address();
        let payload: Vec<u8> = (0..128).map(|i| (i * 7) as u8).collect();
        let threads: Vec<_> = (0..3)
            .rev()
            .map(|rank| {
                let (address, payload) = (address.clone(), payload.clone());
                std::thread::spawn(move || {
                    rendezvous(
                        &address,
                        Ranks::new(rank, 3).unwrap(),
                        (rank == 0).then_some(&payload[..]),
                        128,
                        Duration::from_secs(20),
                    )
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap().unwrap(), payload);
        }

        let address = free_address();
        let root = {
            let address = address.clone();
            std::thread::spawn(move || {
                rendezvous(
                    &address,
                    Ranks::new(0, 2).unwrap(),
                    Some(&[1u8; 128][..]),
                    128,
                    Duration::from_secs(20),
                )
            })
        };
        let stranger = rendezvous(
            &address,
            Ranks::new(1, 3).unwrap(),
            None,
            128,
            Duration::from_secs(20),
        );
        let err = root.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("says rank 1 of 3"), "{err}");
        assert!(stranger.is_err());
    }

    #[test]
    fn the_local_rank_comes_from_the_launchers_variables() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(local_rank(env(&[("SLURM_LOCALID", "3")])).unwrap(), 3);
        assert_eq!(
            local_rank(env(&[("LOCAL_RANK", "1"), ("SLURM_LOCALID", "3")])).unwrap(),
            1
        );
        assert!(
            local_rank(env(&[]))
                .unwrap_err()
                .to_string()
                .contains("LOCAL_RANK")
        );
        assert!(local_rank(env(&[("LOCAL_RANK", "x")])).is_err());
    }
}
