//! Issue order for NCCL calls, host-buffer calls above all. A host call stages through shared
//! memory and enqueues only when its work is polled, so without this a rank
//! that polls two host calls in another order than it made them would
//! enqueue them in that order, and NCCL, which checks nothing, would pair
//! one rank's first call with another's second. Each call takes a ticket
//! when it is made; its work waits for that ticket's turn before it stages.
//! A device call whose turn has come when it is made is enqueued at once;
//! one made while an earlier host call is still waiting goes after it.
//! A ticket dropped before its turn is skipped; a turn ends when its ticket
//! drops.

use std::{
    collections::BTreeSet,
    sync::Mutex,
    time::{Duration, Instant},
};

use tokio::sync::Notify;

use crate::work::lock;

#[derive(Default)]
struct State {
    /// The next ticket to hand out.
    next: u64,
    /// The ticket whose turn it is.
    serving: u64,
    /// Tickets dropped before their turn.
    gone: BTreeSet<u64>,
}

/// The tickets of one backend's host calls.
#[derive(Default)]
pub(crate) struct Turns {
    state: Mutex<State>,
    notify: Notify,
}

/// One host call's place in its rank's order.
pub(crate) struct Ticket<'a> {
    turns: &'a Turns,
    n: u64,
}

impl Turns {
    /// A ticket for a call made now.
    pub(crate) fn take(&self) -> Ticket<'_> {
        let mut s = lock(&self.state);
        let n = s.next;
        s.next += 1;
        Ticket { turns: self, n }
    }
}

impl Ticket<'_> {
    /// Whether every call made before this one has run (or was dropped).
    pub(crate) fn is_turn(&self) -> bool {
        lock(&self.turns.state).serving == self.n
    }

    /// Waits until every host call made before this one has run (or was
    /// dropped), at most `timeout`; `Err` when the time ran out.
    pub(crate) async fn turn(&self, timeout: Duration) -> Result<(), Duration> {
        let deadline = consort_comm::time::deadline(timeout);
        loop {
            let notified = self.turns.notify.notified();
            if lock(&self.turns.state).serving == self.n {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, notified).await.is_err() {
                return Err(timeout);
            }
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut s = lock(&self.turns.state);
        if s.serving == self.n {
            s.serving += 1;
            loop {
                let next = s.serving;
                if !s.gone.remove(&next) {
                    break;
                }
                s.serving += 1;
            }
        } else if s.serving < self.n {
            s.gone.insert(self.n);
        }
        drop(s);
        self.turns.notify.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn turns_follow_the_order_tickets_were_taken() {
        let t = Turns::default();
        let (a, b, c) = (t.take(), t.take(), t.take());
        let short = Duration::from_millis(20);
        assert!(c.turn(short).await.is_err(), "a and b come first");
        assert!(a.turn(short).await.is_ok());
        // b is dropped before its turn (a call dropped unpolled): skipped.
        drop(b);
        assert!(c.turn(short).await.is_err(), "a still runs");
        drop(a);
        assert!(c.turn(short).await.is_ok());
        drop(c);
        let d = t.take();
        assert!(d.turn(short).await.is_ok());
    }

    #[tokio::test]
    async fn a_waiting_turn_wakes_when_the_one_before_ends() {
        let t = std::sync::Arc::new(Turns::default());
        let first = t.take();
        let t2 = t.clone();
        let waiter = tokio::spawn(async move {
            let second = t2.take();
            second.turn(Duration::from_secs(10)).await
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(first);
        assert!(waiter.await.unwrap().is_ok());
    }
}
