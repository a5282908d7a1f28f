//! The process group a `--backend` flag names, for the benches and the
//! self-tests: one place that knows which backends this build has, and
//! what to say when NCCL was not built in.

use consort::{CommError, ProcessGroup};

/// The process group of `backend` (tcp, quic, gloo, nccl, or emulated:
/// NCCL's model on the emulated device).
pub(crate) async fn group(dist: &consort::Dist, backend: &str) -> Result<ProcessGroup, CommError> {
    match backend {
        "tcp" => dist.process_group().await,
        "quic" => dist.quic_process_group().await,
        "gloo" => dist.gloo_process_group().await,
        "nccl" => nccl_group(dist).await,
        "emulated" => dist.emulated_process_group().await,
        other => Err(CommError::invalid(format!(
            "unknown backend {other:?}: expected tcp, quic, gloo, nccl or emulated"
        ))),
    }
}

#[cfg(feature = "nccl")]
async fn nccl_group(dist: &consort::Dist) -> Result<ProcessGroup, CommError> {
    dist.nccl_process_group().await
}

#[cfg(not(feature = "nccl"))]
async fn nccl_group(_: &consort::Dist) -> Result<ProcessGroup, CommError> {
    Err(nccl_not_built())
}

/// The error of a build without the `nccl` feature.
#[cfg(not(feature = "nccl"))]
pub(crate) fn nccl_not_built() -> CommError {
    CommError::BackendUnavailable {
        backend: "nccl".into(),
        reason: "this consort was built without the `nccl` feature; build it with `cargo build \
                 --release -p consort --features nccl` (it needs libnccl and a GPU at run time, \
                 not to build)"
            .into(),
    }
}
