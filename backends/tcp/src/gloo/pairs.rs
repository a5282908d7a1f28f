//! The pairs of one Gloo context: a TCP connection to every other rank,
//! speaking Gloo's unbound-buffer protocol.
//!
//! Per slot and peer, Gloo matches the k-th send with the k-th receive.
//! A sender announces each send (`NOTIFY_SEND_READY`), a receiver each
//! receive (`NOTIFY_RECV_READY`, with the bytes it can take), and the
//! sender writes the payload once it holds both: its own send, and the
//! receiver's readiness. So a payload only ever arrives for a receive this
//! rank posted, and what a peer can make us buffer is bounded by our own
//! posted receives.
//!
//! Every pair has a reader task and a writer task. Sends are copied when
//! posted and queued to the writer, so that a reader never blocks on a
//! write (two readers each writing to the other would deadlock on full
//! socket buffers) and a caller's buffer is never touched after its call
//! returns. A closed connection fails the calls that still need that peer
//! (a rank closes its connections when it leaves after its last call, as
//! Gloo fails only the pair); any other failure (a message Gloo would
//! refuse, a deadline, a dropped call) fails the whole context: it is
//! sticky, and every socket is closed so that torch's ranks see it too.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::Duration,
};

use consort_comm::{CommError, Result};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{
        TcpStream,
        tcp::{OwnedReadHalf, OwnedWriteHalf},
    },
    sync::{Notify, mpsc},
    task::JoinHandle,
    time::Instant,
};

use super::wire::{Opcode, PREAMBLE_BYTES, Preamble};

/// The most receives a peer may announce ahead of our sends: far more than
/// any collective posts at once (a ring all_reduce of 1 GiB posts 2,048),
/// and a bound on what a misbehaving peer makes this rank hold (an entry
/// and, for a new slot, a map slot and a queue: about 150 bytes).
const MAX_EARLY_RECVS: usize = 1 << 16;

/// One message for a writer: a header, and for data its payload and the
/// send it completes.
type Frame = ([u8; PREAMBLE_BYTES], Vec<u8>, Option<SendId>);

/// A posted send, until its payload is written ([`Pairs::wait_sent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SendId(u64);

/// A posted receive: the payload [`Pairs::wait_recv`] takes for it. The
/// k-th payload on a slot from a peer fills the k-th receive posted there,
/// whichever waiter wakes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RecvTicket(u64);

/// The receives of one slot from one peer: how many were posted, how many
/// payloads arrived, how many of those are not taken yet.
#[derive(Clone, Copy, Debug, Default)]
struct Tickets {
    posted: u64,
    arrived: u64,
    untaken: u64,
}

/// Where a send's payload is.
#[derive(Clone, Copy, Debug)]
struct Unsent {
    peer: usize,
    /// With the writer (else waiting for the peer's receive).
    handed: bool,
}

/// What one peer's traffic has left to match.
#[derive(Debug, Default)]
struct PeerState {
    /// Receives the peer announced that no send of ours has met yet, per
    /// slot: the bytes each can take.
    remote_recvs: HashMap<u64, VecDeque<u64>>,
    /// How many `remote_recvs` hold, bounded by [`MAX_EARLY_RECVS`].
    remote_recv_count: usize,
    /// Our sends the peer has not asked for yet, per slot.
    pending_sends: HashMap<u64, VecDeque<(SendId, Vec<u8>)>>,
    /// Our receives whose payload has not begun to arrive, per slot: the
    /// bytes each can take.
    posted_recvs: HashMap<u64, VecDeque<usize>>,
    /// Payloads that arrived and have not been taken, by slot and ticket.
    arrived: HashMap<(u64, u64), Vec<u8>>,
    /// Ticket counts per slot (dropped once a slot has nothing left).
    tickets: HashMap<u64, Tickets>,
    /// Why this peer's writer stopped: its queued payloads will not go.
    write_failed: Option<CommError>,
    /// Why the connection ended, once it has: a peer that leaves after its
    /// last call closes it, so this fails only the calls that still need
    /// the peer (as Gloo fails only that pair).
    gone: Option<CommError>,
}

#[derive(Debug, Default)]
struct State {
    peers: Vec<PeerState>,
    /// The first failure; every later call reports it.
    failed: Option<CommError>,
    /// The next [`SendId`].
    next_send: u64,
    /// Sends whose payload is not written yet.
    unsent: HashMap<SendId, Unsent>,
}

/// The connections of one rank of one Gloo context.
#[derive(Debug)]
pub struct Pairs {
    rank: usize,
    size: usize,
    state: Mutex<State>,
    changed: Notify,
    writers: Vec<Option<mpsc::UnboundedSender<Frame>>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Payload buffers for reuse (see [`Pool`]).
    pool: Pool,
}

/// Payload buffers kept for the next message: a large allocation is a
/// fresh mapping each time, whose first touch costs a page fault per page
/// (more than the copy itself for a 64 MiB broadcast).
#[derive(Debug, Default)]
pub struct Pool {
    free: Mutex<Vec<Vec<u8>>>,
}

impl Pool {
    /// Bytes the pool keeps at most.
    const MAX_BYTES: usize = 256 << 20;
    /// Smaller buffers are not worth keeping.
    const MIN_BYTES: usize = 64 << 10;

    /// An empty buffer with room for `len` bytes.
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len >= Self::MIN_BYTES {
            let mut free = consort_comm::lock(&self.free);
            if let Some(i) = free.iter().position(|v| v.capacity() >= len) {
                let mut v = free.swap_remove(i);
                v.clear();
                return v;
            }
        }
        Vec::with_capacity(len)
    }

    /// A pooled copy of `data`.
    pub fn copy(&self, data: &[u8]) -> Vec<u8> {
        let mut v = self.take(data.len());
        v.extend_from_slice(data);
        v
    }

    /// Keeps `v` for reuse, if it is worth it and there is room.
    pub fn give(&self, v: Vec<u8>) {
        if v.capacity() < Self::MIN_BYTES {
            return;
        }
        let mut free = consort_comm::lock(&self.free);
        let held: usize = free.iter().map(Vec::capacity).sum();
        if held + v.capacity() <= Self::MAX_BYTES {
            free.push(v);
        }
    }
}

impl Pairs {
    /// Runs the pairs over `streams[r]`, the connection to rank `r` (`None`
    /// for this rank).
    pub fn start(rank: usize, streams: Vec<Option<TcpStream>>) -> Arc<Pairs> {
        let size = streams.len();
        let mut writers = Vec::with_capacity(size);
        let mut halves = Vec::with_capacity(size);
        for s in streams {
            match s {
                Some(s) => {
                    let (r, w) = s.into_split();
                    let (tx, rx) = mpsc::unbounded_channel();
                    writers.push(Some(tx));
                    halves.push(Some((r, w, rx)));
                }
                None => {
                    writers.push(None);
                    halves.push(None);
                }
            }
        }
        let pairs = Arc::new(Pairs {
            rank,
            size,
            state: Mutex::new(State {
                peers: (0..size).map(|_| PeerState::default()).collect(),
                failed: None,
                next_send: 0,
                unsent: Default::default(),
            }),
            changed: Notify::new(),
            writers,
            tasks: Mutex::new(Vec::new()),
            pool: Pool::default(),
        });
        {
            // Spawned under the lock, so that a failure in a task that has
            // just started finds every task to abort.
            let mut tasks = consort_comm::lock(&pairs.tasks);
            for (peer, h) in halves.into_iter().enumerate() {
                if let Some((r, w, rx)) = h {
                    tasks.push(tokio::spawn(read_loop(pairs.clone(), peer, r)));
                    tasks.push(tokio::spawn(write_loop(pairs.clone(), peer, w, rx)));
                }
            }
        }
        pairs
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the context.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The first failure, if any.
    pub fn failure(&self) -> Option<CommError> {
        consort_comm::lock(&self.state).failed.clone()
    }

    /// Fails the context with `why` (the first failure wins) and closes
    /// every connection.
    pub fn fail(&self, why: CommError) {
        let mut st = consort_comm::lock(&self.state);
        self.fail_locked(&mut st, why);
    }

    /// [`Pairs::fail`] with the state locked; returns the error to report.
    fn fail_locked(&self, st: &mut State, why: CommError) -> CommError {
        if let Some(first) = &st.failed {
            return first.to_aborted();
        }
        tracing::debug!(rank = self.rank, %why, "gloo context failed");
        st.failed = Some(why.clone());
        for t in consort_comm::lock(&self.tasks).drain(..) {
            t.abort();
        }
        self.changed.notify_waiters();
        why
    }

    /// `peer`'s connection ended: calls that need it fail from now on.
    fn lose(&self, peer: usize, why: CommError) {
        let mut st = consort_comm::lock(&self.state);
        let ps = &mut st.peers[peer];
        if ps.gone.is_none() {
            tracing::debug!(rank = self.rank, peer, %why, "gloo peer gone");
            ps.gone = Some(why);
        }
        drop(st);
        self.changed.notify_waiters();
    }

    fn send_frame(&self, peer: usize, frame: Frame) {
        if let Some(Some(tx)) = self.writers.get(peer) {
            // A closed writer has failed the context already.
            let _ = tx.send(frame);
        }
    }

    /// The group's failure, or `peer`'s loss (which then fails the group:
    /// a call needs the peer).
    fn usable(&self, st: &mut State, peer: usize) -> Result<()> {
        if let Some(why) = &st.failed {
            return Err(why.to_aborted());
        }
        if let Some(why) = st.peers[peer].gone.clone() {
            return Err(self.fail_locked(st, why));
        }
        Ok(())
    }

    /// Posts a send of `data` to `peer` on `slot` (Gloo's
    /// `UnboundBuffer::send`). The bytes are copied now; the payload goes
    /// once the peer posts its receive ([`Pairs::wait_sent`] waits for it).
    pub fn post_send(&self, peer: usize, slot: u64, data: &[u8]) -> Result<SendId> {
        // Copied before the lock: every pair's tasks take it.
        let copy = self.pool.copy(data);
        let mut st = consort_comm::lock(&self.state);
        self.usable(&mut st, peer)?;
        let id = SendId(st.next_send);
        st.next_send += 1;
        let handed = st.peers[peer].remote_recvs.contains_key(&slot);
        st.unsent.insert(id, Unsent { peer, handed });
        let notify = Preamble::new(Opcode::NotifySendReady, slot, data.len()).encode();
        self.send_frame(peer, (notify, Vec::new(), None));
        let ps = &mut st.peers[peer];
        match pop(&mut ps.remote_recvs, slot) {
            Some(room) => {
                ps.remote_recv_count -= 1;
                if data.len() as u64 > room {
                    let why = too_long(self.rank, peer, data.len(), room, slot);
                    return Err(self.fail_locked(&mut st, why));
                }
                let head = Preamble::new(Opcode::SendUnboundBuffer, slot, data.len()).encode();
                self.send_frame(peer, (head, copy, Some(id)));
            }
            None => ps
                .pending_sends
                .entry(slot)
                .or_default()
                .push_back((id, copy)),
        }
        Ok(id)
    }

    /// Waits until the payloads of `sends` are written to their sockets
    /// (Gloo's `waitSend`): a collective returns only then, so that a rank
    /// that leaves after its last call has delivered its part.
    pub async fn wait_sent(
        &self,
        sends: &[SendId],
        deadline: Instant,
        after: Duration,
    ) -> Result<()> {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let waiting_on = {
                let mut st = consort_comm::lock(&self.state);
                let left: Vec<Unsent> = sends
                    .iter()
                    .filter_map(|id| st.unsent.get(id).copied())
                    .collect();
                if left.is_empty() {
                    return Ok(());
                }
                if let Some(why) = &st.failed {
                    return Err(why.to_aborted());
                }
                for u in &left {
                    // A payload with the writer goes unless the write
                    // fails (the peer may read it and leave meanwhile); one
                    // still waiting for the peer's receive needs the peer.
                    match st.peers[u.peer].write_failed.clone() {
                        Some(why) if u.handed => return Err(self.fail_locked(&mut st, why)),
                        _ if !u.handed => self.usable(&mut st, u.peer)?,
                        _ => {}
                    }
                }
                let mut peers: Vec<usize> = left.iter().map(|u| u.peer).collect();
                peers.sort_unstable();
                peers.dedup();
                peers
            };
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                let why = CommError::Timeout {
                    ctx: Default::default(),
                    after,
                    waiting_on,
                };
                self.fail(why.clone());
                return Err(why);
            }
        }
    }

    /// Returns a payload from [`Pairs::wait_recv`] for reuse.
    pub fn recycle(&self, data: Vec<u8>) {
        self.pool.give(data);
    }

    fn sent(&self, id: SendId) {
        consort_comm::lock(&self.state).unsent.remove(&id);
        self.changed.notify_waiters();
    }

    /// Posts a receive of up to `len` bytes from `peer` on `slot` (Gloo's
    /// `UnboundBuffer::recv`); [`Pairs::wait_recv`] takes the payload.
    pub fn post_recv(&self, peer: usize, slot: u64, len: usize) -> Result<RecvTicket> {
        let mut st = consort_comm::lock(&self.state);
        self.usable(&mut st, peer)?;
        let ps = &mut st.peers[peer];
        ps.posted_recvs.entry(slot).or_default().push_back(len);
        let t = ps.tickets.entry(slot).or_default();
        let ticket = RecvTicket(t.posted);
        t.posted += 1;
        let head = Preamble::new(Opcode::NotifyRecvReady, slot, len).encode();
        self.send_frame(peer, (head, Vec::new(), None));
        Ok(ticket)
    }

    /// Waits for the payload of receive `ticket` from `peer` on `slot`;
    /// fails the context if `deadline` passes first (`after` is the call's
    /// timeout, for the error).
    pub async fn wait_recv(
        &self,
        peer: usize,
        slot: u64,
        ticket: RecvTicket,
        deadline: Instant,
        after: Duration,
    ) -> Result<Vec<u8>> {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut st = consort_comm::lock(&self.state);
                // What arrived before the peer left is still its part.
                if st.failed.is_none()
                    && let Some(data) = st.peers[peer].take(slot, ticket)
                {
                    return Ok(data);
                }
                self.usable(&mut st, peer)?;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                let why = CommError::Timeout {
                    ctx: Default::default(),
                    after,
                    waiting_on: vec![peer],
                };
                self.fail(why.clone());
                return Err(why);
            }
        }
    }

    /// A payload header arrived from `peer`: which receive it fills.
    fn begin_payload(&self, peer: usize, head: &Preamble) -> Result<()> {
        let mut st = consort_comm::lock(&self.state);
        let posted = st.peers[peer]
            .posted_recvs
            .get_mut(&head.slot)
            .and_then(VecDeque::pop_front);
        match posted {
            None => Err(CommError::protocol(
                Some(peer),
                format!(
                    "{} bytes on Gloo slot {:#x}, which rank {} never asked for",
                    head.length, head.slot, self.rank
                ),
            )),
            Some(room) if head.length > room as u64 => Err(too_long(
                peer,
                self.rank,
                head.length as usize,
                room as u64,
                head.slot,
            )),
            Some(_) => Ok(()),
        }
    }

    fn deliver(&self, peer: usize, slot: u64, data: Vec<u8>) {
        let mut st = consort_comm::lock(&self.state);
        let ps = &mut st.peers[peer];
        let t = ps.tickets.entry(slot).or_default();
        let ticket = t.arrived;
        t.arrived += 1;
        t.untaken += 1;
        ps.arrived.insert((slot, ticket), data);
        drop(st);
        self.changed.notify_waiters();
    }

    /// `peer` is ready to receive up to `room` bytes on `slot`.
    fn recv_ready(&self, peer: usize, slot: u64, room: u64) -> Result<()> {
        let mut st = consort_comm::lock(&self.state);
        let ps = &mut st.peers[peer];
        match pop(&mut ps.pending_sends, slot) {
            Some((_, data)) if data.len() as u64 > room => {
                Err(too_long(self.rank, peer, data.len(), room, slot))
            }
            Some((id, data)) => {
                let head = Preamble::new(Opcode::SendUnboundBuffer, slot, data.len()).encode();
                self.send_frame(peer, (head, data, Some(id)));
                if let Some(u) = st.unsent.get_mut(&id) {
                    u.handed = true;
                }
                Ok(())
            }
            None if ps.remote_recv_count >= MAX_EARLY_RECVS => Err(CommError::protocol(
                Some(peer),
                format!(
                    "{MAX_EARLY_RECVS} receives announced that no send of rank {} has met; a \
                     Gloo peer posts one per message it expects",
                    self.rank
                ),
            )),
            None => {
                ps.remote_recv_count += 1;
                ps.remote_recvs.entry(slot).or_default().push_back(room);
                Ok(())
            }
        }
    }
}

impl Pairs {
    /// Closes every connection: the group's handle is gone. Its calls have
    /// all ended, so every payload they sent is written already.
    pub fn close(&self) {
        for t in consort_comm::lock(&self.tasks).drain(..) {
            t.abort();
        }
    }
}

impl PeerState {
    /// The payload of `ticket` on `slot`, if it arrived.
    fn take(&mut self, slot: u64, ticket: RecvTicket) -> Option<Vec<u8>> {
        let data = self.arrived.remove(&(slot, ticket.0))?;
        if let Some(t) = self.tickets.get_mut(&slot) {
            t.untaken -= 1;
            if t.untaken == 0 && t.arrived == t.posted {
                self.tickets.remove(&slot);
            }
        }
        Some(data)
    }
}

impl Drop for Pairs {
    fn drop(&mut self) {
        for t in self.tasks.get_mut().expect("tasks").drain(..) {
            t.abort();
        }
    }
}

fn pop<T>(m: &mut HashMap<u64, VecDeque<T>>, slot: u64) -> Option<T> {
    let q = m.get_mut(&slot)?;
    let v = q.pop_front();
    if q.is_empty() {
        m.remove(&slot);
    }
    v
}

fn too_long(from: usize, to: usize, len: usize, room: u64, slot: u64) -> CommError {
    CommError::aborted(format!(
        "rank {from} sends {len} bytes on Gloo slot {slot:#x} but rank {to} posted a receive of \
         {room}: the two ranks called collectives of different sizes at this point"
    ))
}

/// Reads `peer`'s messages until the connection ends or breaks a rule.
async fn read_loop(pairs: Arc<Pairs>, peer: usize, mut r: OwnedReadHalf) {
    let why = loop {
        let mut head = [0u8; PREAMBLE_BYTES];
        if let Err(e) = r.read_exact(&mut head).await {
            pairs.lose(peer, closed(&pairs, peer, &e));
            return;
        }
        let head = Preamble::decode(&head);
        let step = match head.opcode() {
            Some(Opcode::NotifySendReady) if head.nbytes == PREAMBLE_BYTES as u64 => Ok(()),
            Some(Opcode::NotifyRecvReady) if head.nbytes == PREAMBLE_BYTES as u64 => {
                pairs.recv_ready(peer, head.slot, head.length)
            }
            Some(Opcode::SendUnboundBuffer)
                if head.nbytes.checked_sub(PREAMBLE_BYTES as u64) == Some(head.length) =>
            {
                match pairs.begin_payload(peer, &head) {
                    Ok(()) => {
                        // Read into fresh capacity: no zeroing pass first.
                        let len = head.length as usize;
                        let mut data = pairs.pool.take(len);
                        let res = (&mut r).take(len as u64).read_to_end(&mut data).await;
                        if let Err(e) = res.and_then(|n| {
                            if n == len {
                                Ok(())
                            } else {
                                Err(std::io::ErrorKind::UnexpectedEof.into())
                            }
                        }) {
                            pairs.lose(peer, closed(&pairs, peer, &e));
                            return;
                        }
                        pairs.deliver(peer, head.slot, data);
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            Some(Opcode::SendBuffer) => Err(CommError::protocol(
                Some(peer),
                "a bound-buffer payload (Gloo's SEND_BUFFER), which torch's collectives never \
                 send and this backend does not take",
            )),
            Some(op) => Err(CommError::protocol(
                Some(peer),
                format!(
                    "a malformed {op:?} message: its header says {} bytes in all, {} of payload",
                    head.nbytes, head.length
                ),
            )),
            None => Err(CommError::protocol(
                Some(peer),
                format!(
                    "a message Gloo does not define (opcode {}, {} bytes)",
                    head.opcode, head.nbytes
                ),
            )),
        };
        if let Err(why) = step {
            break why;
        }
    };
    pairs.fail(why);
}

fn closed(pairs: &Pairs, peer: usize, e: &std::io::Error) -> CommError {
    let reason = if e.kind() == std::io::ErrorKind::UnexpectedEof {
        format!("it closed its Gloo connection to rank {}", pairs.rank)
    } else {
        format!("its Gloo connection to rank {} failed: {e}", pairs.rank)
    };
    CommError::PeerLost {
        ctx: Default::default(),
        peer,
        reason,
    }
}

/// Writes the frames queued for `peer`, in order.
async fn write_loop(
    pairs: Arc<Pairs>,
    peer: usize,
    mut w: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Frame>,
) {
    while let Some((head, data, id)) = rx.recv().await {
        let res = async {
            w.write_all(&head).await?;
            if !data.is_empty() {
                w.write_all(&data).await?;
            }
            Ok::<_, std::io::Error>(())
        }
        .await;
        if let Err(e) = res {
            let why = CommError::PeerLost {
                ctx: Default::default(),
                peer,
                reason: format!("rank {} could not write to it: {e}", pairs.rank),
            };
            consort_comm::lock(&pairs.state).peers[peer].write_failed = Some(why.clone());
            pairs.lose(peer, why);
            return;
        }
        if let Some(id) = id {
            pairs.sent(id);
        }
        pairs.pool.give(data);
    }
}

#[cfg(test)]
mod tests {
    //! A raw socket as rank 1, sending what a broken or hostile peer might.

    use tokio::{io::AsyncWriteExt, net::TcpListener};

    use super::*;

    async fn pair() -> (Arc<Pairs>, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let raw = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (ours, _) = l.accept().await.unwrap();
        (Pairs::start(0, vec![None, Some(ours)]), raw)
    }

    async fn failed(p: &Pairs) -> CommError {
        for _ in 0..500 {
            if let Some(e) = p.failure() {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the context did not fail");
    }

    fn head(op: u64, slot: u64, nbytes: u64, length: u64) -> [u8; PREAMBLE_BYTES] {
        Preamble {
            nbytes,
            opcode: op,
            slot,
            offset: 0,
            length,
            roffset: 0,
        }
        .encode()
    }

    #[tokio::test]
    async fn an_undefined_opcode_fails_the_context() {
        let (p, mut raw) = pair().await;
        raw.write_all(&head(9, 0, 48, 0)).await.unwrap();
        let e = failed(&p).await;
        assert!(e.to_string().contains("opcode 9"), "{e}");
    }

    #[tokio::test]
    async fn a_payload_nobody_asked_for_fails_the_context() {
        let (p, mut raw) = pair().await;
        raw.write_all(&head(1, 5, 48 + 4, 4)).await.unwrap();
        raw.write_all(&[1, 2, 3, 4]).await.unwrap();
        let e = failed(&p).await;
        assert!(e.to_string().contains("never asked for"), "{e}");
    }

    #[tokio::test]
    async fn a_payload_longer_than_the_receive_fails_the_context() {
        let (p, mut raw) = pair().await;
        p.post_recv(1, 5, 2).unwrap();
        raw.write_all(&head(1, 5, 48 + 4, 4)).await.unwrap();
        raw.write_all(&[1, 2, 3, 4]).await.unwrap();
        let e = failed(&p).await;
        assert!(e.to_string().contains("different sizes"), "{e}");
    }

    #[tokio::test]
    async fn a_header_whose_sizes_disagree_fails_the_context() {
        let (p, mut raw) = pair().await;
        p.post_recv(1, 5, 1 << 20).unwrap();
        raw.write_all(&head(1, 5, 48 + 4, 1 << 20)).await.unwrap();
        let e = failed(&p).await;
        assert!(e.to_string().contains("malformed"), "{e}");
    }

    #[tokio::test]
    async fn endless_receive_announcements_are_cut_off() {
        let (p, mut raw) = pair().await;
        let mut burst = Vec::new();
        for slot in 0..=MAX_EARLY_RECVS as u64 {
            burst.extend_from_slice(&head(3, slot, 48, 8));
        }
        let _ = raw.write_all(&burst).await;
        let e = failed(&p).await;
        assert!(e.to_string().contains("receives announced"), "{e}");
    }

    #[tokio::test]
    async fn a_peer_that_closes_mid_payload_is_lost_for_the_call_that_needs_it() {
        let (p, mut raw) = pair().await;
        let t = p.post_recv(1, 5, 8).unwrap();
        raw.write_all(&head(1, 5, 48 + 8, 8)).await.unwrap();
        raw.write_all(&[1, 2, 3]).await.unwrap();
        drop(raw);
        let deadline = Instant::now() + Duration::from_secs(5);
        let e = p
            .wait_recv(1, 5, t, deadline, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(matches!(e, CommError::PeerLost { peer: 1, .. }), "{e}");
        // Sticky from then on.
        assert!(p.post_recv(1, 6, 1).is_err());
    }
}
