//! What a finished call leaves behind, shared by the communication thread
//! ([`super::job`]) and the driver's gates ([`super::gates`]): its [`Slot`]
//! (error or output), the host caller's [`Reply`], and the emulated
//! equivalent of NCCL's remote error for a lost peer.

use consort_comm::{CommError, Result, ordered::check};

/// What a host call gets back: its output bytes.
pub(super) type Reply = tokio::sync::oneshot::Sender<Result<Option<Vec<u8>>>>;

/// What one call came to on the communication thread: its error (the
/// emulated GPU's asynchronous error, for this call), or a host call's
/// output bytes.
#[derive(Default)]
pub(super) struct Slot {
    pub(super) err: Option<CommError>,
    pub(super) out: Option<Vec<u8>>,
}

/// A lost peer as NCCL reports it, without the rank: `ncclRemoteError`
/// ("connection closed by remote peer", and an address), or
/// `ncclSystemError` when the connection was reset. The rank is then named
/// the way it is on NCCL, by the fingerprint check's side channel
/// (`consort_comm::ordered::check::LostPeer`). Other failures stand.
pub(super) fn remote_error(e: CommError) -> CommError {
    match e {
        CommError::PeerLost { ctx, reason, .. } => {
            let (code, name) = if reason.to_ascii_lowercase().contains("reset") {
                (check::NCCL_SYSTEM_ERROR, "ncclSystemError")
            } else {
                (check::NCCL_REMOTE_ERROR, "ncclRemoteError")
            };
            CommError::Backend {
                ctx,
                backend: REMOTE_BACKEND,
                code,
                detail: format!("{name} (the data path lost a peer: {reason})"),
            }
        }
        other => other,
    }
}

/// The backend name of [`remote_error`]'s failures.
const REMOTE_BACKEND: &str = "NCCL (emulated)";

/// Whether `e` is [`remote_error`]'s, a failure that names no rank.
pub(super) fn is_remote_error(e: &CommError) -> bool {
    matches!(e, CommError::Backend { backend, code, .. } if *backend == REMOTE_BACKEND && check::may_be_lost_peer(*code))
}

#[cfg(test)]
mod tests {
    use consort_comm::{CommError, ErrorContext};

    use super::{is_remote_error, remote_error};

    fn lost(reason: &str) -> CommError {
        CommError::PeerLost {
            ctx: ErrorContext::default(),
            peer: 2,
            reason: reason.into(),
        }
    }

    /// A lost peer loses its rank, as on NCCL, with the code NCCL's socket
    /// transport would give: both are held for the side channel's name.
    #[test]
    fn a_lost_peer_is_reported_as_nccl_reports_it() {
        let closed = remote_error(lost("it left before reading this rank's payload"));
        let reset = remote_error(lost("send failed: Connection reset by peer (os error 104)"));
        for (e, code) in [(&closed, 6), (&reset, 2)] {
            match e {
                CommError::Backend {
                    code: c, detail, ..
                } => {
                    assert_eq!(*c, code, "{detail}");
                    assert!(!detail.contains("rank 2"), "{detail}");
                }
                other => panic!("{other}"),
            }
            assert!(is_remote_error(e), "{e}");
        }
        let other = remote_error(CommError::invalid("bad length"));
        assert!(!is_remote_error(&other), "{other}");
    }
}
