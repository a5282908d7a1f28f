//! One client's requests, decoded and answered. Every byte a request
//! reads is paid for from the client's share of the budget before it is
//! allocated (a value as it arrives, not as its header announces), every
//! reply before it is queued, and every change either completes with its
//! reply or changes nothing. A request must arrive whole within the
//! request timeout once its first byte has come (an idle client may wait
//! between requests for as long as it likes, as torch's clients do for a
//! whole job). Generic over the reader, so the decoder can be fed any
//! bytes.

use std::{sync::Arc, sync::Mutex, time::Duration};

use consort_comm::store::{
    MAX_KEY_LEN, MAX_KEYS_PER_REQUEST, MAX_VALUE_LEN, add_to_value, compare_set_rule,
};
use tokio::io::{AsyncRead, AsyncReadExt};

use super::super::wire::{self, ReadError, cmd};
use super::Closed;
use super::budget::{ENTRY, Lease, Phase, Tier, Value, block};
use super::state::{Out, Reply, State, wait_cost};

/// How long a client may take: to send VALIDATE after connecting, and to
/// finish a request it has started.
#[derive(Clone, Copy, Debug)]
pub(super) struct Deadlines {
    pub(super) validate: Duration,
    pub(super) request: Duration,
}

/// The first bytes of a value paid for before they arrive; the rest is
/// paid for as it comes, doubling, so a header announcing 8 MiB costs 4 KiB
/// until the bytes are sent.
const FIRST: usize = 4096;

/// A request's reader: what it reads is charged to its lease.
struct Reader<'a, R> {
    r: &'a mut R,
    lease: Lease,
}

impl<R: AsyncRead + Unpin + Send> Reader<'_, R> {
    async fn bytes(&mut self, max: usize, what: &'static str) -> Result<Vec<u8>, Closed> {
        let len = self.r.read_u64_le().await?;
        if len > max as u64 {
            return Err(ReadError::TooLarge {
                what,
                len,
                max: max as u64,
            }
            .into());
        }
        let len = len as usize;
        let mut v = Vec::new();
        while v.len() < len {
            let want = len.min((v.capacity() * 2).max(FIRST));
            // The old and the new buffer are both alive while it grows.
            self.lease.grow_or_shed(block(want), what).await?;
            let had = v.capacity();
            v.reserve_exact(want - v.len());
            self.lease.shrink(block(had));
            let filled = v.len();
            v.resize(want, 0);
            self.r.read_exact(&mut v[filled..]).await?;
        }
        Ok(v)
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

    /// Makes room for one more of `total` items in `v`, paying for the
    /// larger buffer (and the old one, alive while it grows) first.
    async fn room<T>(&mut self, v: &mut Vec<T>, total: usize) -> Result<(), Closed> {
        if v.len() < v.capacity() {
            return Ok(());
        }
        let size = std::mem::size_of::<T>();
        let want = total.min((v.capacity() * 2).max(16));
        self.lease
            .grow_or_shed(block(want * size), "a request's list")
            .await?;
        let had = v.capacity();
        v.reserve_exact(want - v.len());
        self.lease.shrink(block(had * size));
        Ok(())
    }

    async fn keys(&mut self) -> Result<Vec<Vec<u8>>, Closed> {
        let n = self.count().await?;
        let mut keys = Vec::new();
        for _ in 0..n {
            self.room(&mut keys, n).await?;
            let k = self.key().await?;
            keys.push(k);
        }
        Ok(keys)
    }

    /// A value read, paid for as held: its transient charge is given back
    /// first, then the store is asked.
    async fn held_value(
        &mut self,
        s: &Mutex<State>,
        out: &Out,
        key: &[u8],
    ) -> Result<Arc<Value>, Closed> {
        let v = self.value().await?;
        self.lease.shrink(block(v.capacity()));
        // Room for the value and, if the key is new, its entry.
        let need = Value::cost(v.len()) + ENTRY + block(key.len());
        out.budget.room_to_hold(&out.conn, need).await;
        lock(s).value(v, "a value")
    }
}

/// A connected client: the VALIDATE handshake, then requests until it
/// leaves (`Ok`) or breaks a rule (`Err`, with why).
pub(super) async fn handle_requests<R: AsyncRead + Unpin + Send>(
    r: &mut R,
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
    out.conn.advance(Phase::Validated);
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
            lease: out.budget.zero(Some(&out.conn)),
        };
        tokio::time::timeout(deadlines.request, request(command, rd, out, state))
            .await
            .map_err(|_| {
                Closed::Refused(format!(
                    "a request (command {command}) did not arrive whole within {:?}: a stalled \
                     or very slow client",
                    deadlines.request
                ))
            })??;
        out.conn.advance(Phase::Active);
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
    out: &Out,
    state: &Mutex<State>,
) -> Result<(), Closed> {
    match command {
        cmd::PING => {
            let nonce = rd.r.read_u32_le().await?;
            out.control(nonce.to_le_bytes().to_vec())
        }
        cmd::SET | cmd::COMPARE_SET | cmd::ADD | cmd::APPEND | cmd::DELETE_KEY | cmd::BARRIER => {
            write(command, rd, out, state).await
        }
        cmd::MULTI_SET => {
            let n = rd.count().await?;
            let mut pairs = Vec::new();
            for _ in 0..n {
                // Each pair is paid for by this client as it is read (a
                // request past its share is refused before the rest of it
                // is read); the store pays once all of it is stored.
                rd.room(&mut pairs, n).await?;
                let k = rd.key().await?;
                let v = rd.value().await?;
                pairs.push((k, v));
            }
            let mut s = lock(state);
            let mut values = Vec::with_capacity(pairs.len());
            for (k, v) in pairs {
                rd.lease.shrink(block(v.capacity()));
                values.push((k, s.value(v, "a multi_set value")?));
            }
            s.put_all(values)
        }
        cmd::GET | cmd::MULTI_GET | cmd::CHECK | cmd::GETNUMKEYS | cmd::LIST_KEYS => {
            read(command, rd, out, state).await
        }
        cmd::WAIT => {
            let keys = rd.keys().await?;
            let lease = out
                .budget
                .owe_or_shed(&out.conn, wait_cost(&keys), "a wait")
                .await?;
            drop(rd);
            let mut s = lock(state);
            let mut missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !s.has(k)).collect();
            // A key named twice is awaited once (torch counts it twice and
            // wakes it twice: the same).
            missing.sort_unstable();
            missing.dedup();
            if missing.is_empty() {
                drop(s);
                return out.control(vec![wire::STOP_WAITING]);
            }
            s.wait(out, missing, lease);
            Ok(())
        }
        cmd::CANCEL_WAIT => {
            let lease = out.small(1)?;
            lock(state).forget(out.conn.id);
            out.send(vec![wire::WAIT_CANCELED], Vec::new(), lease);
            Ok(())
        }
        cmd::QUEUE_PUSH => {
            let key = rd.key().await?;
            let value = rd.held_value(state, out, &key).await?;
            lock(state).push(key, value)
        }
        cmd::QUEUE_POP => {
            let key = rd.key().await?;
            // Paid for before the queue changes: a refused reply loses
            // nothing.
            let lease = out.budget.owe(
                &out.conn,
                Reply::cost(8, 1),
                Tier::Control,
                "a queue_pop reply",
            )?;
            let (before, value) = lock(state).pop(&key);
            out.send(
                before.to_le_bytes().to_vec(),
                value.into_iter().map(Some).collect(),
                lease,
            );
            Ok(())
        }
        cmd::QUEUE_LEN => {
            let key = rd.key().await?;
            let n = lock(state).queue_len(&key) as i64;
            out.control(n.to_le_bytes().to_vec())
        }
        other => Err(Closed::Refused(format!("unknown command byte {other}"))),
    }
}

/// Which of COMPARE_SET's three byte strings its reply is.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && std::ptr::eq(a.as_ptr(), b.as_ptr())
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
            let value = rd.held_value(state, out, &key).await?;
            lock(state).put(key, value)
        }
        cmd::COMPARE_SET => {
            let expected = rd.value().await?;
            let desired = rd.held_value(state, out, &key).await?;
            let reply = out
                .budget
                .owe(&out.conn, Reply::cost(0, 1), Tier::Control, "a reply")?;
            let mut s = lock(state);
            let current = s.get(&key).cloned();
            let (said, store) = compare_set_rule(
                current.as_deref().map(Value::bytes),
                &expected,
                desired.bytes(),
            );
            let stores = store.is_some();
            let (is_desired, is_expected) = (same(said, desired.bytes()), same(said, &expected));
            let answer = if is_desired {
                desired.clone()
            } else if is_expected {
                // The request's bytes answer: its lease pays for them.
                Value::new(
                    expected,
                    std::mem::replace(&mut rd.lease, out.budget.zero(None)),
                )
            } else {
                current.clone().unwrap_or_else(|| desired.clone())
            };
            if stores {
                s.put(key, desired)?;
            }
            drop(s);
            out.send(Vec::new(), vec![Some(answer)], reply);
            Ok(())
        }
        cmd::ADD | cmd::BARRIER => {
            let n = rd.r.read_i64_le().await?;
            count(command, key, n, out, state).await
        }
        cmd::APPEND => {
            let more = rd.value().await?;
            let mut s = lock(state);
            let old = s.get(&key).map_or(&[][..], |v| v.bytes());
            // The old value, the appended bytes and the new value are all
            // alive until the new one replaces the old: all paid for.
            let total = old.len() + more.len();
            let lease = s.budget.hold(Value::cost(total), "an append")?;
            let mut bytes = Vec::with_capacity(total);
            bytes.extend_from_slice(old);
            bytes.extend_from_slice(&more);
            s.put(key, Value::new(bytes, lease))
        }
        _ => {
            // DELETE_KEY
            let lease = out.small(8)?;
            let n = i64::from(lock(state).delete(&key));
            out.send(n.to_le_bytes().to_vec(), Vec::new(), lease);
            Ok(())
        }
    }
}

/// ADD (reply: the new count) and BARRIER (add one; reply once the count
/// reaches the world size), torch's rules: the value is an ASCII decimal.
async fn count(
    command: u8,
    key: Vec<u8>,
    n: i64,
    out: &Out,
    state: &Mutex<State>,
) -> Result<(), Closed> {
    let barrier = command == cmd::BARRIER;
    let delta = if barrier { 1 } else { n };
    // A barrier short of its count waits on its key: paid for first.
    let wait = if barrier {
        Some(
            out.budget
                .owe_or_shed(&out.conn, wait_cost(&[&key]), "a barrier")
                .await?,
        )
    } else {
        None
    };
    let reply = out.small(8)?;
    let mut s = lock(state);
    let name = String::from_utf8_lossy(&key).into_owned();
    // torch's server drops the client here (no error reply exists in the
    // protocol); we do the same, with a clear log line.
    let (new, bytes) = add_to_value(&name, s.get(&key).map(|v| v.bytes()), delta)
        .map_err(|e| Closed::Refused(e.to_string()))?;
    let value = s.value(bytes, "a counter")?;
    match wait {
        None => {
            s.put(key, value)?;
            drop(s);
            out.send(new.to_le_bytes().to_vec(), Vec::new(), reply);
            Ok(())
        }
        Some(_) if new >= n => {
            s.put(key, value)?;
            drop(s);
            out.send(vec![wire::STOP_WAITING], Vec::new(), reply);
            Ok(())
        }
        Some(lease) => {
            s.put_quiet(key.clone(), value)?;
            s.wait(out, vec![key], lease);
            Ok(())
        }
    }
}

/// The requests that read the map. A reply shares the values it sends and
/// pays for the rest before it is built.
async fn read<R: AsyncRead + Unpin + Send>(
    command: u8,
    mut rd: Reader<'_, R>,
    out: &Out,
    state: &Mutex<State>,
) -> Result<(), Closed> {
    match command {
        cmd::GETNUMKEYS => {
            let n = lock(state).num_keys() as i64;
            out.control(n.to_le_bytes().to_vec())
        }
        cmd::CHECK => {
            let keys = rd.keys().await?;
            let ready = {
                let s = lock(state);
                keys.iter().all(|k| s.has(k))
            };
            out.control(vec![if ready {
                wire::CHECK_READY
            } else {
                wire::CHECK_NOT_READY
            }])
        }
        cmd::LIST_KEYS => {
            let s = lock(state);
            let size = 8 + s.keys().map(|k| 8 + k.len()).sum::<usize>();
            let lease = out.budget.owe(
                &out.conn,
                Reply::cost(size, 0),
                Tier::Normal,
                "a list_keys reply",
            )?;
            let mut head = Vec::with_capacity(size);
            head.extend_from_slice(&(s.num_keys() as u64).to_le_bytes());
            for k in s.keys() {
                wire::put_bytes(&mut head, k);
            }
            drop(s);
            out.send(head, Vec::new(), lease);
            Ok(())
        }
        _ => {
            // GET and MULTI_GET: a missing key reads as empty, as in
            // torch's server.
            let keys = if command == cmd::GET {
                vec![rd.key().await?]
            } else {
                rd.keys().await?
            };
            let lease = if command == cmd::GET {
                out.budget
                    .owe(&out.conn, Reply::cost(0, 1), Tier::Control, "a get reply")?
            } else {
                out.budget
                    .owe_or_shed(&out.conn, Reply::cost(0, keys.len()), "a multi_get reply")
                    .await?
            };
            let mut values = Vec::with_capacity(keys.len());
            {
                let s = lock(state);
                values.extend(keys.iter().map(|k| s.get(k).cloned()));
            }
            out.send(Vec::new(), values, lease);
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
    use super::budget::{Budget, Conn};
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
    let conn = Conn::new(1, std::net::SocketAddr::from(([127, 0, 0, 1], 1)));
    budget.register(&conn);
    let state = Mutex::new(State::new(budget.clone()));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let out = Out {
        tx,
        budget: budget.clone(),
        conn: conn.clone(),
    };
    let deadlines = Deadlines {
        validate: Duration::from_secs(1),
        request: Duration::from_secs(1),
    };
    let ended = rt.block_on(async {
        let mut r = &input[..];
        let run = handle_requests(&mut r, &out, &state, deadlines);
        tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .is_ok()
    });
    drop(out);
    lock(&state).forget(1);
    let mut replies = Vec::new();
    while let Ok(reply) = rx.try_recv() {
        replies.push(reply.encode());
    }
    let held = lock(&state).audit();
    Fed {
        ended,
        leaked: budget.used().saturating_sub(held) + conn.used(),
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
