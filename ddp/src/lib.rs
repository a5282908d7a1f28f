//! consort-ddp: data-parallel training (to be built).
//!
//! It will own `Ddp<B: Backend>`: parameter broadcast from rank 0, c10d's
//! bucket assignment, overlapped bucket all-reduce, `no_sync`, comm hooks
//! and join; state-dict `module.` prefix handling; and safetensors
//! checkpoints.
