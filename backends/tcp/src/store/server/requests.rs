//! One client's requests, decoded and answered. Every byte a request reads
//! is paid for from the memory budget before it is allocated, every reply
//! before it is queued, and a request must arrive whole within the request
//! timeout once its first byte has come (an idle client may wait between
//! requests for as long as it likes, as torch's clients do for a whole
//! job). Generic over the reader, so the decoder can be fed any bytes.

use std::{sync::Mutex, time::Duration};

use consort_comm::store::{
    MAX_KEY_LEN, MAX_KEYS_PER_REQUEST, MAX_VALUE_LEN, add_to_value, compare_set_rule,
};
use tokio::io::{AsyncRead, AsyncReadExt};

use super::super::wire::{self, ReadError, cmd};
use super::Closed;
use super::state::{ClientId, Lease, OVERHEAD, Out, State};

/// How long a client may take: to send VALIDATE after connecting, and to
/// finish a request it has started.
#[derive(Clone, Copy, Debug)]
pub(super) struct Deadlines {
    pub(super) validate: Duration,
    pub(super) request: Duration,
}

/// A request's reader: what it reads is charged to its lease.
struct Reader<'a, R> {
    r: &'a mut R,
    lease: Lease,
}

impl<R: AsyncRead + Unpin + Send> Reader<'_, R> {
    async fn bytes(&mut self, max: usize, what: &'static str) -> Result<Vec<u8>, Closed> {
        let lease = &mut self.lease;
        let mut charge = |n: usize, what: &'static str| {
            lease
                .grow(n, what)
                .map_err(|c| ReadError::Refused(c.to_string()))
        };
        Ok(wire::read_bytes_charged(self.r, max as u64, what, &mut charge).await?)
    }

    async fn key(&mut self) -> Result<Vec<u8>, Closed> {
        self.bytes(MAX_KEY_LEN, "key").await
    }

    async fn value(&mut self) -> Result<Vec<u8>, Closed> {
        self.bytes(MAX_VALUE_LEN, "value").await
    }

    async fn count(&mut self) -> Result<usize, Closed> {
        let n = self.r.read_u64_le().await?;
        if n > MAX_KEYS_PER_REQUEST as u64 {
            return Err(ReadError::TooLarge {
                what: "key count",
                len: n,
                max: MAX_KEYS_PER_REQUEST as u64,
            }
            .into());
        }
        Ok(n as usize)
    }

    async fn keys(&mut self) -> Result<Vec<Vec<u8>>, Closed> {
        let n = self.count().await?;
        let mut keys = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            keys.push(self.key().await?);
        }
        Ok(keys)
    }
}

/// A connected client: the VALIDATE handshake, then requests until it
/// leaves (`Ok`) or breaks a rule (`Err`, with why).
pub(super) async fn handle_requests<R: AsyncRead + Unpin + Send>(
    r: &mut R,
    id: ClientId,
    out: &Out,
    state: &Mutex<State>,
    deadlines: Deadlines,
) -> Result<(), Closed> {
    tokio::time::timeout(deadlines.validate, validate(r))
        .await
        .map_err(|_| {
            Closed::Refused(format!(
                "no VALIDATE within {:?} of connecting: not a TCPStore client, or a stalled one",
                deadlines.validate
            ))
        })??;
    loop {
        if out.tx.is_closed() {
            return Err(Closed::Refused(
                "the client did not read its replies within the request timeout".into(),
            ));
        }
        let command = match r.read_u8().await {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let rd = Reader {
            r: &mut *r,
            lease: out.budget.reserve(0, "a request")?,
        };
        tokio::time::timeout(deadlines.request, request(command, rd, id, out, state))
            .await
            .map_err(|_| {
                Closed::Refused(format!(
                    "a request (command {command}) did not arrive whole within {:?}: a stalled \
                     or very slow client",
                    deadlines.request
                ))
            })??;
    }
}

/// The first message must be VALIDATE with torch's magic.
async fn validate<R: AsyncRead + Unpin>(r: &mut R) -> Result<(), Closed> {
    let first = r.read_u8().await?;
    if first != cmd::VALIDATE {
        return Err(Closed::Refused(format!(
            "first message was command {first}, not VALIDATE; not a TCPStore client"
        )));
    }
    let magic = r.read_u32_le().await?;
    if magic != wire::VALIDATION_MAGIC {
        return Err(Closed::Refused(format!("bad validation magic {magic:#x}")));
    }
    Ok(())
}

// Every update leaves the state consistent before it can panic, so a
// poisoned lock is still usable.
use consort_comm::lock;

/// One request, by command.
async fn request<R: AsyncRead + Unpin + Send>(
    command: u8,
    mut rd: Reader<'_, R>,
    id: ClientId,
    out: &Out,
    state: &Mutex<State>,
) -> Result<(), Closed> {
    match command {
        cmd::PING => {
            let nonce = rd.r.read_u32_le().await?;
            out.send(nonce.to_le_bytes().to_vec())
        }
        cmd::SET | cmd::COMPARE_SET | cmd::ADD | cmd::APPEND | cmd::DELETE_KEY => {
            write(command, rd, out, state).await
        }
        cmd::MULTI_SET => {
            let n = rd.count().await?;
            let mut pairs = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                // Each pair is paid for as it is read: a request past the
                // limit is refused before the rest of it is read.
                pairs.push((rd.key().await?, rd.value().await?));
            }
            // The bytes move from the request to the store: counted once.
            drop(rd);
            lock(state).put_all(pairs)
        }
        cmd::GET | cmd::MULTI_GET | cmd::CHECK | cmd::GETNUMKEYS => {
            read(command, rd, out, state).await
        }
        cmd::WAIT => {
            let keys = rd.keys().await?;
            drop(rd);
            let mut s = lock(state);
            let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !s.has(k)).collect();
            if missing.is_empty() {
                return out.send(vec![wire::STOP_WAITING]);
            }
            s.forget(id);
            // The keys it waits for stay until it is woken or leaves.
            let bytes = missing.iter().map(|k| k.len() + OVERHEAD).sum();
            s.charge(bytes, 0)?;
            s.awaited.insert(id, (missing.len(), out.clone(), bytes));
            for k in missing {
                s.waiting.entry(k).or_default().push(id);
            }
            Ok(())
        }
        cmd::CANCEL_WAIT => {
            lock(state).forget(id);
            out.send(vec![wire::WAIT_CANCELED])
        }
        cmd::QUEUE_PUSH => {
            let (key, value) = (rd.key().await?, rd.value().await?);
            drop(rd);
            lock(state).push(key, value)
        }
        cmd::QUEUE_POP => {
            let key = rd.key().await?;
            let reply = lock(state).pop(&key);
            out.send(reply)
        }
        cmd::QUEUE_LEN => {
            let key = rd.key().await?;
            let n = lock(state).queues.get(&key).map_or(0, |q| q.len()) as i64;
            out.send(n.to_le_bytes().to_vec())
        }
        other => Err(Closed::Refused(format!("unknown command byte {other}"))),
    }
}

/// The requests that change the map.
async fn write<R: AsyncRead + Unpin + Send>(
    command: u8,
    mut rd: Reader<'_, R>,
    out: &Out,
    state: &Mutex<State>,
) -> Result<(), Closed> {
    let key = rd.key().await?;
    match command {
        cmd::SET => {
            let value = rd.value().await?;
            drop(rd); // the bytes move from the request to the store
            lock(state).put(key, value)
        }
        cmd::COMPARE_SET => {
            let expected = rd.value().await?;
            let desired = rd.value().await?;
            drop(rd);
            let mut s = lock(state);
            let (reply, store) =
                compare_set_rule(s.map.get(&key).map(Vec::as_slice), &expected, &desired);
            let mut bytes = Vec::with_capacity(8 + reply.len());
            wire::put_bytes(&mut bytes, reply);
            if let Some(v) = store {
                let v = v.to_vec();
                s.put(key, v)?;
            }
            out.send(bytes)
        }
        cmd::ADD => {
            let delta = rd.r.read_i64_le().await?;
            let mut s = lock(state);
            let name = String::from_utf8_lossy(&key).into_owned();
            // torch's server drops the client here (no error reply exists
            // in the protocol); we do the same, with a clear log line.
            let (new, bytes) = add_to_value(&name, s.map.get(&key).map(Vec::as_slice), delta)
                .map_err(|e| Closed::Refused(e.to_string()))?;
            s.put(key, bytes)?;
            out.send(new.to_le_bytes().to_vec())
        }
        cmd::APPEND => {
            let value = rd.value().await?;
            drop(rd);
            let mut s = lock(state);
            let fresh = if s.map.contains_key(&key) {
                0
            } else {
                key.len() + OVERHEAD
            };
            s.charge(fresh + value.len(), 0)?;
            s.map
                .entry(key.clone())
                .or_default()
                .extend_from_slice(&value);
            s.wake(&key);
            Ok(())
        }
        _ => {
            // DELETE_KEY
            let mut s = lock(state);
            let held = s.held(&key);
            s.free(held);
            let n = i64::from(s.map.remove(&key).is_some());
            out.send(n.to_le_bytes().to_vec())
        }
    }
}

/// The requests that read the map. A reply's bytes are reserved before it
/// is built: one MULTI_GET naming a large value many times is refused, not
/// copied.
async fn read<R: AsyncRead + Unpin + Send>(
    command: u8,
    mut rd: Reader<'_, R>,
    out: &Out,
    state: &Mutex<State>,
) -> Result<(), Closed> {
    let keys = match command {
        cmd::GETNUMKEYS => Vec::new(),
        cmd::GET => vec![rd.key().await?],
        _ => rd.keys().await?,
    };
    let s = lock(state);
    match command {
        cmd::GETNUMKEYS => out.send((s.map.len() as i64).to_le_bytes().to_vec()),
        cmd::CHECK => {
            let ready = keys.iter().all(|k| s.has(k));
            out.send(vec![if ready {
                wire::CHECK_READY
            } else {
                wire::CHECK_NOT_READY
            }])
        }
        _ => {
            // GET and MULTI_GET: a missing key reads as empty, as in
            // torch's server.
            let value = |k: &Vec<u8>| s.map.get(k).map_or(&[][..], Vec::as_slice);
            let size = keys.iter().map(|k| 8 + value(k).len()).sum::<usize>();
            let what = if command == cmd::GET {
                "a get reply"
            } else {
                "a multi_get reply"
            };
            let lease = out.budget.reserve(size + OVERHEAD, what)?;
            let mut bytes = Vec::with_capacity(size);
            for k in &keys {
                wire::put_bytes(&mut bytes, value(k));
            }
            out.send_reserved(bytes, lease);
            Ok(())
        }
    }
}

/// What the decoder left after [`feed`]: for its property tests and its
/// fuzz target.
#[doc(hidden)]
#[derive(Debug)]
pub struct Fed {
    /// Whether it ended by itself (the input ran out, or a rule was broken)
    /// within 5 s.
    pub ended: bool,
    /// Bytes still reserved in the budget once the client is gone, beyond
    /// what the store holds: must be 0.
    pub leaked: usize,
    /// The replies, in order.
    pub replies: Vec<Vec<u8>>,
}

/// Runs one client's decoder over `bytes` (after VALIDATE when
/// `validated`), against a fresh store with a 1 MiB budget, as the server
/// does; then drops the client as the server does when one leaves.
#[doc(hidden)]
pub fn feed(bytes: &[u8], validated: bool) -> Fed {
    use super::state::Budget;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread runtime");
    let mut input = Vec::new();
    if validated {
        input.push(cmd::VALIDATE);
        input.extend_from_slice(&wire::VALIDATION_MAGIC.to_le_bytes());
    }
    input.extend_from_slice(bytes);
    let budget = Budget::new(1 << 20);
    let state = Mutex::new(State::new(budget.clone()));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let out = Out {
        tx,
        budget: budget.clone(),
    };
    let deadlines = Deadlines {
        validate: Duration::from_secs(1),
        request: Duration::from_secs(1),
    };
    let ended = rt.block_on(async {
        let mut r = &input[..];
        let run = handle_requests(&mut r, 1, &out, &state, deadlines);
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .is_ok()
    });
    drop(out);
    consort_comm::lock(&state).forget(1);
    let mut replies = Vec::new();
    while let Ok((reply, _lease)) = rx.try_recv() {
        replies.push(reply);
    }
    let state = state.into_inner().unwrap_or_else(|p| p.into_inner());
    let held: usize = state
        .map
        .iter()
        .map(|(k, v)| k.len() + v.len() + OVERHEAD)
        .sum::<usize>()
        + state
            .queues
            .iter()
            .map(|(k, q)| k.len() + OVERHEAD + q.iter().map(|v| v.len() + OVERHEAD).sum::<usize>())
            .sum::<usize>();
    Fed {
        ended,
        leaked: budget.used().saturating_sub(held),
        replies,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn decode(bytes: &[u8], validated: bool) -> (bool, usize, Vec<Vec<u8>>) {
        let f = feed(bytes, validated);
        (f.ended, f.leaked, f.replies)
    }

    proptest! {
        /// Any bytes at all: the decoder never panics, always ends (the
        /// input runs out), and gives back every transient byte.
        #[test]
        fn any_bytes_end_cleanly_and_leave_nothing_reserved(
            bytes in proptest::collection::vec(any::<u8>(), 0..512),
            validated in any::<bool>(),
        ) {
            let (ended, leaked, _) = decode(&bytes, validated);
            prop_assert!(ended);
            prop_assert_eq!(leaked, 0);
        }

        /// Well-formed requests with random commands and lengths (the
        /// shape a fuzzer finds first): the same.
        #[test]
        fn random_requests_end_cleanly(
            reqs in proptest::collection::vec(
                (0u8..20, proptest::collection::vec(any::<u8>(), 0..24), 0u64..40),
                0..16,
            ),
        ) {
            let mut bytes = Vec::new();
            for (command, key, n) in reqs {
                bytes.push(command);
                bytes.extend_from_slice(&n.to_le_bytes());
                wire::put_bytes(&mut bytes, &key);
            }
            let (ended, leaked, _) = decode(&bytes, true);
            prop_assert!(ended);
            prop_assert_eq!(leaked, 0);
        }
    }

    #[test]
    fn a_set_then_get_round_trips_through_the_decoder() {
        let mut bytes = vec![cmd::SET];
        wire::put_bytes(&mut bytes, b"/k");
        wire::put_bytes(&mut bytes, b"value");
        bytes.push(cmd::GET);
        wire::put_bytes(&mut bytes, b"/k");
        let (ended, leaked, replies) = decode(&bytes, true);
        assert!(ended);
        assert_eq!(leaked, 0);
        let mut want = Vec::new();
        wire::put_bytes(&mut want, b"value");
        assert_eq!(replies, vec![want]);
    }
}
