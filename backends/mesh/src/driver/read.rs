//! The stream reader: one task per peer stream that decodes frames and
//! hands them to [`super::inbound`], reading a posted receive's payload
//! through an L2-sized bounce buffer straight into place.

use super::{inbound::*, *};

/// Reads frames from one peer stream until it ends, then reports the peer
/// lost.
pub(super) async fn read_loop(inner: Arc<Inner>, peer: usize, mut r: BoxRead) {
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
            match read_in_place(&inner, peer, &mut r, &mut bounce, &d, (0, 0)).await {
                Ok(()) => {
                    file_done(&inner, peer, &h);
                    continue;
                }
                Err(e) => break format!("connection error mid-frame: {e}"),
            }
        }
        let payload = match read_payload(&inner, peer, &mut r, &h, &mut bounce).await {
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
    bounce: &mut [u64],
) -> std::result::Result<Option<Vec<u8>>, String> {
    let len = h.payload_len as usize;
    let late = h.kind == FrameKind::Data && len >= super::poll::PROMOTE_MIN;
    let mut payload = inner.buffer(len);
    while payload.len() < len {
        if late && let Some(d) = take_posted(inner, peer, h) {
            return promote_read(inner, peer, r, bounce, &d, payload)
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
/// since its header came: the whole elements read so far are applied, the
/// rest of the frame is read in place (the stream's side of
/// `poll::promote`).
async fn promote_read(
    inner: &Inner,
    peer: usize,
    r: &mut BoxRead,
    bounce: &mut [u64],
    d: &Direct,
    payload: Vec<u8>,
) -> std::io::Result<()> {
    inner
        .late_posts
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // Elements are 1, 2, 4 or 8 bytes: a multiple of 8 is whole elements.
    let whole = payload.len() / 8 * 8;
    apply_chunk(inner, peer, d, 0, &payload[..whole]);
    // The few bytes of a split element lead the next chunk.
    let rest = payload.len() - whole;
    as_bytes(bounce)[..rest].copy_from_slice(&payload[whole..]);
    inner.recycle(payload);
    read_in_place(inner, peer, r, bounce, d, (whole, rest)).await
}

/// Streams a payload into a registered receive, chunk by chunk: each chunk
/// is read into the (cache-hot) bounce buffer, then copied or reduced into
/// place (see [`apply_chunk`]; a receive whose call has ended is read and
/// dropped, keeping the stream in step).
///
/// A promoted frame starts at byte `from` (a multiple of 8: what came
/// before is applied), and the bounce buffer's first `held` bytes (fewer
/// than 8) are already read and come next.
async fn read_in_place(
    inner: &Inner,
    peer: usize,
    r: &mut BoxRead,
    bounce: &mut [u64],
    d: &Direct,
    (from, mut held): (usize, usize),
) -> std::io::Result<()> {
    let buf = as_bytes(bounce);
    let mut off = from;
    while off < d.len {
        let n = (d.len - off).min(buf.len());
        r.read_exact(&mut buf[held..n]).await?;
        held = 0;
        // Chunks are whole elements: BOUNCE is a multiple of 8, and so is
        // every offset a chunk starts at.
        apply_chunk(inner, peer, d, off, &buf[..n]);
        off += n;
    }
    Ok(())
}

/// The bounce buffer (u64s, for alignment) as bytes.
fn as_bytes(bounce: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 has no padding; every byte pattern is a valid u8, and the
    // slice covers exactly the u64s' bytes.
    unsafe { std::slice::from_raw_parts_mut(bounce.as_mut_ptr().cast(), bounce.len() * 8) }
}
