//! The engine's local rules on a Gloo group: sequence numbers fixed when a
//! call is made, the sticky failure with its first cause, a dropped call's
//! cause, each call's deadline (the engine's timer), the flight record and
//! the launcher's heartbeat, as every other driver keeps them. What Gloo's
//! wire has no room for stays off: no fingerprints cross it and no stall
//! probes are sent (torch's ranks would not answer them).

use std::{
    path::Path,
    sync::{Arc, Mutex, Weak},
    time::{Duration, Instant},
};

use consort_comm::{
    CommError, ErrorContext, GroupId, Op, Result,
    engine::{CallId, Engine},
    flight::{Entry, FlightOut, FlightSource},
    heartbeat::Heartbeat,
    lock,
};

/// One Gloo group's rules, its heartbeat and where its record goes.
#[derive(Debug)]
pub(super) struct Rules {
    engine: Mutex<Engine<()>>,
    group: GroupId,
    beat: Option<Arc<Heartbeat>>,
    flight: Option<Arc<FlightOut>>,
}

/// A call made on a Gloo group.
#[derive(Clone, Copy, Debug)]
pub(super) struct Begun {
    pub(super) id: CallId,
    pub(super) ctx: ErrorContext,
    /// When its timeout passes (the engine's timer).
    pub(super) deadline: Instant,
}

/// Where a job's Gloo groups keep their heartbeat and record (a world and
/// its subgroups share them: one file each per rank).
#[derive(Clone, Debug, Default)]
pub(super) struct Outs {
    pub(super) beat: Option<Arc<Heartbeat>>,
    pub(super) flight: Option<Arc<FlightOut>>,
}

impl Outs {
    /// From the launcher's files for world rank `rank` of `world`.
    pub(super) fn new(
        heartbeat: Option<&Path>,
        flight_dir: Option<&Path>,
        (rank, world): (usize, usize),
    ) -> Self {
        Outs {
            beat: Heartbeat::for_rank(heartbeat, rank),
            flight: flight_dir.map(|d| Arc::new(FlightOut::new(d, rank, world))),
        }
    }
}

impl Rules {
    /// The rules of `group`, in which this rank is `rank` of `size`.
    pub(super) fn new(group: GroupId, (rank, size): (usize, usize), outs: &Outs) -> Arc<Self> {
        let r = Arc::new(Rules {
            engine: Mutex::new(Engine::for_group(group, rank, size)),
            group,
            beat: outs.beat.clone(),
            flight: outs.flight.clone(),
        });
        if let Some(out) = &r.flight {
            let weak: Weak<dyn FlightSource> = Arc::downgrade(&r) as Weak<dyn FlightSource>;
            consort_comm::flight::register(weak, out);
        }
        r
    }

    fn engine(&self) -> std::sync::MutexGuard<'_, Engine<()>> {
        let mut e = lock(&self.engine);
        if self.flight.is_some() {
            e.flight_mut().set_now_us(consort_comm::flight::now_us());
        }
        e
    }

    /// Makes `op` (its arguments checked): its sequence number now, and its
    /// deadline `timeout` from now. Fails fast with the first cause when the
    /// group has failed.
    pub(super) fn begin(&self, op: &Op<'_>, root: usize, timeout: Duration) -> Result<Begun> {
        let group = self.group;
        let mut e = self.engine();
        let b = e.begin(group, op.shape(root))?;
        let now = Instant::now();
        e.arm(b.id, now, timeout, None);
        let deadline = e.deadline(b.id).unwrap_or(now);
        drop(e);
        if let Some(beat) = &self.beat {
            beat.made(&b.fp, consort_comm::heartbeat::now_us());
        }
        Ok(Begun {
            id: b.id,
            ctx: b.ctx,
            deadline,
        })
    }

    /// Ends call `id` with `r`: a failure poisons the group (the first
    /// cause sticks) and writes this rank's record.
    pub(super) fn end(&self, id: CallId, r: Result<()>) -> Result<()> {
        let (r, first) = {
            let mut e = self.engine();
            let first = e.poisoned(self.group).is_none();
            (e.end(id, r).result, first)
        };
        self.ended();
        if let (Err(e), true, Some(out)) = (&r, first, &self.flight) {
            consort_comm::flight::dump(out, &e.to_string(), true);
        }
        r
    }

    /// Call `id` was refused before anything of it reached a peer: it ends
    /// with `e`, and the group goes on.
    pub(super) fn refuse(&self, id: CallId, e: CommError) -> CommError {
        let e = self.engine().refuse(id, e);
        self.ended();
        e
    }

    /// Call `id` was dropped before it finished: the group fails with the
    /// dropper's cause ([`consort_comm::cancel`]) or with one that says
    /// so, which is returned (the connections must close: the peers may be
    /// part-way through it). `None` when the call had already ended.
    pub(super) fn cancel(&self, id: CallId) -> Option<CommError> {
        let mut e = self.engine();
        e.context(id)?;
        e.cancel(id, consort_comm::cancel::cause());
        let first = e.poisoned(self.group).cloned();
        drop(e);
        self.ended();
        if let (Some(e), Some(out)) = (&first, &self.flight) {
            consort_comm::flight::dump(out, &e.to_string(), true);
        }
        first
    }

    fn ended(&self) {
        if let Some(beat) = &self.beat {
            beat.ended(consort_comm::heartbeat::now_us());
        }
    }
}

impl FlightSource for Rules {
    fn flight_entries(&self) -> Vec<Entry> {
        self.engine().flight().entries().collect()
    }
}
