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
//!
//! # Example
//!
//! 1F1B on four pipeline ranks with eight microbatches: the actions rank 0
//! runs first (torch's notation: `0F1` is stage 0's forward of microbatch
//! 1), and the bubble on the cost model, the textbook `(p-1)/(m+p-1)`.
//! The runtime over a real group is in the user guide's pipeline chapter
//! (`consort::manual::pipeline`).
//!
//! ```
//! use consort_pipeline::{Schedule, ScheduleKind, cost};
//!
//! // PipelineScheduleSingle: Schedule1F1B(stage, n_microbatches=8), pp = 4
//! let s = Schedule::new(ScheduleKind::OneFOneB, 4, 8, 1)?;
//! let first: Vec<String> = s.steps(0).iter().flat_map(|st| st.actions())
//!     .take(5).map(|a| a.to_string()).collect();
//! assert_eq!(first, ["0F0", "0F1", "0F2", "0F3", "0B0"]);
//!
//! let t = cost::simulate(&s, &cost::Costs::default())?;
//! assert!((t.bubble - 3.0 / 11.0).abs() < 1e-9);
//! assert_eq!(t.peak_activations, [4, 3, 2, 1]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod cost;
pub mod runtime;
pub mod schedule;

pub use runtime::{PipelineError, PipelineRuntime, Stage, StepOutput, Tensor};
pub use schedule::{Action, Kind, Schedule, ScheduleError, ScheduleKind, Step};
