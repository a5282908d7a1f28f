//! What `Ddp::new` does before training: checking that every rank holds
//! the same model, and copying rank 0's parameters and buffers to every
//! rank in coalesced broadcasts.

use consort_comm::{Backend, Buffer, BufferMut, CallOptions};

use crate::{
    error::DdpError,
    params::{ParamSet, ParamSpec},
};

/// 64-bit FNV-1a.
pub(crate) fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The coalesced broadcast size (torch's `broadcast_bucket_size`, 250 MB).
const BROADCAST_CHUNK: usize = 250 * 1024 * 1024;

/// All-gathers a digest of every rank's model; on a difference, finds and
/// names the first differing parameter.
pub(crate) async fn check_same_model<B: Backend + ?Sized>(
    backend: &B,
    specs: &[ParamSpec],
    buffers: &[ParamSpec],
    opts: &CallOptions,
) -> Result<(), DdpError> {
    let rank = backend.rank();
    let world = backend.world_size();
    let comm = |what: &str| {
        let what = what.to_string();
        move |source| DdpError::Comm {
            what,
            source: Box::new(source),
        }
    };
    let lines: Vec<String> = specs
        .iter()
        .map(ParamSpec::describe)
        .chain(buffers.iter().map(|b| format!("buffer {}", b.describe())))
        .collect();
    let text = lines.join("\n");
    let mine = [lines.len() as u64, fnv(text.as_bytes())];
    let mut all = vec![0u64; 2 * world];
    backend
        .all_gather(BufferMut::from(&mut all), Buffer::from(&mine[..]), opts)
        .await
        .map_err(comm("model check (all_gather of parameter digests)"))?;
    if all.chunks(2).all(|c| c == &all[..2]) {
        return Ok(());
    }
    // Rank 0's description, to every rank: length, then bytes.
    let root = CallOptions { root: 0, ..*opts };
    let mut len = [text.len() as u64];
    backend
        .broadcast(BufferMut::from(&mut len[..]), &root)
        .await
        .map_err(comm("model check (broadcast of rank 0's parameter list)"))?;
    let mut theirs = vec![0u8; len[0] as usize];
    if rank == 0 {
        theirs.copy_from_slice(text.as_bytes());
    }
    backend
        .broadcast(BufferMut::from(&mut theirs), &root)
        .await
        .map_err(comm("model check (broadcast of rank 0's parameter list)"))?;
    let theirs = String::from_utf8_lossy(&theirs).into_owned();
    let theirs: Vec<&str> = theirs.split('\n').filter(|l| !l.is_empty()).collect();
    let first = (0..lines.len().max(theirs.len()))
        .find(|&k| lines.get(k).map(String::as_str) != theirs.get(k).copied());
    let mut diff = vec![0u64; world];
    let my_diff = [first.map_or(u64::MAX, |k| k as u64)];
    backend
        .all_gather(BufferMut::from(&mut diff), Buffer::from(&my_diff[..]), opts)
        .await
        .map_err(comm("model check (all_gather of first differences)"))?;
    let ranks: Vec<usize> = (0..world).filter(|&r| diff[r] != u64::MAX).collect();
    let detail = match first {
        Some(k) => format!(
            "parameter #{k} is `{}` on rank 0 but `{}` on rank {rank}",
            theirs.get(k).copied().unwrap_or("(none)"),
            lines.get(k).map_or("(none)", String::as_str)
        ),
        None => {
            let k = diff.iter().copied().min().unwrap_or(0);
            format!(
                "this rank matches rank 0; the first difference elsewhere is at parameter #{k} \
                 (`{}` on rank 0)",
                theirs.get(k as usize).copied().unwrap_or("(none)")
            )
        }
    };
    Err(DdpError::ParamMismatch {
        rank,
        detail,
        ranks,
    })
}

/// Broadcasts the given parameters and buffers from rank 0, concatenated
/// into chunks of up to 250 MiB (one broadcast per chunk, not per tensor).
pub(crate) async fn broadcast_tensors<B: Backend + ?Sized>(
    backend: &B,
    model: &mut (impl ParamSet + ?Sized),
    params: &[ParamSpec],
    buffers: &[ParamSpec],
    opts: &CallOptions,
) -> Result<(), DdpError> {
    if backend.world_size() < 2 {
        return Ok(());
    }
    let root = CallOptions { root: 0, ..*opts };
    // (is buffer, index, bytes)
    let items: Vec<(bool, usize, usize)> = params
        .iter()
        .enumerate()
        .map(|(i, p)| (false, i, p.bytes()))
        .chain(
            buffers
                .iter()
                .enumerate()
                .map(|(i, b)| (true, i, b.bytes())),
        )
        .collect();
    let mut start = 0;
    while start < items.len() {
        let mut end = start;
        let mut bytes = 0;
        while end < items.len() && (end == start || bytes + items[end].2 <= BROADCAST_CHUNK) {
            bytes += items[end].2;
            end += 1;
        }
        let mut flat = vec![0u8; bytes];
        let mut off = 0;
        for &(buf, i, len) in &items[start..end] {
            let src = if buf {
                model.buffer_bytes_mut(i)
            } else {
                model.param_bytes_mut(i)
            };
            if src.len() == len {
                flat[off..off + len].copy_from_slice(src);
            }
            off += len;
        }
        backend
            .broadcast(BufferMut::from(&mut flat), &root)
            .await
            .map_err(|source| DdpError::Comm {
                what: "broadcast of rank 0's parameters and buffers".into(),
                source: Box::new(source),
            })?;
        let mut off = 0;
        for &(buf, i, len) in &items[start..end] {
            let dst = if buf {
                model.buffer_bytes_mut(i)
            } else {
                model.param_bytes_mut(i)
            };
            if dst.len() == len {
                dst.copy_from_slice(&flat[off..off + len]);
            }
            off += len;
        }
        start = end;
    }
    Ok(())
}
