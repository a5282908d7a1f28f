//! [`CommError`], the one error type of the communication layer, and the
//! [`ErrorContext`] (op, rank, seq) that every message carries.
//!
//! Every message says what went wrong, on which rank, in which collective and
//! call number, and what to try. Errors are `Clone` because a failed group is
//! poisoned: every later call returns the first cause again.

use std::{fmt, io, sync::Arc, time::Duration};

use crate::{Fingerprint, GroupId, OpKind, store::StoreError};

/// Where an error happened: which op, on which rank, at which sequence
/// number of which group. Fields that are unknown (an error outside a
/// collective) are `None` and left out of the message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ErrorContext {
    /// The op being run.
    pub op: Option<OpKind>,
    /// The rank that reports the error.
    pub rank: Option<usize>,
    /// The call's sequence number in its group.
    pub seq: Option<u64>,
    /// The group.
    pub group: Option<GroupId>,
}

impl ErrorContext {
    /// The context of call `seq` of `op` on `rank` in `group`.
    pub fn new(op: OpKind, rank: usize, seq: u64, group: GroupId) -> Self {
        ErrorContext {
            op: Some(op),
            rank: Some(rank),
            seq: Some(seq),
            group: Some(group),
        }
    }

    /// Fills every field that is `None` here from `other`.
    pub fn or(self, other: ErrorContext) -> Self {
        ErrorContext {
            op: self.op.or(other.op),
            rank: self.rank.or(other.rank),
            seq: self.seq.or(other.seq),
            group: self.group.or(other.group),
        }
    }
}

impl fmt::Display for ErrorContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sep = "";
        if let Some(r) = self.rank {
            write!(f, "rank {r}")?;
            sep = ", ";
        }
        if let Some(op) = self.op {
            write!(f, "{sep}{op}")?;
            sep = ", ";
        }
        if let Some(s) = self.seq {
            write!(f, "{sep}seq {s}")?;
            sep = ", ";
        }
        if let Some(g) = self.group.filter(|g| *g != GroupId::WORLD) {
            write!(f, "{sep}{g}")?;
            sep = ", ";
        }
        if sep.is_empty() {
            f.write_str("outside a collective")?;
        }
        Ok(())
    }
}

fn ranks(list: &[usize]) -> String {
    match list {
        [] => "its peers".to_string(),
        [r] => format!("rank {r}"),
        _ if list.len() <= 8 => format!("ranks {list:?}"),
        _ => format!("ranks {:?} and {} more", &list[..8], list.len() - 8),
    }
}

/// An error from a collective, a point-to-point op, or group setup.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// The op's deadline passed before it finished.
    #[error(
        "[{ctx}] timed out after {after:?} waiting for {}. A rank may have skipped this \
         collective, called a different one, or be stuck in compute; check that every rank \
         issues the same collectives in the same order, or raise the timeout \
         (CallOptions::timeout, or the group default)",
        ranks(waiting_on)
    )]
    Timeout {
        /// Where.
        ctx: ErrorContext,
        /// How long the op waited.
        after: Duration,
        /// The ranks it was still waiting on (empty when unknown).
        waiting_on: Vec<usize>,
    },

    /// A peer's process or connection went away.
    #[error(
        "[{ctx}] lost rank {peer}: {reason}. That rank's process probably died; look at its \
         log for the first error, then restart the job (a launcher such as torchrun \
         --max-restarts restarts it for you)"
    )]
    PeerLost {
        /// Where.
        ctx: ErrorContext,
        /// The rank that is gone.
        peer: usize,
        /// What was observed (connection reset, EOF, crash in the simulator).
        reason: String,
    },

    /// Two ranks issued different collectives at the same point.
    #[error(
        "[{ctx}] collective mismatch: this rank called `{local}` but rank {remote_rank} called \
         `{remote}`. Every rank must issue the same collectives, with the same dtype, length, \
         root and reduce op, in the same order; look for a collective inside a branch that \
         depends on the rank"
    )]
    Mismatch {
        /// Where.
        ctx: ErrorContext,
        /// What this rank called.
        local: Fingerprint,
        /// What the peer called.
        remote: Fingerprint,
        /// The peer.
        remote_rank: usize,
    },

    /// The caller passed something that cannot work (wrong length, bad root).
    #[error("[{ctx}] invalid argument: {reason}")]
    InvalidArgument {
        /// Where.
        ctx: ErrorContext,
        /// What was wrong and what it should be.
        reason: String,
    },

    /// The backend cannot do this (op × dtype, device memory on a CPU backend).
    #[error("[{ctx}] unsupported: {reason}")]
    Unsupported {
        /// Where.
        ctx: ErrorContext,
        /// What is not supported, and the alternative.
        reason: String,
    },

    /// The backend cannot run at all on this machine (no libnccl, no GPU,
    /// a cargo feature left out).
    #[error("backend `{backend}` is unavailable: {reason}")]
    BackendUnavailable {
        /// The backend's name.
        backend: String,
        /// Why, and what to install or enable.
        reason: String,
    },

    /// A peer sent bytes that do not follow consort's protocol.
    #[error(
        "[{ctx}] protocol error{}: {reason}. Check that every rank runs the same consort \
         version and that nothing else is talking to this port",
        peer.map(|p| format!(" from rank {p}")).unwrap_or_default()
    )]
    Protocol {
        /// Where.
        ctx: ErrorContext,
        /// The peer that sent the bad bytes, if known.
        peer: Option<usize>,
        /// What was wrong with them.
        reason: String,
    },

    /// An operating-system I/O error.
    #[error("[{ctx}] I/O error: {source}")]
    Io {
        /// Where.
        ctx: ErrorContext,
        /// The OS error.
        #[source]
        source: Arc<io::Error>,
    },

    /// The rendezvous key-value store failed.
    #[error("[{ctx}] store error: {source}")]
    Store {
        /// Where.
        ctx: ErrorContext,
        /// The store's error.
        #[source]
        source: StoreError,
    },

    /// A communication library (NCCL) reported an error.
    #[error(
        "[{ctx}] {backend} error {code}: {detail}. Run with NCCL_DEBUG=INFO (or WARN) \
         for the library's own account; a system or remote error usually means a peer died \
         or the network between GPUs is misconfigured (NCCL_SOCKET_IFNAME, NCCL_IB_DISABLE)"
    )]
    Backend {
        /// Where.
        ctx: ErrorContext,
        /// The library (`"NCCL"`).
        backend: &'static str,
        /// Its numeric result code.
        code: i32,
        /// The code's name and the library's last-error text
        /// (`ncclSystemError: ...`).
        detail: String,
    },

    /// The group was poisoned by an earlier failure (here or on a peer), or
    /// aborted by the user. Every call after a failure returns this.
    #[error(
        "[{ctx}] the group was aborted by an earlier failure: {cause}. A failed group cannot be \
         reused; fix the first error and restart the job"
    )]
    Aborted {
        /// Where.
        ctx: ErrorContext,
        /// The first failure: one of a few kinds, or its text (it may have
        /// come from another rank).
        cause: AbortCause,
    },
}

/// Why a group was aborted: one of a few kinds, each message built here
/// (as rustls keeps its alerts), or a failure's text where it came from
/// elsewhere (an earlier error, a peer).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AbortCause {
    /// An earlier failure of the group, this rank's or a peer's, as text.
    Earlier(String),
    /// Rank `rank` failed with `message`, and its abort reached this rank.
    Peer {
        /// The failed rank (in the world).
        rank: usize,
        /// What it said.
        message: String,
    },
    /// A call of the group was cancelled: its future was dropped before it
    /// finished.
    Cancelled {
        /// The call.
        op: OpKind,
        /// Its sequence number.
        seq: u64,
    },
    /// This rank's communicator was shut down or aborted (`how`).
    Closed(String),
    /// A call made before this one on this rank did not reach the stream
    /// within `after` (a stream-ordered group enqueues in the order calls
    /// were made).
    TurnTimedOut {
        /// How long the call waited.
        after: std::time::Duration,
        /// The call ahead of it, if it is known.
        ahead: Option<(OpKind, u64)>,
    },
    /// A thread or runtime the backend needs could not start.
    Spawn {
        /// What (`"the NCCL watchdog thread"`).
        what: &'static str,
        /// The system's error.
        error: String,
    },
    /// A part of the backend stopped before the call ended.
    Stopped(&'static str),
    /// A device (CUDA) call failed.
    Device {
        /// Which (`"event creation"`).
        what: &'static str,
        /// The driver's error.
        error: String,
    },
    /// Anything else, as text.
    Other(String),
}

impl fmt::Display for AbortCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AbortCause::Earlier(t) | AbortCause::Closed(t) | AbortCause::Other(t) => f.write_str(t),
            AbortCause::Peer { rank, message } => write!(f, "rank {rank} failed: {message}"),
            AbortCause::Cancelled { op, seq } => write!(
                f,
                "a {} call (seq {seq}) was cancelled: its future was dropped before it \
                 finished. Peers may be part-way through it, so the group cannot continue; make \
                 a new group, or await every call to the end",
                op.name()
            ),
            AbortCause::TurnTimedOut { after, ahead } => {
                let which = match ahead {
                    Some((op, seq)) => format!("the {} call (seq {seq})", op.name()),
                    None => "a call".into(),
                };
                write!(
                    f,
                    "waited {after:?} for its turn: {which} made before it on this rank has not \
                     reached the stream. A stream-ordered group (NCCL) enqueues a rank's calls \
                     in the order they were made, and the one ahead, made on another thread, is \
                     stuck in its enqueue"
                )
            }
            AbortCause::Spawn { what, error } => write!(f, "could not start {what}: {error}"),
            AbortCause::Stopped(what) => write!(f, "{what} stopped before the call ended"),
            AbortCause::Device { what, error } => write!(f, "CUDA {what} failed: {error}"),
        }
    }
}

impl AbortCause {
    /// Whether the message contains `text` (for matching in tests and
    /// tools).
    pub fn contains(&self, text: &str) -> bool {
        self.to_string().contains(text)
    }
}

impl From<String> for AbortCause {
    fn from(t: String) -> Self {
        AbortCause::Other(t)
    }
}

impl From<&str> for AbortCause {
    fn from(t: &str) -> Self {
        AbortCause::Other(t.to_string())
    }
}

impl CommError {
    /// The context this error carries (`None` for `BackendUnavailable`).
    pub fn context(&self) -> Option<&ErrorContext> {
        match self {
            CommError::Timeout { ctx, .. }
            | CommError::PeerLost { ctx, .. }
            | CommError::Mismatch { ctx, .. }
            | CommError::InvalidArgument { ctx, .. }
            | CommError::Unsupported { ctx, .. }
            | CommError::Protocol { ctx, .. }
            | CommError::Io { ctx, .. }
            | CommError::Store { ctx, .. }
            | CommError::Backend { ctx, .. }
            | CommError::Aborted { ctx, .. } => Some(ctx),
            CommError::BackendUnavailable { .. } => None,
        }
    }

    /// Fills in whatever op, rank, seq and group this error does not know yet.
    #[must_use]
    pub fn with_context(mut self, outer: ErrorContext) -> Self {
        match &mut self {
            CommError::Timeout { ctx, .. }
            | CommError::PeerLost { ctx, .. }
            | CommError::Mismatch { ctx, .. }
            | CommError::InvalidArgument { ctx, .. }
            | CommError::Unsupported { ctx, .. }
            | CommError::Protocol { ctx, .. }
            | CommError::Io { ctx, .. }
            | CommError::Store { ctx, .. }
            | CommError::Backend { ctx, .. }
            | CommError::Aborted { ctx, .. } => *ctx = ctx.or(outer),
            CommError::BackendUnavailable { .. } => {}
        }
        self
    }

    /// An `Aborted` with no context yet.
    pub fn aborted(cause: impl Into<AbortCause>) -> Self {
        CommError::Aborted {
            ctx: ErrorContext::default(),
            cause: cause.into(),
        }
    }

    /// An `InvalidArgument` with no context yet.
    pub fn invalid(reason: impl Into<String>) -> Self {
        CommError::InvalidArgument {
            ctx: ErrorContext::default(),
            reason: reason.into(),
        }
    }

    /// An `Unsupported` with no context yet.
    pub fn unsupported(reason: impl Into<String>) -> Self {
        CommError::Unsupported {
            ctx: ErrorContext::default(),
            reason: reason.into(),
        }
    }

    /// A `Protocol` error with no context yet.
    pub fn protocol(peer: Option<usize>, reason: impl Into<String>) -> Self {
        CommError::Protocol {
            ctx: ErrorContext::default(),
            peer,
            reason: reason.into(),
        }
    }

    /// The poisoned-group error that every call after `self` returns.
    pub fn to_aborted(&self) -> CommError {
        match self {
            CommError::Aborted { .. } => self.clone(),
            other => CommError::Aborted {
                ctx: ErrorContext::default(),
                cause: AbortCause::Earlier(other.to_string()),
            },
        }
    }
}

impl From<io::Error> for CommError {
    fn from(e: io::Error) -> Self {
        CommError::Io {
            ctx: ErrorContext::default(),
            source: Arc::new(e),
        }
    }
}

impl From<StoreError> for CommError {
    fn from(e: StoreError) -> Self {
        CommError::Store {
            ctx: ErrorContext::default(),
            source: e,
        }
    }
}

/// `Result` with [`CommError`].
pub type Result<T, E = CommError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn messages_name_rank_op_seq_and_a_remedy() {
        let ctx = ErrorContext::new(OpKind::AllReduce, 3, 17, GroupId::WORLD);
        let e = CommError::Timeout {
            ctx,
            after: Duration::from_secs(30),
            waiting_on: vec![2],
        };
        let s = e.to_string();
        assert!(
            s.starts_with("[rank 3, all_reduce, seq 17] timed out after 30s waiting for rank 2")
        );
        assert!(s.contains("raise the timeout"));

        let fp = |op, count| Fingerprint {
            group: GroupId::WORLD,
            seq: 4,
            op,
            dtype: DType::F32,
            count,
            root: 0,
            reduce_op: None,
        };
        let m = CommError::Mismatch {
            ctx: ErrorContext::new(OpKind::Broadcast, 0, 4, GroupId::WORLD),
            local: fp(OpKind::Broadcast, 8),
            remote: fp(OpKind::AllGather, 9),
            remote_rank: 1,
        };
        let s = m.to_string();
        assert!(s.contains("broadcast #4 on world: 8 x float32"), "{s}");
        assert!(
            s.contains("rank 1 called `all_gather #4 on world: 9 x float32`"),
            "{s}"
        );
    }

    #[test]
    fn context_is_filled_not_overwritten() {
        let e = CommError::invalid("bad").with_context(ErrorContext {
            rank: Some(1),
            ..Default::default()
        });
        let e = e.with_context(ErrorContext::new(OpKind::Gather, 5, 2, GroupId::WORLD));
        assert_eq!(e.context().unwrap().rank, Some(1));
        assert_eq!(e.context().unwrap().op, Some(OpKind::Gather));
        assert_eq!(
            e.to_string(),
            "[rank 1, gather, seq 2] invalid argument: bad"
        );
        assert_eq!(
            CommError::invalid("x").to_string(),
            "[outside a collective] invalid argument: x"
        );
    }

    #[test]
    fn aborted_keeps_the_first_cause() {
        let first = CommError::PeerLost {
            ctx: ErrorContext::new(OpKind::Barrier, 0, 1, GroupId::WORLD),
            peer: 2,
            reason: "connection reset".into(),
        };
        let a = first.to_aborted();
        assert!(a.to_string().contains("lost rank 2: connection reset"));
        assert_eq!(a.to_aborted().to_string(), a.to_string());
    }
}
