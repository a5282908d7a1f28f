//! Time in the engine: each call's deadline and stall probe, sans-IO, with
//! the time always an argument (as quinn-proto's `Connection` takes it).
//!
//! A driver arms a call when it starts ([`Engine::arm`]), tells the engine
//! when the call moves on ([`Engine::progressed`]), wakes no later than
//! [`Engine::poll_timeout`] and then calls [`Engine::handle_timeout`],
//! which says which stall probes to send. A call past its deadline fails
//! through [`Engine::failure`] like any other cause, so `Timeout` is built
//! here and nowhere else in the drivers.

use std::time::{Duration, Instant};

use super::{CallId, Engine};
use crate::{CommError, ErrorContext, Fingerprint};

/// A stall probe to send: ask mesh rank `to` which call it is in at `fp`'s
/// place in its group (a probe frame carrying `fp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    /// The mesh rank to ask.
    pub to: usize,
    /// The stalled call's fingerprint.
    pub fp: Fingerprint,
}

/// One call's clock.
#[derive(Debug)]
pub(super) struct Timer {
    deadline: Instant,
    timeout: Duration,
    /// How long the call may make no progress before it probes (`None`:
    /// only at its deadline).
    stall: Option<Duration>,
    last_progress: Instant,
    probed: bool,
    /// Group ranks the call's schedule waits on (probed first).
    waiting_on: Vec<usize>,
    expired: bool,
}

impl Timer {
    /// When this call's probes are due, if they still are.
    fn probe_at(&self, p2p: bool) -> Option<Instant> {
        if p2p || self.probed {
            return None;
        }
        let at = self
            .stall
            .and_then(|s| self.last_progress.checked_add(s))
            .map_or(self.deadline, |t| t.min(self.deadline));
        Some(at)
    }
}

impl<P> Engine<P> {
    /// Starts `call`'s clock at `now`: it fails with `Timeout` once
    /// `timeout` passes (clamped to [`crate::time::MAX_TIMEOUT`]), and it
    /// probes its group's other members after `stall` without progress
    /// (`None`: once, at its deadline, just before it times out).
    /// Point-to-point calls never probe.
    pub fn arm(&mut self, call: CallId, now: Instant, timeout: Duration, stall: Option<Duration>) {
        let Some(c) = self.calls.get_mut(&call) else {
            return;
        };
        let deadline = now
            .checked_add(timeout.min(crate::time::MAX_TIMEOUT))
            .or_else(|| now.checked_add(Duration::from_secs(86_400)))
            .unwrap_or(now);
        c.timer = Some(Timer {
            deadline,
            timeout,
            stall,
            last_progress: now,
            probed: false,
            waiting_on: Vec::new(),
            expired: false,
        });
    }

    /// `call` moved on at `now` and now waits on group ranks `waiting_on`:
    /// its stall clock restarts, and a later stall probes again.
    pub fn progressed(&mut self, call: CallId, now: Instant, waiting_on: &[usize]) {
        if let Some(t) = self.calls.get_mut(&call).and_then(|c| c.timer.as_mut()) {
            t.last_progress = now;
            t.probed = false;
            t.waiting_on.clear();
            t.waiting_on.extend_from_slice(waiting_on);
        }
    }

    /// `call`'s deadline, once armed: what a driver bounds the call's
    /// sends by.
    pub fn deadline(&self, call: CallId) -> Option<Instant> {
        self.calls.get(&call)?.timer.as_ref().map(|t| t.deadline)
    }

    /// When the driver must next call [`Engine::handle_timeout`]: the
    /// earliest deadline or stall probe of the calls in flight.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.calls
            .values()
            .filter_map(|c| {
                let t = c.timer.as_ref().filter(|t| !t.expired)?;
                Some(t.probe_at(c.p2p).map_or(t.deadline, |p| p.min(t.deadline)))
            })
            .min()
    }

    /// Moves every call's clock to `now`. Returns the stall probes to send
    /// (every other member of the stalled call's group, those it waits on
    /// first: mismatched ranks may each wait on the other down a chain) and
    /// whether a call passed its deadline (its waiter must be woken: it
    /// fails through [`Engine::failure`]).
    pub fn handle_timeout(&mut self, now: Instant) -> (Vec<Probe>, bool) {
        let mut probes = Vec::new();
        let mut expired = false;
        for c in self.calls.values_mut() {
            let Some(t) = c.timer.as_mut().filter(|t| !t.expired) else {
                continue;
            };
            if t.probe_at(c.p2p).is_some_and(|at| at <= now) {
                t.probed = true;
                if let Some(g) = self.groups.get(&c.group) {
                    let first = t.waiting_on.iter().copied();
                    let rest = (0..g.members.len()).filter(|p| !t.waiting_on.contains(p));
                    for gr in first.chain(rest).filter(|&gr| gr != g.me) {
                        if let Some(&to) = g.members.get(gr) {
                            probes.push(Probe { to, fp: c.fp });
                        }
                    }
                }
            }
            if now >= t.deadline {
                t.expired = true;
                expired = true;
            }
        }
        (probes, expired)
    }

    /// The driver's own clock says `call` is past its deadline (a send that
    /// the deadline cut short, or a wall clock a virtual one stands
    /// behind): the error it fails with, naming group ranks `waiting_on`
    /// unless an earlier cause explains the wait.
    pub fn timed_out(&mut self, call: CallId, waiting_on: &[usize]) -> CommError {
        if let Some(t) = self.calls.get_mut(&call).and_then(|c| c.timer.as_mut()) {
            t.expired = true;
        }
        self.failure(call, waiting_on)
            .unwrap_or_else(|| timeout_error(Duration::ZERO, waiting_on))
    }

    /// The `Timeout` of `call` if its deadline has passed.
    pub(super) fn expired(&self, call: CallId, waiting_on: &[usize]) -> Option<CommError> {
        let t = self.calls.get(&call)?.timer.as_ref()?;
        t.expired.then(|| timeout_error(t.timeout, waiting_on))
    }
}

/// The one place a call's `Timeout` is made.
fn timeout_error(after: Duration, waiting_on: &[usize]) -> CommError {
    CommError::Timeout {
        ctx: ErrorContext::default(),
        after,
        waiting_on: waiting_on.to_vec(),
    }
}
