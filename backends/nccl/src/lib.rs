//! consort-nccl: the NCCL backend (to be built).
//!
//! It will own the bindings to NCCL through cudarc, the detection of a
//! missing libnccl or GPU (reported as `BackendUnavailable`, never a panic),
//! the exchange of NCCL's unique id through the store under PyTorch's key
//! layout, and a native `Backend` implementation: NCCL runs its own
//! algorithms, so this is the one backend that does not drive
//! `consort_comm`'s schedules.
