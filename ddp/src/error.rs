//! The errors of this crate: [`DdpError`] for `Ddp`'s calls and
//! [`CheckpointError`] for checkpoint files and tensors. They live apart
//! from the code that raises them so that the modules that share them do
//! not depend on each other.

use std::path::PathBuf;

use consort_comm::CommError;

/// Why a DDP call failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum DdpError {
    /// A collective failed.
    #[error("DDP {what} failed: {source}")]
    Comm {
        /// What DDP was doing ("bucket 2 (fc1.weight, fc1.bias)").
        what: String,
        /// The backend's error (rank, op, seq, cause).
        source: Box<CommError>,
    },
    /// A collective of a sharded strategy failed.
    #[error("rank {rank}: {strategy} {what} failed: {source}")]
    ShardComm {
        /// The reporting rank, in the world.
        rank: usize,
        /// The strategy (`fsdp`, `zero2`, ...).
        strategy: &'static str,
        /// What it was doing ("reduce_scatter of unit 2's gradients").
        what: String,
        /// The backend's error (its rank, op, seq and group are the
        /// group's: a subgroup numbers its ranks from 0).
        source: Box<CommError>,
    },
    /// The ranks do not hold the same model.
    #[error(
        "rank {rank}: the ranks do not build the same model: {detail}; ranks differing from rank 0: \
         {ranks:?}. Every rank must construct the same parameters (names, dtypes, shapes, order) \
         before wrapping it in Ddp"
    )]
    ParamMismatch {
        /// The reporting rank.
        rank: usize,
        /// The first differing parameter, as rank 0 and this rank see it.
        detail: String,
        /// Ranks whose model differs from rank 0's.
        ranks: Vec<usize>,
    },
    /// The call does not fit the model or the step.
    #[error("rank {rank}: {reason}")]
    Usage {
        /// The reporting rank.
        rank: usize,
        /// What is wrong and what to do.
        reason: String,
    },
    /// Gradients missing at `finish` without `find_unused_parameters`.
    #[error(
        "rank {rank}: {count} parameter(s) got no gradient this step: {names}. If the model does \
         not use every parameter in every step, construct Ddp with \
         DdpOptions::find_unused_parameters(true) (torch: find_unused_parameters=True); \
         otherwise call mark_ready for every parameter before finish"
    )]
    MissingGrads {
        /// The reporting rank.
        rank: usize,
        /// How many.
        count: usize,
        /// The first few names.
        names: String,
    },
    /// A checkpoint could not be written or read.
    #[error("rank {rank}: checkpoint: {reason}")]
    Checkpoint {
        /// The reporting rank.
        rank: usize,
        /// The cause.
        reason: String,
    },
    /// A peer was lost and DDP continues on the survivors
    /// (`OnPeerLost::Shrink`): this step did not happen. Redo it as rank
    /// `rank` of `world` (re-shard the data, keep the global batch).
    #[error(
        "lost rank(s) {lost:?}; continuing on the {world} survivors as rank {rank}: this step's \
         gradients were dropped, redo it on the new group (cause: {cause})"
    )]
    Shrunk {
        /// This rank in the survivors' group.
        rank: usize,
        /// The survivors.
        world: usize,
        /// The lost ranks, as the old group numbered them.
        lost: Vec<usize>,
        /// The failure that started it.
        cause: Box<DdpError>,
    },
    /// An earlier failure left this `Ddp` unusable.
    #[error(
        "this Ddp failed earlier and cannot continue (the ranks no longer agree on their \
         collectives); first error: {0}. Restart the job, from the last checkpoint"
    )]
    Failed(Box<DdpError>),
    /// An earlier failure left this `Sharded` unusable.
    #[error(
        "this Sharded model failed earlier and cannot continue (the ranks no longer agree on \
         their collectives); first error: {0}. Restart the job, from the last checkpoint (a \
         sharded one resumes at any world size)"
    )]
    ShardFailed(Box<DdpError>),
}

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not valid safetensors (or is truncated).
    #[error("{path} is not a valid safetensors file: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor's bytes do not match its dtype and shape.
    #[error("{len} bytes do not fit shape {shape:?} of {dtype}")]
    Size {
        /// Bytes given.
        len: usize,
        /// The shape.
        shape: Vec<usize>,
        /// The dtype's name.
        dtype: &'static str,
    },
}
