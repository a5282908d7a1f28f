//! A loom model of the driver's turn, launch, abort and watchdog
//! interleavings, run on the driver's own code (its locks and condvars are
//! loom's under `--cfg loom`: see `stream::sync`). Run it with
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test -p consort-comm --release --lib stream::model
//! ```
//!
//! loom's timed waits are plain waits, so a wake-up the driver forgets to
//! give (a call waiting for its turn, shutdown waiting for the work) shows
//! as a deadlock here, where the real driver's backstop timeouts would
//! hide it.

use std::{sync::Arc, time::Duration};

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};

use super::{DeviceComm, Driver, DriverOptions};
use crate::{CommError, GroupId, OpKind, Result, Shape};

/// A stand-in device that checks the driver's promises to devices: a
/// work is finished once, never while it is being queried, and the device
/// is aborted at most once.
#[derive(Default)]
struct Model {
    aborts: AtomicUsize,
}

#[derive(Clone)]
struct Flags {
    done: Arc<AtomicBool>,
    in_query: Arc<AtomicBool>,
    finished: Arc<AtomicUsize>,
}

impl Flags {
    fn new(done: bool) -> Self {
        Flags {
            done: Arc::new(AtomicBool::new(done)),
            in_query: Arc::new(AtomicBool::new(false)),
            finished: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl DeviceComm for Model {
    type Work = Flags;
    type Probe = Flags;

    fn probe(&self, w: &Flags) -> Flags {
        w.clone()
    }

    fn fired(&self, p: &Flags) -> Result<bool> {
        p.in_query.store(true, SeqCst);
        let done = p.done.load(SeqCst);
        p.in_query.store(false, SeqCst);
        Ok(done)
    }

    fn async_error(&self, _: &Flags) -> Option<Result<()>> {
        Some(Ok(()))
    }

    fn abort(&self, _locked: bool) {
        assert_eq!(self.aborts.fetch_add(1, SeqCst), 0, "aborted twice");
    }

    fn finish(&self, w: Flags, _: Result<()>) {
        assert!(!w.in_query.load(SeqCst), "finished while being queried");
        assert_eq!(w.finished.fetch_add(1, SeqCst), 0, "finished twice");
    }
}

fn fp() -> Shape {
    crate::fingerprint::test_shape(OpKind::AllReduce)
}

fn driver() -> Arc<Driver<Model>> {
    Arc::new(Driver::new(
        Model::default(),
        (0, 2),
        GroupId::WORLD,
        DriverOptions::default(),
    ))
}

const LONG: Duration = Duration::from_secs(3600);

/// Makes and launches `call`'s work (`done` already or not); returns its
/// flags when it reached the stream.
fn launch(d: &Driver<Model>, call: &super::Call, done: bool) -> Option<Flags> {
    let pending = d.unlaunched(call);
    if let Err(e) = d.wait_turn(call) {
        let _ = pending.failed(e);
        return None;
    }
    let f = Flags::new(done);
    let w = f.clone();
    let r = d.launch(call, move |_| Ok(w));
    pending.settled();
    r.ok().map(|()| f)
}

fn builder() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b
}

/// Two threads' calls reach the stream in the order they were made,
/// whichever thread runs first: the second waits for its turn and is
/// always woken.
#[test]
fn turns_keep_the_order_calls_were_made_in() {
    builder().check(|| {
        let d = driver();
        let a = d.make(fp(), LONG, None).unwrap();
        let b = d.make(fp(), LONG, None).unwrap();
        let d2 = d.clone();
        let t = loom::thread::spawn(move || launch(&d2, &b, true).is_some());
        assert!(launch(&d, &a, true).is_some());
        assert!(t.join().unwrap(), "b reached the stream");
        assert_eq!(d.in_flight(), 2);
        d.watch_once();
        assert_eq!(d.in_flight(), 0);
    });
}

/// A mismatch verdict racing with a launch and a call waiting for its
/// turn: every call ends once (refused, or failed in flight), the waiter is
/// woken, the device is aborted once, and nothing is left in flight.
#[test]
fn an_abort_racing_launches_ends_every_call_once() {
    builder().check(|| {
        let d = driver();
        let a = d.make(fp(), LONG, None).unwrap();
        let b = d.make(fp(), LONG, None).unwrap();
        let d2 = d.clone();
        let t = loom::thread::spawn(move || launch(&d2, &b, false));
        let d3 = d.clone();
        let v = loom::thread::spawn(move || d3.mismatch(CommError::invalid("verdict")));
        let fa = launch(&d, &a, false);
        let fb = t.join().unwrap();
        v.join().unwrap();
        d.watch_once();
        assert_eq!(d.in_flight(), 0);
        for f in fa.iter().chain(fb.iter()) {
            assert_eq!(f.finished.load(SeqCst), 1, "a launched call ended once");
        }
        assert_eq!(d.device().aborts.load(SeqCst), 1);
        assert!(d.poisoned().is_some());
    });
}

/// A failure that ends the call the watchdog is querying, without its
/// lock: the device finishes it once, after the query.
#[test]
fn the_watchdog_and_a_failure_finish_a_call_once() {
    builder().check(|| {
        let d = driver();
        let a = d.make(fp(), LONG, None).unwrap();
        let f = launch(&d, &a, false).unwrap();
        let d2 = d.clone();
        let t = loom::thread::spawn(move || d2.poison(CommError::invalid("failed")));
        d.watch_once();
        t.join().unwrap();
        d.watch_once();
        assert_eq!(f.finished.load(SeqCst), 1);
    });
}

/// Shutdown waits for the work in flight and is woken by the watchdog's
/// progress; later calls are refused.
#[test]
fn shutdown_is_woken_by_the_watchdog() {
    builder().check(|| {
        let d = driver();
        let a = d.make(fp(), LONG, None).unwrap();
        let f = launch(&d, &a, false).unwrap();
        let d2 = d.clone();
        let t = loom::thread::spawn(move || {
            f.done.store(true, SeqCst);
            d2.watch_once();
        });
        assert!(d.drain_and_close(LONG, "shut down"));
        t.join().unwrap();
        assert!(d.make(fp(), LONG, None).is_err());
    });
}
