//! The reader side: one task per peer stream that decodes frames, files
//! them with the call engine (or straight into a posted receive), and takes
//! payloads out of shared-memory slots.

use super::*;

/// Reads frames from one peer into the inbox until the connection ends.
pub(super) async fn read_loop(
    inner: Arc<Inner>,
    peer: usize,
    mut r: BoxRead,
    limits: FrameLimits,
    in_place_min: usize,
) {
    let mut head = [0u8; HEADER_LEN];
    let mut bounce = vec![0u64; BOUNCE / 8];
    let why = loop {
        if let Err(e) = r.read_exact(&mut head).await {
            break if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "connection closed (EOF): its process exited or crashed".to_string()
            } else {
                format!("connection error: {e}")
            };
        }
        let h = match FrameHeader::decode(&head, &limits) {
            Ok(h) => h,
            Err(e) => {
                lock(&inner.engine).protocol_error(peer, e.to_string());
                inner.notify.notify_waiters();
                break format!("bad frame: {e}");
            }
        };
        let len = h.payload_len as usize;
        if h.in_shm() {
            match take_from_slot(&inner, peer, &h).await {
                Ok(()) => continue,
                Err(why) => {
                    lock(&inner.engine).protocol_error(peer, why.clone());
                    inner.notify.notify_waiters();
                    break why;
                }
            }
        }
        if h.kind == FrameKind::Data
            && len >= in_place_min
            && !matches!(h.fingerprint.op, OpKind::Send | OpKind::Recv)
        {
            let key = (h.fingerprint.group, peer, h.fingerprint.seq, h.tag);
            let taken = {
                let mut reg = lock(&inner.direct);
                match reg.posted.get(&key) {
                    Some(d) if d.fp == h.fingerprint && d.len == len => reg.posted.remove(&key),
                    _ => None,
                }
            };
            if let Some(d) = taken {
                match read_in_place(&inner, peer, &mut r, &mut bounce, &d).await {
                    Ok(()) => {
                        lock(&inner.engine).file(peer, h.fingerprint, h.tag, Got::Done);
                        inner.notify.notify_waiters();
                        continue;
                    }
                    Err(e) => break format!("connection error mid-frame: {e}"),
                }
            }
        }
        // Read into spare capacity: no zeroing, and the buffer comes from
        // the pool when one is big enough.
        let mut payload = inner.buffer(len);
        let mut short = None;
        while payload.len() < len {
            let mut limited = (&mut r).take((len - payload.len()) as u64);
            match limited.read_buf(&mut payload).await {
                Ok(0) => {
                    short = Some("connection closed mid-frame".to_string());
                    break;
                }
                Ok(_) => {}
                Err(e) => {
                    short = Some(format!("connection error mid-frame: {e}"));
                    break;
                }
            }
        }
        if let Some(why) = short {
            break why;
        }
        match h.kind {
            FrameKind::Abort => match h.tag {
                // Probe request: answer with the current fingerprint.
                PROBE_TAG => {
                    let asked = h.fingerprint;
                    let cur = lock(&inner.engine).probe_answer(asked.group, asked.seq);
                    let reply = probe_frame(PROBE_REPLY_TAG, cur);
                    if let Some(w) = inner.writers[peer].first() {
                        let _ = write_frame(w, &[&reply]).await;
                    }
                }
                CREDIT_TAG => {
                    let refused = match inner.shm_tx[peer].as_ref() {
                        Some(tx) => tx.give_back(h.offset as usize).err(),
                        None => Some("a shared-memory credit, but no slots are shared".into()),
                    };
                    if let Some(why) = refused {
                        lock(&inner.engine).protocol_error(peer, why);
                        inner.notify.notify_waiters();
                    }
                }
                PROBE_REPLY_TAG => {
                    if h.fingerprint.op != OpKind::NewGroup {
                        lock(&inner.engine).probe_reply(peer, h.fingerprint);
                        inner.notify.notify_waiters();
                    }
                }
                _ => {
                    match AbortInfo::decode(&payload) {
                        Ok(a) => {
                            let (AbortInfo::Mismatch { message, .. }
                            | AbortInfo::PeerLost { message, .. }
                            | AbortInfo::Timeout { message }
                            | AbortInfo::Other { message }) = &a;
                            let why = format!("rank {peer} aborted: {message}");
                            lock(&inner.engine).aborted(peer, h.fingerprint, a);
                            super::flight::dump(&inner, &why, false);
                        }
                        Err(e) => lock(&inner.engine)
                            .protocol_error(peer, format!("bad abort frame: {e}")),
                    }
                    inner.notify.notify_waiters();
                }
            },
            FrameKind::Data => {
                let frame = Frame {
                    fp: h.fingerprint,
                    payload,
                    slot: None,
                };
                lock(&inner.engine).file(peer, h.fingerprint, h.tag, Got::Frame(frame));
                inner.notify.notify_waiters();
            }
        }
    };
    lock(&inner.engine).peer_lost(peer, why);
    inner.notify.notify_waiters();
}

/// Streams a payload into a registered receive, chunk by chunk: each chunk
/// is read into the (cache-hot) bounce buffer, then copied or reduced into
/// place under the registry lock, if the call is still live (otherwise it
/// is read and dropped, keeping the stream in step).
pub(super) async fn read_in_place(
    inner: &Inner,
    peer: usize,
    r: &mut BoxRead,
    bounce: &mut [u64],
    d: &Direct,
) -> std::io::Result<()> {
    let buf: &mut [u8] = bytemuck_bytes_mut(bounce);
    let mut off = 0;
    while off < d.len {
        let n = (d.len - off).min(buf.len());
        r.read_exact(&mut buf[..n]).await?;
        let reg = lock(&inner.direct);
        if reg.live.contains(&d.call) {
            // SAFETY: the registering call is live and holds no other
            // reference to this range (see `Registry`), `off + n <= d.len`
            // bytes from `dst` lie inside its buffer, and we hold the lock.
            let dst = unsafe { std::slice::from_raw_parts_mut(d.dst.add(off), n) };
            // Chunks are whole elements: BOUNCE is a multiple of 8.
            if let Some(e) = apply(d.reduce, dst, &buf[..n]) {
                lock(&inner.engine).protocol_error(peer, e);
            }
        }
        drop(reg);
        off += n;
    }
    Ok(())
}

pub(super) fn bytemuck_bytes_mut(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 has no padding; every byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 8) }
}

/// Reduces (or copies) `data` into `dst` on the reader path; the error, if
/// any, for the call to report (it used to be dropped).
pub(super) fn apply(
    reduce: Option<(ReduceOp, DType)>,
    dst: &mut [u8],
    data: &[u8],
) -> Option<String> {
    match reduce {
        Some((op, dtype)) => op
            .apply_bytes(dtype, dst, data)
            .err()
            .map(|e| format!("reducing a received payload failed: {e}")),
        None => {
            dst.copy_from_slice(data);
            None
        }
    }
}

/// Applies a frame whose payload sits in the peer's shared-memory slot
/// `h.offset`, then hands the slot back with a credit frame.
pub(super) async fn take_from_slot(
    inner: &Inner,
    peer: usize,
    h: &FrameHeader,
) -> std::result::Result<(), String> {
    let len = h.payload_len as usize;
    let slot = h.offset as usize;
    let src = inner.shm_rx[peer]
        .as_ref()
        .filter(|r| len <= r.slot_bytes())
        .and_then(|r| r.slot(slot))
        .ok_or_else(|| format!("bad shared-memory frame (slot {slot}, {len} bytes)"))?;
    // SAFETY: the sender filled the slot and then sent this header; it does
    // not touch the slot again until our credit (see `crate::shm`).
    let data = unsafe { std::slice::from_raw_parts(src.cast_const(), len) };
    let p2p = matches!(h.fingerprint.op, OpKind::Send | OpKind::Recv);
    let key = (h.fingerprint.group, peer, h.fingerprint.seq, h.tag);
    let applied = !p2p && {
        let mut reg = lock(&inner.direct);
        let fits = reg
            .posted
            .get(&key)
            .is_some_and(|d| d.fp == h.fingerprint && d.len == len && reg.live.contains(&d.call));
        match reg.posted.remove(&key).filter(|_| fits) {
            Some(d) => {
                // SAFETY: the registering call is live, the range is its
                // own, and we hold the registry lock (see `Registry`).
                let dst = unsafe { std::slice::from_raw_parts_mut(d.dst, len) };
                if let Some(e) = apply(d.reduce, dst, data) {
                    lock(&inner.engine).protocol_error(peer, e);
                }
                true
            }
            None => false,
        }
    };
    if applied {
        lock(&inner.engine).file(peer, h.fingerprint, h.tag, Got::Done);
    } else {
        // Not posted yet: leave the payload in the slot; the call applies it
        // from there when it posts the receive, then returns the slot.
        let frame = Frame {
            fp: h.fingerprint,
            payload: Vec::new(),
            slot: Some((slot, len)),
        };
        lock(&inner.engine).file(peer, h.fingerprint, h.tag, Got::Frame(frame));
        inner.notify.notify_waiters();
        return Ok(());
    }
    inner.notify.notify_waiters();
    send_credit(inner, peer, h.fingerprint, slot).await;
    Ok(())
}

/// Hands slot `slot` back to `peer`.
pub(super) async fn send_credit(inner: &Inner, peer: usize, fp: Fingerprint, slot: usize) {
    let credit = FrameHeader {
        kind: FrameKind::Abort,
        fingerprint: fp,
        tag: CREDIT_TAG,
        offset: slot as u64,
        payload_len: 0,
        flags: 0,
    }
    .encode();
    if let Some(w) = inner.writers[peer].first() {
        // A peer that has finished and exited needs no credit back; a
        // broken connection shows up as EOF on this reader anyway.
        let _ = write_frame(w, &[&credit]).await;
    }
}
