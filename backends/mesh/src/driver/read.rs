//! The stream reader: one task per peer stream that decodes frames and
//! hands them to [`super::inbound`], reading a posted receive's payload in
//! L2-sized chunks that its call applies (see [`super::registry`]: a
//! reader task never writes into a caller's buffer).

use super::{inbound::*, *};

/// Reads frames from one peer stream until it ends, then reports the peer
/// lost.
pub(super) async fn read_loop(inner: Arc<Inner>, peer: usize, mut r: BoxRead) {
    let mut head = [0u8; HEADER_LEN];
    let why = loop {
        if let Err(e) = r.read_exact(&mut head).await {
            break if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "connection closed (EOF): its process exited or crashed".to_string()
            } else {
                format!("connection error: {e}")
            };
        }
        let h = match FrameHeader::decode(&head, &inner.limits) {
            Ok(h) => h,
            Err(e) => {
                broken(&inner, peer, e.to_string());
                break format!("bad frame: {e}");
            }
        };
        if h.kind == FrameKind::Pull {
            let why = "a pull frame on a stream (pull frames are for shared memory only)";
            broken(&inner, peer, why.into());
            break why.to_string();
        }
        if let Some(d) = take_posted(&inner, peer, &h) {
            match read_in_place(&inner, peer, &mut r, &d, (0, Vec::new())).await {
                Ok(()) => {
                    file_done(&inner, peer, &h);
                    continue;
                }
                Err(e) => break format!("connection error mid-frame: {e}"),
            }
        }
        let payload = match read_payload(&inner, peer, &mut r, &h).await {
            Ok(Some(p)) => p,
            Ok(None) => {
                file_done(&inner, peer, &h);
                continue;
            }
            Err(why) => break why,
        };
        if h.kind == FrameKind::Data {
            file_frame(&inner, peer, &h, payload);
        } else {
            let reply = control(&inner, peer, &h, &payload);
            inner.recycle(payload);
            if let Some(reply) = reply {
                let _ = inner.send_frame(peer, 0, &reply, &[]).await;
            }
        }
    };
    lock(&inner.engine).peer_lost(peer, why);
    inner.notify.notify_waiters();
}

/// Reads the payload of frame `h` into spare capacity: no zeroing, and the
/// buffer comes from the pool when one is big enough. A large data frame
/// whose receive the call posts meanwhile goes on in place (see
/// [`promote_read`]): `None` then.
async fn read_payload(
    inner: &Inner,
    peer: usize,
    r: &mut BoxRead,
    h: &FrameHeader,
) -> std::result::Result<Option<Vec<u8>>, String> {
    let len = h.payload_len as usize;
    let late = h.kind == FrameKind::Data && len >= super::poll::PROMOTE_MIN;
    let mut payload = inner.buffer(len);
    while payload.len() < len {
        if late && let Some(d) = take_posted(inner, peer, h) {
            return promote_read(inner, peer, r, &d, payload)
                .await
                .map(|()| None)
                .map_err(|e| format!("connection error mid-frame: {e}"));
        }
        let mut limited = (&mut *r).take((len - payload.len()) as u64);
        match limited.read_buf(&mut payload).await {
            Ok(0) => return Err("connection closed mid-frame".to_string()),
            Ok(_) => {}
            Err(e) => return Err(format!("connection error mid-frame: {e}")),
        }
    }
    Ok(Some(payload))
}

/// Moves a frame being read into `payload` over to its receive `d`, posted
/// since its header came: the whole elements read so far go to the call as
/// one chunk, the rest of the frame is read in chunks (the stream's side of
/// `poll::promote`).
async fn promote_read(
    inner: &Inner,
    peer: usize,
    r: &mut BoxRead,
    d: &Direct,
    mut payload: Vec<u8>,
) -> std::io::Result<()> {
    inner
        .late_posts
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Elements are 1, 2, 4 or 8 bytes: a multiple of 8 is whole elements.
    let whole = payload.len() / 8 * 8;
    // The few bytes of a split element lead the next chunk.
    let mut held = Vec::new();
    if whole < payload.len() {
        held = inner.buffer(BOUNCE);
        held.extend_from_slice(&payload[whole..]);
    }
    payload.truncate(whole);
    deliver_owned(inner, peer, d, 0, payload);
    read_in_place(inner, peer, r, d, (whole, held)).await
}

/// Streams a payload into a registered receive, chunk by chunk: each chunk
/// is read into a buffer of its own and left for the call to copy or
/// reduce into place (see [`deliver_owned`]; a receive whose call has ended
/// is read and dropped, keeping the stream in step).
///
/// A promoted frame starts at byte `from` (a multiple of 8: what came
/// before is delivered), and `held` (fewer than 8 bytes) is already read
/// and comes next.
async fn read_in_place(
    inner: &Inner,
    peer: usize,
    r: &mut BoxRead,
    d: &Direct,
    (from, mut held): (usize, Vec<u8>),
) -> std::io::Result<()> {
    let mut off = from;
    while off < d.len {
        let n = (d.len - off).min(BOUNCE);
        let mut chunk = if held.is_empty() {
            inner.buffer(n)
        } else {
            std::mem::take(&mut held)
        };
        while chunk.len() < n {
            let mut limited = (&mut *r).take((n - chunk.len()) as u64);
            if limited.read_buf(&mut chunk).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
        // Chunks are whole elements: BOUNCE is a multiple of 8, and so is
        // every offset a chunk starts at.
        deliver_owned(inner, peer, d, off, chunk);
        off += n;
    }
    Ok(())
}
