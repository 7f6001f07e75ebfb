//! Data-parallel training across processes: the [`GradientReducer`] a run's launcher calls for.
//!
//! One process per device (or per CPU socket), started by a launcher that tells each its place
//! ([`Ranks::from_env`]: `mpirun`, `srun`, or `RANK`/`WORLD_SIZE`). Every rank holds the whole
//! model, trains on its share of each step's global batch ([`crate::data`]), and the ranks sum
//! their gradients once per optimiser step before every rank applies the same update
//! ([`crate::step`]). The collective is MPI's `MPI_Allreduce` (the `mpi` feature, OpenMPI
//! from the distribution's packages); bertkit has no collective of its own.
//!
//! A rank that dies is the launcher's to notice: `mpirun` and `srun` stop the other ranks
//! and exit non-zero, naming the rank. A rank that fails with an error stops every rank
//! through [`GradientReducer::abort`] (`MPI_Abort`) rather than leave them waiting.

use std::rc::Rc;

use bertkit_stage_io::Ranks;

use crate::TrainError;
use crate::step::{GradientReducer, Local};

/// Joins the data-parallel world the launcher started: [`Local`] for one process, MPI's for
/// several (with the `mpi` feature; without it, several ranks are refused with how to build
/// it). Call once per process, before any work; the world ends when the last handle drops.
pub fn join(ranks: Ranks) -> Result<Rc<dyn GradientReducer>, TrainError> {
    if ranks.world_size == 1 {
        return Ok(Rc::new(Local));
    }
    #[cfg(feature = "mpi")]
    {
        Ok(Rc::new(mpi_world::MpiReducer::join(ranks)?))
    }
    #[cfg(not(feature = "mpi"))]
    {
        Err(TrainError::Config(format!(
            "{ranks}: data-parallel training sums gradients over MPI, and this bertkit was built \
             without it: build with `cargo build --release --features mpi` (needs \
             libopenmpi-dev and libclang-dev), or run one process (unset the launcher's \
             RANK/WORLD_SIZE)"
        )))
    }
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
                _universe: universe,
            })
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
