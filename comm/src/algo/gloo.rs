//! Gloo's own schedules, message for message, so that a consort rank can be
//! a member of a torch `gloo` process group.
//!
//! A Gloo peer matches the k-th send and the k-th receive of each (peer,
//! slot), and refuses a payload longer than the receive posted for it. A
//! rank joining torch's ranks must therefore post the same sends and
//! receives, with the same slots and byte ranges, in the same order per
//! peer, as gloo's `allreduce` (ring), `broadcast`, `allgather` and
//! `barrier` do; the reductions also run in the same order, so that every
//! rank's result is the one an all-torch group computes, bit for bit.
//! Written from gloo/{allreduce,broadcast,allgather,barrier}.cc and
//! gloo/types.h.
//!
//! These functions own the schedule only: the messages go through a
//! [`GlooIo`] (the TCP pairs in consort-tcp, in-memory queues in the
//! tests), and the reduction is the caller's.

use async_trait::async_trait;

use crate::Result;

/// Slot prefixes per collective (gloo/types.h).
pub mod prefix {
    /// `gloo::gather`.
    pub const GATHER: u8 = 0x01;
    /// `gloo::allgather`.
    pub const ALLGATHER: u8 = 0x02;
    /// `gloo::reduce`.
    pub const REDUCE: u8 = 0x03;
    /// `gloo::allreduce`.
    pub const ALLREDUCE: u8 = 0x04;
    /// `gloo::scatter`.
    pub const SCATTER: u8 = 0x05;
    /// `gloo::broadcast`.
    pub const BROADCAST: u8 = 0x06;
    /// `gloo::barrier`.
    pub const BARRIER: u8 = 0x07;
    /// `gloo::alltoall`.
    pub const ALLTOALL: u8 = 0x08;
}

/// `gloo::Slot::build(prefix, tag)`: the prefix in the top byte, the tag in
/// the 32 bits below it, 24 bits left for a collective's own offsets.
pub fn slot(prefix: u8, tag: u32) -> u64 {
    (u64::from(prefix) << 56) | (u64::from(tag) << 24)
}

/// Gloo's `AllreduceOptions::kMaxSegmentSize`: the ring's largest segment.
pub const MAX_SEGMENT_BYTES: usize = 1 << 20;

/// The messages of one Gloo context, as seen by one rank.
#[async_trait]
pub trait GlooIo: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the context.
    fn size(&self) -> usize;
    /// Posts a send of `data` (copied now) to `peer` on `slot`. The driver
    /// must not let the call end before every send it posted is written
    /// (Gloo's `waitSend`); the schedules here leave that wait to it.
    fn post_send(&self, peer: usize, slot: u64, data: &[u8]) -> Result<()>;
    /// Posts a receive of up to `len` bytes from `peer` on `slot`.
    fn post_recv(&self, peer: usize, slot: u64, len: usize) -> Result<()>;
    /// Waits for the oldest posted receive from `peer` on `slot`.
    async fn wait_recv(&self, peer: usize, slot: u64) -> Result<Vec<u8>>;
    /// Takes back a payload [`GlooIo::wait_recv`] returned, once used.
    fn recycle(&self, data: Vec<u8>) {
        drop(data);
    }
}

/// Waits for the oldest receive from `peer` on `slot` and puts its
/// payload into `dst`, combined with what is there when `combine` is given.
/// The payload must be exactly `dst.len()` bytes: Gloo lets a shorter one
/// fill part of a receive, which between two calls of different sizes
/// would leave stale bytes.
async fn recv_into(
    io: &dyn GlooIo,
    peer: usize,
    slot: u64,
    dst: &mut [u8],
    combine: Option<Combine<'_>>,
) -> Result<()> {
    let data = io.wait_recv(peer, slot).await?;
    if data.len() != dst.len() {
        return Err(crate::CommError::aborted(format!(
            "rank {peer} sent {} bytes where rank {} expected {}: the two ranks called \
                 collectives of different sizes at this point",
            data.len(),
            io.rank(),
            dst.len()
        )));
    }
    match combine {
        Some(c) => c(dst, &data)?,
        None => dst.copy_from_slice(&data),
    }
    io.recycle(data);
    Ok(())
}

/// Combines `src` into `dst` (both whole elements): `dst = dst ⊕ src`.
pub type Combine<'a> = &'a (dyn Fn(&mut [u8], &[u8]) -> Result<()> + Send + Sync);

/// One segment of the ring: where it starts and how many bytes of it are
/// in the buffer (none, or fewer than a segment, at the end).
#[derive(Clone, Copy, Debug)]
struct Seg {
    send_off: usize,
    recv_off: usize,
    send_len: isize,
    recv_len: isize,
}

/// The ring's segment geometry for `total` bytes of `elem`-byte elements.
#[derive(Clone, Copy, Debug)]
struct Ring {
    total: usize,
    rank: usize,
    segments: usize,
    per_rank: usize,
    seg_bytes: usize,
}

impl Seg {
    fn send(&self) -> std::ops::Range<usize> {
        self.send_off..self.send_off + self.send_len.max(0) as usize
    }
    fn recv(&self) -> std::ops::Range<usize> {
        self.recv_off..self.recv_off + self.recv_len.max(0) as usize
    }
}

/// One phase of the ring with two segments in flight: round `i` posts
/// segment `i`'s receive (from rank + 1) and send (to rank - 1) while
/// `i < posts`, and from round 2 on takes segment `i - 2`'s payload into
/// place (combined or copied): gloo's loop in allreduce.cc and reduce.cc.
async fn ring_phase(
    io: &dyn GlooIo,
    slot: u64,
    buf: &mut [u8],
    posts: usize,
    seg: impl Fn(usize) -> Seg,
    combine: Option<Combine<'_>>,
) -> Result<()> {
    let (size, rank) = (io.size(), io.rank());
    let recv_rank = (rank + 1) % size;
    let send_rank = (rank + size - 1) % size;
    for i in 0..posts + 2 {
        if i >= 2 {
            let prev = seg(i - 2);
            if prev.recv_len > 0 {
                recv_into(io, recv_rank, slot, &mut buf[prev.recv()], combine).await?;
            }
        }
        if i < posts {
            let cur = seg(i);
            if cur.recv_len > 0 {
                io.post_recv(recv_rank, slot, cur.recv().len())?;
            }
            if cur.send_len > 0 {
                io.post_send(send_rank, slot, &buf[cur.send()])?;
            }
        }
    }
    Ok(())
}

impl Ring {
    fn new(total: usize, elem: usize, size: usize, rank: usize) -> Ring {
        let max_seg = elem * (MAX_SEGMENT_BYTES / elem).max(1);
        let segments = total.div_ceil(max_seg).max(size * 2).next_multiple_of(size);
        let seg_bytes = total.div_ceil(segments).next_multiple_of(elem);
        Ring {
            total,
            rank,
            segments,
            per_rank: segments / size,
            seg_bytes,
        }
    }

    /// Segment `i` of a phase whose sends start at chunk `send_chunk` and
    /// receives at `recv_chunk`.
    fn seg(&self, i: usize, send_chunk: usize, recv_chunk: usize) -> Seg {
        let span = self.segments * self.seg_bytes;
        let send_off = ((send_chunk * self.per_rank + i) * self.seg_bytes) % span;
        let recv_off = ((recv_chunk * self.per_rank + i) * self.seg_bytes) % span;
        let len = |off: usize| (self.seg_bytes as isize).min(self.total as isize - off as isize);
        Seg {
            send_off,
            recv_off,
            send_len: len(send_off),
            recv_len: len(recv_off),
        }
    }

    fn reduce_scatter(&self, i: usize) -> Seg {
        self.seg(i, self.rank + 1, self.rank + 2)
    }

    fn all_gather(&self, i: usize) -> Seg {
        self.seg(i, self.rank, self.rank + 1)
    }

    /// Iterations of each phase: sends stop two before the end, where the
    /// last receives are waited for.
    fn steps(&self) -> usize {
        self.segments - self.per_rank
    }
}

/// gloo's `allreduce` with its default (ring) algorithm, in place on
/// `buf`, whose elements are `elem` bytes: a reduce-scatter then an
/// all-gather around the ring (send to rank - 1, receive from rank + 1),
/// in segments of at most 1 MiB, two in flight.
pub async fn allreduce(
    io: &dyn GlooIo,
    tag: u32,
    buf: &mut [u8],
    elem: usize,
    combine: Combine<'_>,
) -> Result<()> {
    let (size, rank) = (io.size(), io.rank());
    if buf.is_empty() || size == 1 {
        return Ok(());
    }
    let slot = slot(prefix::ALLREDUCE, tag);
    let ring = Ring::new(buf.len(), elem, size, rank);
    let steps = ring.steps();
    ring_phase(
        io,
        slot,
        buf,
        steps,
        |i| ring.reduce_scatter(i),
        Some(combine),
    )
    .await?;
    ring_phase(io, slot, buf, steps, |i| ring.all_gather(i), None).await?;
    Ok(())
}

/// gloo's `broadcast` from `root`, in place: a binomial tree over ranks
/// renumbered so that the root is 0, each rank receiving the whole buffer
/// once and then sending it on.
pub async fn broadcast(io: &dyn GlooIo, tag: u32, buf: &mut [u8], root: usize) -> Result<()> {
    let (size, rank) = (io.size(), io.rank());
    let slot = slot(prefix::BROADCAST, tag);
    let vrank = (rank + size - root) % size;
    let dim = size.next_power_of_two().trailing_zeros();
    let mut mask = (1usize << dim) - 1;
    for i in 0..dim {
        mask ^= 1 << i;
        if vrank & mask != 0 {
            continue;
        }
        let vpeer = vrank ^ (1 << i);
        if vpeer >= size {
            continue;
        }
        let peer = (vpeer + root) % size;
        if vrank & (1 << i) == 0 {
            io.post_send(peer, slot, buf)?;
        } else {
            io.post_recv(peer, slot, buf.len())?;
            recv_into(io, peer, slot, buf, None).await?;
        }
    }
    Ok(())
}

/// gloo's `allgather`: `input` goes to part `rank` of `out` (`size` equal
/// parts), and the parts go around the ring (send to rank + 1, receive
/// from rank - 1), each part in two halves.
pub async fn allgather(io: &dyn GlooIo, tag: u32, out: &mut [u8], input: &[u8]) -> Result<()> {
    let (size, rank) = (io.size(), io.rank());
    let slot = slot(prefix::ALLGATHER, tag);
    let part = input.len();
    out[rank * part..(rank + 1) * part].copy_from_slice(input);
    if size == 1 || out.is_empty() {
        return Ok(());
    }
    let recv_rank = (rank + size - 1) % size;
    let send_rank = (rank + 1) % size;
    let chunk = [part / 2, part - part / 2];
    let chunk_off = [0, part / 2];
    let total = out.len();
    // (offset, length) of the receives in flight, oldest first.
    let mut waiting = std::collections::VecDeque::new();
    for i in 0..(size - 1) * 2 {
        let send_seg = size + rank - i / 2;
        let recv_seg = send_seg - 1;
        let send_off = (send_seg * part + chunk_off[i & 1]) % total;
        let recv_off = (recv_seg * part + chunk_off[i & 1]) % total;
        let len = chunk[i & 1];
        if i >= 2 {
            let (at, n): (usize, usize) = waiting.pop_front().expect("two receives in flight");
            recv_into(io, recv_rank, slot, &mut out[at..at + n], None).await?;
        }
        io.post_send(send_rank, slot, &out[send_off..send_off + len])?;
        io.post_recv(recv_rank, slot, len)?;
        waiting.push_back((recv_off, len));
    }
    while let Some((at, n)) = waiting.pop_front() {
        recv_into(io, recv_rank, slot, &mut out[at..at + n], None).await?;
    }
    Ok(())
}

/// gloo's `reduce` to `root`, in place: the ring's reduce-scatter (its own
/// segment sizes: at most 1 MiB, at least 2 x world segments, a send ahead
/// of every reduction) leaves chunk `r` reduced on rank `r`, and every
/// rank sends its chunk to the root. Other ranks' buffers end partly
/// reduced, as in torch.
pub async fn reduce(
    io: &dyn GlooIo,
    tag: u32,
    buf: &mut [u8],
    elem: usize,
    root: usize,
    combine: Combine<'_>,
) -> Result<()> {
    let (size, rank) = (io.size(), io.rank());
    let total = buf.len();
    if total == 0 || size == 1 {
        return Ok(());
    }
    let slot = slot(prefix::REDUCE, tag);
    let max_seg = elem * (MAX_SEGMENT_BYTES / elem);
    let seg_bytes = total.div_ceil(size * 2).min(max_seg).next_multiple_of(elem);
    let segments = total
        .div_ceil(seg_bytes)
        .max(size * 2)
        .next_multiple_of(size);
    let ring = Ring {
        total,
        rank,
        segments,
        per_rank: segments / size,
        seg_bytes,
    };
    // Every round but the last two posts (gloo: `i < numSegments - 2`).
    let posts = segments - 2;
    ring_phase(
        io,
        slot,
        buf,
        posts,
        |i| ring.reduce_scatter(i),
        Some(combine),
    )
    .await?;
    let chunk = ring.per_rank * seg_bytes;
    let part = |r: usize| {
        let off = r * chunk;
        off..(off + chunk).min(total).max(off)
    };
    if rank == root {
        let peers: Vec<usize> = (0..size)
            .filter(|&r| r != rank && part(r).start < total)
            .collect();
        for &r in &peers {
            io.post_recv(r, slot, part(r).len())?;
        }
        for &r in &peers {
            recv_into(io, r, slot, &mut buf[part(r)], None).await?;
        }
    } else if part(rank).start < total {
        io.post_send(root, slot, &buf[part(rank)])?;
    }
    Ok(())
}

/// gloo's `gather` to `root`: every other rank sends its `input`, and the
/// root places each in `out` (`Some` on the root only) by rank.
pub async fn gather(
    io: &dyn GlooIo,
    tag: u32,
    out: Option<&mut [u8]>,
    input: &[u8],
    root: usize,
) -> Result<()> {
    let (size, rank) = (io.size(), io.rank());
    let slot = slot(prefix::GATHER, tag);
    let Some(out) = out else {
        return io.post_send(root, slot, input);
    };
    let n = input.len();
    for peer in (0..size).filter(|&p| p != rank) {
        io.post_recv(peer, slot, n)?;
    }
    out[rank * n..(rank + 1) * n].copy_from_slice(input);
    for peer in (0..size).filter(|&p| p != rank) {
        recv_into(io, peer, slot, &mut out[peer * n..(peer + 1) * n], None).await?;
    }
    Ok(())
}

/// gloo's `scatter` from `root`: part `r` of the root's `input` (`Some` on
/// the root only) goes to rank `r`'s `out`.
pub async fn scatter(
    io: &dyn GlooIo,
    tag: u32,
    out: &mut [u8],
    input: Option<&[u8]>,
    root: usize,
) -> Result<()> {
    let (size, rank) = (io.size(), io.rank());
    let slot = slot(prefix::SCATTER, tag);
    let n = out.len();
    match input {
        Some(input) => {
            for peer in (0..size).filter(|&p| p != rank) {
                io.post_send(peer, slot, &input[peer * n..(peer + 1) * n])?;
            }
            out.copy_from_slice(&input[rank * n..(rank + 1) * n]);
        }
        None => {
            io.post_recv(root, slot, n)?;
            recv_into(io, root, slot, out, None).await?;
        }
    }
    Ok(())
}

/// gloo's `alltoall` with equal parts: part `j` of `input` goes to rank
/// `j`, part `i` of `out` comes from rank `i`; in round `k` each rank sends
/// to rank + k and receives from rank - k.
pub async fn alltoall(io: &dyn GlooIo, tag: u32, out: &mut [u8], input: &[u8]) -> Result<()> {
    let (size, rank) = (io.size(), io.rank());
    let slot = slot(prefix::ALLTOALL, tag);
    let n = input.len() / size;
    out[rank * n..(rank + 1) * n].copy_from_slice(&input[rank * n..(rank + 1) * n]);
    for k in 1..size {
        let to = (rank + k) % size;
        let from = (rank + size - k) % size;
        io.post_send(to, slot, &input[to * n..(to + 1) * n])?;
        io.post_recv(from, slot, n)?;
    }
    for k in 1..size {
        let from = (rank + size - k) % size;
        recv_into(io, from, slot, &mut out[from * n..(from + 1) * n], None).await?;
    }
    Ok(())
}

/// gloo's `barrier`: a dissemination barrier of empty messages, rounds at
/// distances 1, 2, 4, ...
pub async fn barrier(io: &dyn GlooIo, tag: u32) -> Result<()> {
    let (size, rank) = (io.size(), io.rank());
    let slot = slot(prefix::BARRIER, tag);
    let mut d = 1;
    while d < size {
        let from = (size + rank - d % size) % size;
        io.post_recv(from, slot, 0)?;
        io.post_send((rank + d) % size, slot, &[])?;
        recv_into(io, from, slot, &mut [], None).await?;
        d <<= 1;
    }
    Ok(())
}
