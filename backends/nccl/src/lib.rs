//! consort-nccl: the NCCL backend, stream-ordered as torch's
//! `ProcessGroupNCCL`, and CUDA device memory for device-resident DDP.
//!
//! This crate owns:
//!
//! - [`sys`]: NCCL opened by consort itself (`libnccl.so.2` from
//!   `CONSORT_NCCL_LIBRARY`, the loader's path, or a Python environment's
//!   pip wheel), its symbol table, and its C constants;
//! - [`mod@probe`]: finding libcuda, libnccl and the GPU before the first
//!   call (a miss is `BackendUnavailable` saying what was searched and what
//!   to install, never a panic);
//! - [`keys`]: the store key of NCCL's unique id, in PyTorch's layout, so
//!   that one store serves torch and consort ranks alike;
//! - [`map`]: dtypes, reduce ops and NCCL result codes in each other's terms;
//! - [`NcclBackend`]: `Backend` on NCCL: calls on device buffers are
//!   enqueued and return, a watchdog thread per communicator tracks them
//!   (the private `work` module), and calls on host buffers are staged
//!   (pinned memory from a pool) and enqueued when they are made too. NCCL runs its own algorithms, so this is
//!   the one backend that does not drive `consort_comm`'s schedules;
//! - [`CudaDevice`]: `consort_comm::Device` on a CUDA context, for DDP's
//!   device buckets.
//!
//! cudarc (the CUDA driver only) is built with dynamic loading: the crate
//! compiles, and its non-GPU tests run, on machines without CUDA. (Its
//! feature is `fallback-dynamic-loading`, so that a build with candle's
//! CUDA, which links the CUDA libraries, can hold both.) NCCL's
//! environment variables (`NCCL_DEBUG`, `NCCL_SOCKET_IFNAME`, ...) pass
//! through untouched; consort's own are listed in `consort::env`.
//!
//! # Example
//!
//! In a job, `Dist::nccl_process_group` (the facade's feature `nccl`)
//! does this with the job's store and `LOCAL_RANK`'s GPU. By hand:
//!
//! ```no_run
//! use std::sync::Arc;
//! use consort_comm::{ProcessGroup, ReduceOp, Store};
//! use consort_nccl::{NcclBackend, NcclOptions};
//!
//! # async fn demo(store: Arc<dyn Store>, rank: usize, world_size: usize, local_rank: usize)
//! #     -> consort_comm::Result<()> {
//! consort_nccl::probe()?; // libcuda and libnccl, or an error naming what to install
//! let opts = NcclOptions { device: Some(local_rank), ..NcclOptions::default() };
//! // NCCL's unique id goes through the store under torch's key
//! let nccl = NcclBackend::new(&*store, rank, world_size, opts).await?;
//! let pg = ProcessGroup::new(Arc::new(nccl));
//! let mut loss = [0.25f32]; // host memory: staged through pinned buffers
//! pg.all_reduce(&mut loss, ReduceOp::Avg).await?;
//! # Ok(()) }
//! ```

mod backend;
pub mod cuda;
pub mod keys;
pub mod map;
pub mod probe;
mod staging;
pub mod sys;
mod work;

pub use backend::{NcclBackend, NcclOptions};
pub use cuda::{CudaDevice, DEFAULT_SYNC_TIMEOUT};
/// The cudarc consort is built with (driver and NVRTC, loaded at run time).
pub use cudarc;
pub use probe::{load_nccl, probe, probe_device, probe_with};
