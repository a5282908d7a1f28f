//! What happens to a frame once a link has decoded its header: the one
//! place both kinds of link (streams and polled queues) file frames.
//!
//! A data frame goes in place into a posted receive when the call has
//! posted one of its size (no second copy), or is filed with the engine as
//! an early or small frame. Probes are answered, probe replies and aborts
//! go to the engine.

use consort_comm::{
    par::{self, Pool},
    reduce::copy::STREAMING_MIN,
};

use super::*;

/// Takes the posted receive that a data frame of header `h` fills whole,
/// if the call has posted one and the frame is large enough to go in place.
pub(super) fn take_posted(inner: &Inner, peer: usize, h: &FrameHeader) -> Option<Direct> {
    let len = h.payload_len as usize;
    if !matches!(h.kind, FrameKind::Data | FrameKind::Pull)
        || len < inner.in_place_min
        || matches!(h.fingerprint.op, OpKind::Send | OpKind::Recv)
    {
        return None;
    }
    let key = (h.fingerprint.group, peer, h.fingerprint.seq, h.tag);
    let mut reg = lock(&inner.direct);
    match reg.posted.get(&key) {
        Some(d) if d.fp == h.fingerprint && d.len == len => reg.posted.remove(&key),
        _ => None,
    }
}

/// Reduces (or copies) `data` into `dst`, part of posted receive `d`; the
/// error, if any, for the call to report. A receive of at least
/// [`STREAMING_MIN`] bytes is copied with stores that bypass the caches: a
/// third less memory traffic where same-host ranks share the memory's
/// bandwidth (the 3-rank 64 MiB broadcast: see BENCHMARKS.md).
///
/// A large piece is split over the rank's helper threads, where it has any
/// (see `consort_comm::par`).
pub(super) fn apply(d: &Direct, dst: &mut [u8], data: &[u8]) -> Option<String> {
    let pool = Pool::shared();
    match d.reduce {
        Some((op, dtype)) => par::apply_bytes(pool, op, dtype, dst, data)
            .err()
            .map(|e| format!("reducing a received payload failed: {e}")),
        None => {
            par::copy(pool, dst, data, d.len >= STREAMING_MIN);
            None
        }
    }
}

/// Files a data frame that was applied in place.
pub(super) fn file_done(inner: &Inner, peer: usize, h: &FrameHeader) {
    lock(&inner.engine).file(peer, h.fingerprint, h.tag, Got::Done);
    inner.notify.notify_waiters();
}

/// Files a data frame whose payload was buffered.
pub(super) fn file_frame(inner: &Inner, peer: usize, h: &FrameHeader, payload: Vec<u8>) {
    lock(&inner.engine).file(peer, h.fingerprint, h.tag, Got::Frame(Frame { payload }));
    inner.notify.notify_waiters();
}

/// Handles a frame that is not data. Returns the reply to send to `peer`,
/// if any (a probe's answer).
pub(super) fn control(
    inner: &Inner,
    peer: usize,
    h: &FrameHeader,
    payload: &[u8],
) -> Option<[u8; HEADER_LEN]> {
    match h.kind {
        FrameKind::Data | FrameKind::Pull => None,
        FrameKind::Probe => {
            let asked = h.fingerprint;
            let cur = lock(&inner.engine).probe_answer(asked.group, asked.seq);
            Some(probe_frame(FrameKind::ProbeReply, cur))
        }
        FrameKind::ProbeReply => {
            if h.fingerprint.op != OpKind::NewGroup {
                lock(&inner.engine).probe_reply(peer, h.fingerprint);
                inner.notify.notify_waiters();
            }
            None
        }
        FrameKind::Abort => {
            match AbortInfo::decode(payload) {
                Ok(a) => {
                    let why = format!("rank {peer} aborted: {}", a.message());
                    lock(&inner.engine).aborted(peer, h.fingerprint, a);
                    super::flight::dump(inner, &why, false);
                }
                Err(e) => lock(&inner.engine).protocol_error(peer, format!("bad abort frame: {e}")),
            }
            inner.notify.notify_waiters();
            None
        }
    }
}

/// Reports a link that broke the protocol.
pub(super) fn broken(inner: &Inner, peer: usize, why: String) {
    lock(&inner.engine).protocol_error(peer, why);
    inner.notify.notify_waiters();
}

/// A probe (or probe reply) frame: the fingerprint is the sender's current
/// call (op NewGroup when it is in none).
pub(super) fn probe_frame(kind: FrameKind, fp: Option<Fingerprint>) -> [u8; HEADER_LEN] {
    let fingerprint = fp.unwrap_or(Fingerprint {
        group: GroupId::WORLD,
        seq: 0,
        op: OpKind::NewGroup,
        dtype: DType::U8,
        count: 0,
        root: 0,
        reduce_op: None,
    });
    FrameHeader {
        kind,
        fingerprint,
        tag: 0,
        offset: 0,
        payload_len: 0,
        flags: 0,
    }
    .encode()
}
