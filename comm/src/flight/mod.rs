//! The flight recorder: the last calls of every group on this rank, kept
//! at close to no cost, written out when something goes wrong, and the
//! analysis that merges every rank's record into a verdict ("rank 2 never
//! entered all_reduce seq 183 (world); ranks 0, 1 and 3 waited in it for
//! 30.0 s").
//!
//! torch's flight recorder (`TORCH_FR_BUFFER_SIZE`, `fr_trace`) is the
//! model: a ring of entries per rank, one file per rank, matched across
//! ranks by group and sequence number. The [`crate::engine::Engine`]
//! records every call it is told of (made, started, ended), so every
//! driver that uses it records alike; a driver gives the time
//! ([`FlightRecorder::set_now_us`]) and decides when to dump.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::{DType, Fingerprint, GroupId, OpKind};

mod out;

pub use out::{
    FlightOut, FlightSource, dump, dump_flight_records, dump_on_sigusr1, now_us, register,
};

/// torch's default `TORCH_FR_BUFFER_SIZE`: entries kept per rank.
pub const DEFAULT_ENTRIES: usize = 2000;

/// Where a recorded call got to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Made (its sequence number fixed); nothing received yet.
    Issued,
    /// Its first frame from a peer arrived.
    Started,
    /// Finished.
    Done,
    /// Failed (see the entry's error).
    Failed,
}

/// One recorded call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Record id, increasing on this rank.
    pub id: u64,
    /// The group (`world`, or `group 0x...`).
    pub group: String,
    /// Sequence number in the group (0 for send and recv).
    pub seq: u64,
    /// `all_reduce`, `broadcast`, ...
    pub op: String,
    /// Element type.
    pub dtype: String,
    /// Elements (the input's, where input and output differ).
    pub count: u64,
    /// Where it got to.
    pub state: State,
    /// When it was made, µs (the driver's clock: wall time since the Unix
    /// epoch, or the simulator's virtual time).
    pub issued_us: u64,
    /// When its first frame arrived.
    pub started_us: Option<u64>,
    /// When it ended.
    pub ended_us: Option<u64>,
    /// Its error, if it failed.
    pub error: Option<String>,
}

/// One call as the ring keeps it: plain values, so recording a call
/// allocates nothing (the names are written out only in a dump).
#[derive(Debug, Clone)]
struct Record {
    id: u64,
    group: GroupId,
    seq: u64,
    op: OpKind,
    dtype: DType,
    count: u64,
    state: State,
    issued_us: u64,
    started_us: Option<u64>,
    ended_us: Option<u64>,
    error: Option<String>,
}

impl Record {
    fn entry(&self) -> Entry {
        Entry {
            id: self.id,
            group: self.group.to_string(),
            seq: self.seq,
            op: self.op.name().to_string(),
            dtype: self.dtype.name().to_string(),
            count: self.count,
            state: self.state,
            issued_us: self.issued_us,
            started_us: self.started_us,
            ended_us: self.ended_us,
            error: self.error.clone(),
        }
    }
}

/// The last calls of one rank, oldest first.
#[derive(Debug, Clone)]
pub struct FlightRecorder {
    capacity: usize,
    records: VecDeque<Record>,
    /// (engine call id, record id) of the calls in flight: a handful, so a
    /// vector that keeps its room.
    open: Vec<(u64, u64)>,
    next: u64,
    now_us: u64,
    /// `now_us` is stale: the wall clock is read when an event is next
    /// stamped ([`FlightRecorder::set_now_lazy`]).
    lazy: bool,
}

impl Default for FlightRecorder {
    fn default() -> Self {
        Self::new(DEFAULT_ENTRIES)
    }
}

impl FlightRecorder {
    /// A recorder that keeps the last `capacity` calls (0 keeps none).
    pub fn new(capacity: usize) -> Self {
        FlightRecorder {
            capacity,
            records: VecDeque::with_capacity(capacity.min(DEFAULT_ENTRIES)),
            open: Vec::new(),
            next: 0,
            now_us: 0,
            lazy: false,
        }
    }

    /// Sets the clock that the next events are stamped with.
    pub fn set_now_us(&mut self, now_us: u64) {
        self.now_us = now_us;
        self.lazy = false;
    }

    /// The next event is stamped with the wall clock ([`now_us`]) read when
    /// it happens, and the clock is not read if none does: for a driver's
    /// loop that may or may not record anything (a read is ~20 ns, a tenth
    /// of a small collective's own work).
    pub fn set_now_lazy(&mut self) {
        self.lazy = true;
    }

    /// The time to stamp an event with.
    fn now(&mut self) -> u64 {
        if self.lazy {
            self.now_us = now_us();
            self.lazy = false;
        }
        self.now_us
    }

    /// The entries, oldest first.
    pub fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        self.records.iter().map(Record::entry)
    }

    fn record(&mut self, call: u64) -> Option<&mut Record> {
        let id = self.open.iter().find(|(c, _)| *c == call)?.1;
        let first = self.records.front()?.id;
        self.records
            .get_mut(usize::try_from(id.checked_sub(first)?).ok()?)
    }

    /// Call `call` was made with fingerprint `fp`.
    pub(crate) fn issued(&mut self, call: u64, fp: &Fingerprint) {
        if self.capacity == 0 {
            return;
        }
        if self.records.len() == self.capacity
            && let Some(old) = self.records.pop_front()
        {
            self.open.retain(|(_, id)| *id != old.id);
        }
        let id = self.next;
        self.next += 1;
        let issued_us = self.now();
        self.records.push_back(Record {
            id,
            group: fp.group,
            seq: fp.seq,
            op: fp.op,
            dtype: fp.dtype,
            count: fp.count,
            state: State::Issued,
            issued_us,
            started_us: None,
            ended_us: None,
            error: None,
        });
        self.open.push((call, id));
    }

    /// Call `call` took its first frame.
    pub(crate) fn started(&mut self, call: u64) {
        if self.record(call).is_some_and(|r| r.state == State::Issued) {
            let now = self.now();
            if let Some(r) = self.record(call) {
                r.state = State::Started;
                r.started_us = Some(now);
            }
        }
    }

    /// Call `call` ended, with `error` if it failed.
    pub(crate) fn ended(&mut self, call: u64, error: Option<String>) {
        let now = self.now();
        if let Some(r) = self.record(call) {
            r.state = if error.is_some() {
                State::Failed
            } else {
                State::Done
            };
            r.ended_us = Some(now);
            r.error = error;
        }
        self.open.retain(|(c, _)| *c != call);
    }

    /// This rank's dump: what [`analyze`] reads.
    pub fn dump(&self, rank: usize, world: usize, reason: &str) -> Dump {
        Dump {
            rank,
            world,
            pid: std::process::id(),
            reason: reason.to_string(),
            dumped_us: self.now_us,
            entries: self.entries().collect(),
        }
    }
}

/// One rank's flight record, as written to `rank-K.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Dump {
    /// The rank (in the world).
    pub rank: usize,
    /// The world size.
    pub world: usize,
    /// Its process.
    pub pid: u32,
    /// Why it was written ("all_reduce seq 3 failed: ...", "SIGUSR1").
    pub reason: String,
    /// When, on the same clock as the entries.
    pub dumped_us: u64,
    /// The calls, oldest first.
    pub entries: Vec<Entry>,
}

impl Dump {
    /// As `rank-K.json` holds it.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }

    /// Reads `rank-K.json`.
    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes).map_err(|e| e.to_string())
    }
}

/// The verdict on a set of dumps: one line per finding, most telling
/// first. Matches entries by (group, seq) across ranks, as torch's
/// `fr_trace` does: the first collective some ranks entered and others
/// never did, calls that differ at one seq, and the first failure.
pub fn analyze(dumps: &[Dump]) -> Vec<String> {
    let Some(world) = dumps.iter().map(|d| d.world).max() else {
        return vec!["no flight records to analyze".into()];
    };
    let mut out = Vec::new();
    let idx = Index::new(dumps);
    // A damaged record must not make the analysis enumerate billions.
    let seen = dumps.iter().map(|d| d.rank + 1).max().unwrap_or(1);
    let world = world.min(seen.max(1 << 16));
    let missing: Vec<usize> = (0..world).filter(|r| !idx.have.contains(r)).collect();
    if !missing.is_empty() {
        out.push(format!(
            "no record from rank(s) {} (killed, stopped or never failed): they are left out \
             below",
            list(&missing)
        ));
    }
    match idx.divergence() {
        Some(line) => out.push(line),
        None => out.extend(waiting(dumps)),
    }
    out.extend(first_failure(dumps));
    if out.iter().all(|l| l.starts_with("no record")) {
        out.push(
            "every recorded collective was entered by every rank that recorded its group, and \
             none was left unfinished"
                .into(),
        );
    }
    out
}

/// Every rank's collectives, matched by (group, seq).
struct Index<'a> {
    /// (group, seq) → rank → its entry.
    by_call: BTreeMap<(&'a str, u64), BTreeMap<usize, &'a Entry>>,
    /// (group, rank) → the first and last seq that rank recorded there.
    span: BTreeMap<(&'a str, usize), (u64, u64)>,
    /// When each rank wrote its record.
    dumped: BTreeMap<usize, u64>,
    /// The ranks with a record.
    have: BTreeSet<usize>,
}

impl<'a> Index<'a> {
    fn new(dumps: &'a [Dump]) -> Self {
        let mut idx = Index {
            by_call: BTreeMap::new(),
            span: BTreeMap::new(),
            dumped: dumps.iter().map(|d| (d.rank, d.dumped_us)).collect(),
            have: dumps.iter().map(|d| d.rank).collect(),
        };
        for d in dumps {
            for e in d
                .entries
                .iter()
                .filter(|e| e.op != "send" && e.op != "recv")
            {
                idx.by_call
                    .entry((&e.group, e.seq))
                    .or_default()
                    .insert(d.rank, e);
                idx.span
                    .entry((&e.group, d.rank))
                    .and_modify(|(lo, hi)| (*lo, *hi) = ((*lo).min(e.seq), (*hi).max(e.seq)))
                    .or_insert((e.seq, e.seq));
            }
        }
        idx
    }

    /// The first collective where the ranks part: different calls at one
    /// seq, or one that some ranks entered and others never did.
    fn divergence(&self) -> Option<String> {
        for (&(group, seq), ranks) in &self.by_call {
            let (&r0, &first) = ranks.iter().next()?;
            let same =
                |e: &Entry| (&e.op, &e.dtype, e.count) == (&first.op, &first.dtype, first.count);
            if let Some((r1, e1)) = ranks.iter().find(|(_, e)| !same(e)) {
                return Some(format!(
                    "ranks called different collectives at seq {seq} ({group}): rank {r0} {} of \
                     {} x {}, rank {r1} {} of {} x {}",
                    first.op, first.count, first.dtype, e1.op, e1.count, e1.dtype
                ));
            }
            // Ranks that recorded this group up to here: one whose ring
            // starts after this seq says nothing.
            let members: Vec<usize> = self
                .have
                .iter()
                .copied()
                .filter(|r| {
                    self.span
                        .get(&(group, *r))
                        .is_some_and(|&(lo, _)| lo <= seq)
                })
                .collect();
            let absent: Vec<usize> = members
                .iter()
                .copied()
                .filter(|r| !ranks.contains_key(r))
                .collect();
            if !absent.is_empty() && absent.len() < members.len() {
                return Some(self.never_entered(group, seq, ranks, &absent));
            }
        }
        None
    }

    /// "rank 2 (last entered seq 2) never entered all_reduce seq 3 (world);
    /// ranks 0 and 1 waited in it for 30.0 s".
    fn never_entered(
        &self,
        group: &str,
        seq: u64,
        ranks: &BTreeMap<usize, &Entry>,
        absent: &[usize],
    ) -> String {
        let waited: Vec<usize> = ranks.keys().copied().collect();
        let longest = ranks
            .iter()
            .map(|(r, e)| {
                let end = e
                    .ended_us
                    .or(self.dumped.get(r).copied())
                    .unwrap_or(e.issued_us);
                end.saturating_sub(e.issued_us)
            })
            .max()
            .unwrap_or(0);
        let who: Vec<String> = absent
            .iter()
            .map(|r| match self.span.get(&(group, *r)) {
                Some((_, last)) => format!("rank {r} (last entered seq {last})"),
                None => format!("rank {r}"),
            })
            .collect();
        let op = ranks.values().next().map_or("?", |e| e.op.as_str());
        format!(
            "{} never entered {op} seq {seq} ({group}); {} {} waited in it for {:.1} s",
            who.join(", "),
            if waited.len() == 1 { "rank" } else { "ranks" },
            list(&waited),
            longest as f64 / 1e6
        )
    }
}

/// The earliest failed call across the ranks.
fn first_failure(dumps: &[Dump]) -> Option<String> {
    let (r, e) = dumps
        .iter()
        .flat_map(|d| d.entries.iter().map(move |e| (d.rank, e)))
        .filter(|(_, e)| e.state == State::Failed)
        .min_by_key(|(_, e)| e.ended_us.unwrap_or(u64::MAX))?;
    Some(format!(
        "first failure: rank {r}, {} seq {} ({}): {}",
        e.op,
        e.seq,
        e.group,
        e.error.as_deref().unwrap_or("(no message)")
    ))
}

/// The calls still in flight when the records were written, one line per
/// call: "ranks 0 and 1 were in all_reduce seq 3 (world) ..., for 2.1 s".
fn waiting(dumps: &[Dump]) -> Vec<String> {
    let mut open: BTreeMap<(String, u64, String), (Vec<usize>, u64)> = BTreeMap::new();
    for d in dumps {
        for e in d
            .entries
            .iter()
            .filter(|e| matches!(e.state, State::Issued | State::Started))
        {
            let w = open
                .entry((e.group.clone(), e.seq, e.op.clone()))
                .or_insert((Vec::new(), 0));
            w.0.push(d.rank);
            w.1 = w.1.max(d.dumped_us.saturating_sub(e.issued_us));
        }
    }
    open.into_iter()
        .map(|((group, seq, op), (ranks, us))| {
            let who = if ranks.len() == 1 {
                format!("rank {} was", list(&ranks))
            } else {
                format!("ranks {} were", list(&ranks))
            };
            format!(
                "{who} in {op} seq {seq} ({group}) when the records were written, for {:.1} s",
                us as f64 / 1e6
            )
        })
        .collect()
}

/// `0, 1 and 3`.
fn list(ranks: &[usize]) -> String {
    let s: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match s.len() {
        0 => String::new(),
        1 => s[0].clone(),
        n => format!("{} and {}", s[..n - 1].join(", "), s[n - 1]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, OpKind};

    fn fp(seq: u64, op: OpKind) -> Fingerprint {
        Fingerprint {
            group: GroupId::WORLD,
            seq,
            op,
            dtype: DType::F32,
            count: 4,
            root: 0,
            reduce_op: None,
        }
    }

    /// A lazy clock stamps each event with the wall clock when it happens;
    /// a set time overrides it, and a start already stamped is not moved.
    #[test]
    fn a_lazy_clock_is_read_when_an_event_is_stamped() {
        let mut f = FlightRecorder::new(4);
        f.set_now_us(5);
        f.set_now_lazy();
        let before = now_us();
        f.issued(0, &fp(0, OpKind::AllReduce));
        f.started(0);
        let e = f.entries().next().unwrap();
        assert!(e.issued_us >= before && e.issued_us <= now_us());
        assert_eq!(
            e.started_us,
            Some(e.issued_us),
            "one reading until the next lazy mark"
        );
        f.set_now_us(7);
        f.started(0);
        f.ended(0, None);
        let e = f.entries().next().unwrap();
        assert_eq!((e.started_us, e.ended_us), (Some(e.issued_us), Some(7)));
    }

    /// Ranks 0 and 1 made seqs 0..=3; rank 2 stopped after seq 2.
    #[test]
    fn the_rank_that_never_entered_is_named_with_who_waited() {
        let dumps: Vec<Dump> = (0..3)
            .map(|r| {
                let mut f = FlightRecorder::new(8);
                let last = if r == 2 { 2 } else { 3 };
                for s in 0..=last {
                    f.set_now_us(s * 1_000_000);
                    f.issued(s, &fp(s, OpKind::AllReduce));
                    if s < 3 {
                        f.ended(s, None);
                    }
                }
                f.set_now_us(33_000_000);
                if r < 2 {
                    f.ended(3, Some("timed out".into()));
                }
                f.dump(r, 3, "test")
            })
            .collect();
        let v = analyze(&dumps);
        assert_eq!(
            v[0],
            "rank 2 (last entered seq 2) never entered all_reduce seq 3 (world); ranks 0 and 1 \
             waited in it for 30.0 s"
        );
        assert!(v[1].starts_with("first failure: rank 0, all_reduce seq 3 (world): timed out"));
    }

    #[test]
    fn the_ring_keeps_the_last_entries_and_mismatches_are_named() {
        let mut f = FlightRecorder::new(2);
        for s in 0..5 {
            f.issued(s, &fp(s, OpKind::AllReduce));
            f.ended(s, None);
        }
        let seqs: Vec<u64> = f.entries().map(|e| e.seq).collect();
        assert_eq!(seqs, [3, 4]);
        let mut g = FlightRecorder::new(2);
        g.issued(0, &fp(3, OpKind::Broadcast));
        let v = analyze(&[f.dump(0, 2, "t"), g.dump(1, 2, "t")]);
        assert!(
            v[0].contains("different collectives at seq 3") && v[0].contains("broadcast"),
            "{v:?}"
        );
    }
}
