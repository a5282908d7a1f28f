//! consort-nccl: the NCCL backend, through cudarc.
//!
//! This crate owns:
//!
//! - [`mod@probe`]: finding libcuda, libnccl and the GPU before the first call
//!   (cudarc panics on a missing library; we return `BackendUnavailable`
//!   saying what was searched and what to install);
//! - [`keys`]: the store key of NCCL's unique id, in PyTorch's layout, so
//!   that one store serves torch and consort ranks alike;
//! - [`map`]: dtypes, reduce ops and NCCL result codes in each other's terms;
//! - [`NcclBackend`]: `Backend` on NCCL. NCCL runs its own algorithms, so
//!   this is the one backend that does not drive `consort_comm`'s
//!   schedules.
//!
//! cudarc is built with dynamic loading: the crate compiles, and its
//! non-GPU tests run, on machines without CUDA. NCCL's environment
//! variables (`NCCL_DEBUG`, `NCCL_SOCKET_IFNAME`, ...) pass through
//! untouched.

mod backend;
pub mod keys;
pub mod map;
pub mod probe;

pub use backend::{NcclBackend, NcclOptions};
pub use probe::{probe, probe_device, probe_with};
