//! What crosses between pipeline ranks, and in which order.
//!
//! A forward's outputs go to the next stage's rank and a backward's input
//! gradients to the previous stage's. Each rank sends to a peer in the
//! order its list makes them, each send's call made as soon as its data
//! exists (before any later receive: stream-ordered backends run calls in
//! the order they are made) and moved on whenever the rank waits; each
//! rank receives from a peer in that same order, computed from the peer's list, keeping a message that
//! arrives before it is needed. So the pairwise order is the same on both
//! sides, as backends that match point-to-point calls by order alone
//! (NCCL) need, and a send is never held back behind a receive. (On NCCL
//! a large send also waits for its receive; without grouped calls that is
//! not proven deadlock-free: see DESIGN.md.)
//!
//! The first time a stage's activations for a microbatch cross, a header
//! with their shapes goes first (torch's shape handshake); later steps
//! reuse the shapes, and a sender whose shapes changed says so.

use std::{
    collections::{HashMap, VecDeque},
    future::Future,
    pin::Pin,
    task::{Context, Poll, Waker},
};

use consort_comm::{CommError, Element, ProcessGroup};

use super::Tensor;
use crate::schedule::{Kind, Schedule};

/// One message between stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Msg {
    /// The outputs of `stage - 1`'s forward, the inputs of `stage`.
    Act { stage: usize, mb: usize },
    /// The gradients of `stage`'s outputs, from `stage + 1`'s backward.
    Grad { stage: usize, mb: usize },
}

impl Msg {
    /// The tag it travels with: unique per message, so backends that
    /// match by tag (TCP, QUIC, shared memory) check the order too.
    pub(crate) fn tag(self) -> u32 {
        let (kind, stage, mb) = match self {
            Msg::Act { stage, mb } => (0u32, stage, mb),
            Msg::Grad { stage, mb } => (1u32, stage, mb),
        };
        // Stages < 2^15 and microbatches < 2^16 are checked up front.
        (kind << 31) | ((stage as u32) << 16) | mb as u32
    }
}

impl std::fmt::Display for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Msg::Act { stage, mb } => write!(f, "stage {stage}'s inputs for microbatch {mb}"),
            Msg::Grad { stage, mb } => {
                write!(
                    f,
                    "the gradients of stage {stage}'s outputs for microbatch {mb}"
                )
            }
        }
    }
}

/// What `rank` sends to `peer` in one step, in the order it sends them.
pub(crate) fn sends(schedule: &Schedule, rank: usize, peer: usize) -> VecDeque<Msg> {
    let last = schedule.num_stages() - 1;
    schedule
        .steps(rank)
        .iter()
        .flat_map(|s| s.actions())
        .filter_map(|a| match a.kind {
            Kind::Forward if a.stage < last && schedule.rank_of(a.stage + 1) == peer => {
                Some(Msg::Act {
                    stage: a.stage + 1,
                    mb: a.microbatch,
                })
            }
            Kind::FullBackward | Kind::BackwardInput
                if a.stage > 0 && schedule.rank_of(a.stage - 1) == peer =>
            {
                Some(Msg::Grad {
                    stage: a.stage - 1,
                    mb: a.microbatch,
                })
            }
            _ => None,
        })
        .collect()
}

fn shapes_header(ts: &[Tensor<impl Element>]) -> Vec<u64> {
    let mut h = vec![ts.len() as u64];
    for t in ts {
        h.push(t.shape.len() as u64);
        h.extend(t.shape.iter().map(|&d| d as u64));
    }
    h
}

/// Reads a header back; `None` when it is malformed.
fn parse_header(h: &[u64]) -> Option<Vec<Vec<usize>>> {
    let (&n, mut rest) = h.split_first()?;
    let mut out = Vec::new();
    for _ in 0..n {
        let (&nd, r) = rest.split_first()?;
        let nd = usize::try_from(nd).ok()?;
        let dims = r.get(..nd)?;
        out.push(
            dims.iter()
                .map(|&d| usize::try_from(d).ok())
                .collect::<Option<Vec<_>>>()?,
        );
        rest = &r[nd..];
    }
    rest.is_empty().then_some(out)
}

/// Elements of tensors of these shapes, or `None` past `usize`.
fn elements(shapes: &[Vec<usize>]) -> Option<usize> {
    shapes.iter().try_fold(0usize, |acc, s| {
        acc.checked_add(s.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?)
    })
}

type SendFuture = Pin<Box<dyn Future<Output = Result<(), CommError>> + Send>>;

/// The sends this rank has made and not yet seen end. Each is made (its
/// call issued, which fixes its place in the backend's order) when it is
/// queued, before any later receive; it moves on whenever the runtime
/// waits for anything.
pub(crate) struct Outbox<T> {
    pg: ProcessGroup,
    pending: Vec<(usize, SendFuture)>,
    sent_shapes: HashMap<Msg, Vec<Vec<usize>>>,
    _elements: std::marker::PhantomData<fn(T)>,
}

impl<T: Element> Outbox<T> {
    pub(crate) fn new(pg: ProcessGroup) -> Self {
        Outbox {
            pg,
            pending: Vec::new(),
            sent_shapes: HashMap::new(),
            _elements: std::marker::PhantomData,
        }
    }

    /// Makes the call that sends `buf` and keeps it until it ends.
    fn issue<E: Element>(
        &mut self,
        peer: usize,
        tag: u32,
        buf: Vec<E>,
    ) -> Result<(), (usize, Box<CommError>)> {
        let pg = self.pg.clone();
        let mut fut: SendFuture = Box::pin(async move { pg.send(&buf, peer, tag).await });
        // One poll makes the call now, in program order; its waker is
        // replaced by the runtime's on the next poll.
        match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Err(e)) => Err((peer, Box::new(e))),
            Poll::Ready(Ok(())) => Ok(()),
            Poll::Pending => {
                self.pending.push((peer, fut));
                Ok(())
            }
        }
    }

    /// Sends `msg` to `peer`; the shapes go first the first time.
    pub(crate) fn send(
        &mut self,
        peer: usize,
        msg: Msg,
        ts: Vec<Tensor<T>>,
    ) -> Result<(), SendError> {
        let shapes: Vec<Vec<usize>> = ts.iter().map(|t| t.shape.clone()).collect();
        let header = match self.sent_shapes.get(&msg) {
            // Gradients have the shapes of the receiver's own outputs.
            _ if matches!(msg, Msg::Grad { .. }) => None,
            Some(s) if *s == shapes => None,
            Some(s) => {
                return Err(SendError::Usage(format!(
                    "{msg} have shapes {shapes:?}, but {s:?} in the first step; the pipeline's \
                     shapes are fixed at its first step (as torch's): make a new runtime for new \
                     shapes"
                )));
            }
            None => {
                self.sent_shapes.insert(msg, shapes);
                Some(shapes_header(&ts))
            }
        };
        let tag = msg.tag();
        if let Some(h) = header {
            self.issue(peer, tag, vec![h.len() as u64])
                .map_err(SendError::Comm)?;
            self.issue(peer, tag, h).map_err(SendError::Comm)?;
        }
        // A lone tensor (the usual case) goes as it is, several in one buffer.
        let mut ts = ts;
        let payload: Vec<T> = match ts.len() {
            1 => ts.pop().map(|t| t.data).unwrap_or_default(),
            _ => ts.into_iter().flat_map(|t| t.data).collect(),
        };
        self.issue(peer, tag, payload).map_err(SendError::Comm)
    }

    /// Moves every pending send on; the first failure, with its peer.
    pub(crate) fn drive(&mut self, cx: &mut Context<'_>) -> Result<(), (usize, Box<CommError>)> {
        let mut failed = None;
        self.pending
            .retain_mut(|(peer, fut)| match fut.as_mut().poll(cx) {
                Poll::Pending => true,
                Poll::Ready(Ok(())) => false,
                Poll::Ready(Err(e)) => {
                    failed.get_or_insert((*peer, Box::new(e)));
                    false
                }
            });
        failed.map_or(Ok(()), Err)
    }

    /// Waits until every send has ended.
    pub(crate) async fn flush(&mut self) -> Result<(), (usize, Box<CommError>)> {
        std::future::poll_fn(|cx| {
            self.drive(cx)?;
            if self.pending.is_empty() {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        })
        .await
    }
}

/// Why a send could not be made.
pub(crate) enum SendError {
    /// The sender's shapes changed since the handshake.
    Usage(String),
    /// The backend refused the call: the peer, and why.
    Comm((usize, Box<CommError>)),
}

/// Receives from each peer in the order it sends, keeping what arrives
/// before it is needed.
pub(crate) struct Inbox<T> {
    expected: HashMap<usize, VecDeque<Msg>>,
    held: HashMap<Msg, Vec<Tensor<T>>>,
    shapes: HashMap<Msg, Vec<Vec<usize>>>,
}

/// A receive that failed: the message being received, and why.
pub(crate) struct RecvError {
    pub(crate) receiving: Msg,
    pub(crate) error: Box<CommError>,
}

impl<T: Element> Inbox<T> {
    pub(crate) fn new() -> Self {
        Inbox {
            expected: HashMap::new(),
            held: HashMap::new(),
            shapes: HashMap::new(),
        }
    }

    /// A new step: what each peer will send, in its order.
    pub(crate) fn begin(&mut self, schedule: &Schedule, me: usize) {
        self.held.clear();
        self.expected = (0..schedule.pp())
            .filter(|&p| p != me)
            .map(|p| (p, sends(schedule, p, me)))
            .collect();
    }

    /// A message from this rank to itself (two stages on one rank).
    pub(crate) fn keep(&mut self, msg: Msg, ts: Vec<Tensor<T>>) {
        self.held.insert(msg, ts);
    }

    /// Takes a kept message.
    pub(crate) fn take_kept(&mut self, msg: Msg) -> Option<Vec<Tensor<T>>> {
        self.held.remove(&msg)
    }

    /// `msg` from `peer`, receiving (and keeping) what `peer` sent before
    /// it. `grad_shapes` are the shapes of a gradient message (this
    /// rank's own outputs); activations' come from the handshake.
    pub(crate) async fn recv(
        &mut self,
        pg: &ProcessGroup,
        peer: usize,
        msg: Msg,
        grad_shapes: impl Fn(Msg) -> Option<Vec<Vec<usize>>>,
    ) -> Result<Vec<Tensor<T>>, RecvError> {
        loop {
            if let Some(ts) = self.held.remove(&msg) {
                return Ok(ts);
            }
            let Some(next) = self.expected.get_mut(&peer).and_then(VecDeque::pop_front) else {
                return Err(RecvError {
                    receiving: msg,
                    error: Box::new(CommError::invalid(format!(
                        "rank {peer} sends no such message in this schedule"
                    ))),
                });
            };
            let fail = |error| RecvError {
                receiving: next,
                error: Box::new(error),
            };
            let shapes = match next {
                Msg::Grad { .. } => grad_shapes(next).ok_or_else(|| {
                    fail(CommError::invalid(
                        "no forward outputs to take gradients of",
                    ))
                })?,
                Msg::Act { .. } => match self.shapes.get(&next) {
                    Some(s) => s.clone(),
                    None => {
                        let s = recv_header(pg, peer, next.tag()).await.map_err(fail)?;
                        self.shapes.insert(next, s.clone());
                        s
                    }
                },
            };
            let n = elements(&shapes)
                .ok_or_else(|| fail(CommError::invalid("a tensor's size overflows")))?;
            let mut buf: Vec<T> = Vec::new();
            buf.try_reserve_exact(n)
                .map_err(|_| fail(CommError::invalid(format!("no memory for {n} elements"))))?;
            buf.resize(n, bytemuck::Zeroable::zeroed());
            pg.recv(&mut buf, peer, next.tag()).await.map_err(fail)?;
            let ts = split_payload(buf, shapes);
            self.held.insert(next, ts);
        }
    }
}

/// The tensors of one message, from its payload: a lone tensor (the
/// usual case) takes the buffer itself, several get copies of their parts.
fn split_payload<T: Element>(buf: Vec<T>, mut shapes: Vec<Vec<usize>>) -> Vec<Tensor<T>> {
    if shapes.len() == 1 {
        let shape = shapes.pop().unwrap_or_default();
        return vec![Tensor { shape, data: buf }];
    }
    let mut at = 0;
    shapes
        .into_iter()
        .map(|shape| {
            let len: usize = shape.iter().product();
            let data = buf[at..at + len].to_vec();
            at += len;
            Tensor { shape, data }
        })
        .collect()
}

/// At most this many words of shapes in a handshake header.
const MAX_HEADER: u64 = 1 << 16;

async fn recv_header(
    pg: &ProcessGroup,
    peer: usize,
    tag: u32,
) -> Result<Vec<Vec<usize>>, CommError> {
    let mut len = [0u64];
    pg.recv(&mut len, peer, tag).await?;
    if len[0] == 0 || len[0] > MAX_HEADER {
        return Err(CommError::invalid(format!(
            "rank {peer}'s shape header claims {} words (at most {MAX_HEADER})",
            len[0]
        )));
    }
    let mut h = vec![0u64; len[0] as usize];
    pg.recv(&mut h, peer, tag).await?;
    parse_header(&h)
        .ok_or_else(|| CommError::invalid(format!("rank {peer}'s shape header is malformed")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_ones_are_refused() {
        let ts = vec![
            Tensor::new(vec![2, 3], vec![0f32; 6]).unwrap(),
            Tensor::new(vec![], vec![1f32]).unwrap(),
        ];
        let h = shapes_header(&ts);
        assert_eq!(parse_header(&h), Some(vec![vec![2, 3], vec![]]));
        assert_eq!(parse_header(&[]), None);
        assert_eq!(parse_header(&[1, 5, 1]), None);
        assert_eq!(parse_header(&[0, 7]), None);
        assert_eq!(elements(&[vec![usize::MAX, 2]]), None);
    }

    #[test]
    fn tags_are_unique_per_message() {
        let a = Msg::Act { stage: 3, mb: 2 }.tag();
        let g = Msg::Grad { stage: 3, mb: 2 }.tag();
        assert_ne!(a, g);
        assert_ne!(a, Msg::Act { stage: 2, mb: 3 }.tag());
    }
}
