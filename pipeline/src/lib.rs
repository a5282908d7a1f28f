//! Pipeline parallelism for consort, as `torch.distributed.pipelining`.
//!
//! - [`schedule`]: torch's seven schedules (GPipe, 1F1B, Interleaved1F1B,
//!   LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) as action
//!   lists per pipeline rank, equal to what torch runs.
//! - [`cost`]: a schedule timed on a cost model: its bubble fraction and
//!   the activations each rank holds at its peak.
//! - [`runtime`]: runs one rank's list over any backend: microbatches
//!   split and merged, batched point-to-point with the neighbouring stages,
//!   a shape handshake on the first step, the loss on the last stage,
//!   gradients accumulated over microbatches and handed to a data-parallel
//!   reduction. The stage itself is the user's ([`runtime::Stage`]), so any
//!   tensor library fits.
//!
//! This crate depends on `consort-comm` alone.

pub mod cost;
pub mod runtime;
pub mod schedule;

pub use runtime::{PipelineError, PipelineRuntime, Stage, StepOutput, Tensor};
pub use schedule::{Action, Kind, Schedule, ScheduleError, ScheduleKind, Step};
