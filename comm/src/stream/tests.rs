//! The driver on a stand-in device: flags for completion events, a cell
//! for the asynchronous error, a counter of aborts.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst},
        mpsc,
    },
    time::{Duration, Instant},
};

use super::{DeviceComm, Driver, DriverOptions, watch::Pass};
use crate::{CommError, GroupId, OpKind, Result};

/// A stand-in device: each work is a flag the test sets; its outcome goes
/// to a channel.
#[derive(Default)]
struct Fake {
    async_error: Mutex<Option<CommError>>,
    aborts: AtomicUsize,
    finished: Mutex<Vec<(u32, Result<()>)>>,
}

struct FakeWork {
    n: u32,
    done: Arc<AtomicBool>,
    tx: Option<mpsc::Sender<Result<()>>>,
}

impl DeviceComm for Fake {
    type Work = FakeWork;
    type Probe = Arc<AtomicBool>;

    fn probe(&self, work: &FakeWork) -> Arc<AtomicBool> {
        work.done.clone()
    }

    fn fired(&self, probe: &Arc<AtomicBool>) -> Result<bool> {
        Ok(probe.load(SeqCst))
    }

    fn async_error(&self, _: &FakeWork) -> Option<Result<()>> {
        Some(match &*crate::lock(&self.async_error) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        })
    }

    fn abort(&self, _locked: bool) {
        self.aborts.fetch_add(1, SeqCst);
    }

    fn finish(&self, work: FakeWork, result: Result<()>) {
        if let Some(tx) = work.tx {
            let _ = tx.send(result.clone());
        }
        crate::lock(&self.finished).push((work.n, result));
    }
}

use crate::fingerprint::test_shape as fp;

fn driver() -> Arc<Driver<Fake>> {
    Arc::new(Driver::new(
        Fake::default(),
        (0, 2),
        GroupId::WORLD,
        DriverOptions::default(),
    ))
}

const SEC: Duration = Duration::from_secs(1);

/// Enqueues a call whose work completes when the returned flag is set.
fn enqueue(
    d: &Driver<Fake>,
    n: u32,
    timeout: Duration,
) -> (Arc<AtomicBool>, mpsc::Receiver<Result<()>>) {
    let call = d.make(fp(OpKind::AllReduce), timeout, None).unwrap();
    let pending = d.unlaunched(&call);
    d.wait_turn(&call).unwrap();
    let flag = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    let f = flag.clone();
    d.launch(&call, |_| {
        Ok(FakeWork {
            n,
            done: f,
            tx: Some(tx),
        })
    })
    .unwrap();
    pending.settled();
    (flag, rx)
}

/// Work completes in issue order as its events fire, and the watchdog's
/// pass says when to look again.
#[test]
fn work_completes_in_issue_order() {
    let d = driver();
    let (a, ra) = enqueue(&d, 1, SEC);
    let (b, rb) = enqueue(&d, 2, SEC);
    b.store(true, SeqCst);
    assert!(matches!(d.watch_once(), Pass::Again(_)));
    assert!(
        ra.try_recv().is_err() && rb.try_recv().is_err(),
        "b waits for a"
    );
    a.store(true, SeqCst);
    d.watch_once();
    assert!(ra.try_recv().unwrap().is_ok() && rb.try_recv().unwrap().is_ok());
    let order: Vec<u32> = crate::lock(&d.device().finished)
        .iter()
        .map(|f| f.0)
        .collect();
    assert_eq!(order, vec![1, 2]);
    assert!(matches!(d.synchronized(), Some(Ok(()))));
}

/// A call past its deadline fails with the engine's `Timeout`, every call
/// behind it fails as aborted by it, the device is aborted once, and the
/// failure sticks: the next call fails fast with it.
#[test]
fn a_passed_deadline_aborts_once_and_sticks() {
    let d = driver();
    let (_a, ra) = enqueue(&d, 1, Duration::from_millis(1));
    let (_b, rb) = enqueue(&d, 2, SEC);
    std::thread::sleep(Duration::from_millis(5));
    d.watch_once();
    match ra.try_recv().unwrap() {
        Err(CommError::Timeout { after, ctx, .. }) => {
            assert_eq!(after, Duration::from_millis(1));
            assert_eq!(ctx.seq, Some(0));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        rb.try_recv().unwrap(),
        Err(CommError::Aborted { .. })
    ));
    assert_eq!(d.device().aborts.load(SeqCst), 1);
    let e = d
        .make(fp(OpKind::AllReduce), SEC, None)
        .expect_err("the group failed");
    assert!(
        e.to_string().contains("timed out") || matches!(e, CommError::Aborted { .. }),
        "{e}"
    );
}

/// An asynchronous error fails the oldest call with it and aborts.
#[test]
fn an_asynchronous_error_fails_the_calls_in_flight() {
    let d = driver();
    let (_a, ra) = enqueue(&d, 1, SEC);
    *crate::lock(&d.device().async_error) = Some(CommError::invalid("device fault"));
    d.watch_once();
    let e = ra.try_recv().unwrap().unwrap_err();
    assert!(e.to_string().contains("device fault"), "{e}");
    assert_eq!(d.device().aborts.load(SeqCst), 1);
}

/// A failed enqueue fails its call, aborts the device, and refuses later
/// calls; the device's work never reaches the watchdog.
#[test]
fn a_failed_enqueue_fails_the_call_and_aborts() {
    let d = driver();
    let call = d.make(fp(OpKind::Broadcast), SEC, None).unwrap();
    let pending = d.unlaunched(&call);
    let e = d
        .launch(&call, |_| Err(CommError::invalid("no memory")))
        .expect_err("the enqueue failed");
    pending.settled();
    assert!(e.to_string().contains("no memory"), "{e}");
    assert_eq!(d.device().aborts.load(SeqCst), 1);
    assert!(d.make(fp(OpKind::Broadcast), SEC, None).is_err());
    assert_eq!(d.in_flight(), 0);
}

/// A call dropped between its make and its enqueue is cancelled: the
/// group fails and the device is aborted.
#[test]
fn a_call_dropped_before_its_enqueue_aborts() {
    let d = driver();
    let call = d.make(fp(OpKind::AllReduce), SEC, None).unwrap();
    drop(d.unlaunched(&call));
    assert!(d.poisoned().is_some());
    assert_eq!(d.device().aborts.load(SeqCst), 1);
}

/// A call made while one made before it (another thread's) is still
/// being enqueued waits for its turn, and goes once that one is on the
/// stream; a call whose turn never comes fails at its timeout naming the
/// call ahead.
#[test]
fn a_call_waits_for_its_turn_and_times_out_naming_the_call_ahead() {
    let d = driver();
    let a = d.make(fp(OpKind::Broadcast), SEC, None).unwrap();
    let b = d.make(fp(OpKind::AllReduce), 10 * SEC, None).unwrap();
    let d2 = d.clone();
    let waiter = std::thread::spawn(move || d2.wait_turn(&b));
    while !crate::lock(&d.track).core.turn_awaited() {
        std::thread::sleep(Duration::from_millis(1));
    }
    let flag = Arc::new(AtomicBool::new(true));
    let f = flag.clone();
    d.launch(&a, |_| {
        Ok(FakeWork {
            n: 1,
            done: f,
            tx: None,
        })
    })
    .unwrap();
    waiter.join().unwrap().expect("its turn came");
    assert!(!crate::lock(&d.track).core.turn_awaited());
    d.launch(&b, |_| {
        Ok(FakeWork {
            n: 2,
            done: flag.clone(),
            tx: None,
        })
    })
    .unwrap();

    let c = d.make(fp(OpKind::Barrier), SEC, None).unwrap();
    let late = d
        .make(fp(OpKind::Barrier), Duration::from_millis(30), None)
        .unwrap();
    let e = d
        .wait_turn(&late)
        .expect_err("the call ahead never reached the stream");
    assert!(e.to_string().contains("barrier call (seq 2)"), "{e}");
    let _ = c;
}

/// A mismatch verdict fails the calls in flight with `Mismatch`-as-given
/// and aborts; a second verdict changes nothing.
#[test]
fn a_verdict_fails_the_calls_and_aborts_once() {
    let d = driver();
    let (_a, ra) = enqueue(&d, 1, SEC);
    d.mismatch(CommError::invalid("mismatch stand-in"));
    assert!(
        ra.try_recv()
            .unwrap()
            .unwrap_err()
            .to_string()
            .contains("stand-in")
    );
    d.mismatch(CommError::invalid("second"));
    assert_eq!(d.device().aborts.load(SeqCst), 1);
}

/// A failure that finishes the call the watchdog is querying (without the
/// tracking lock) is handed to the device only once the query is over:
/// the device may free the handle being queried.
#[test]
fn a_call_being_queried_is_finished_after_the_query() {
    let d = driver();
    let (_a, ra) = enqueue(&d, 1, SEC);
    let id = d.oldest().unwrap();
    crate::lock(&d.track).querying = Some(id);
    d.poison(CommError::invalid("while queried"));
    assert!(ra.try_recv().is_err(), "held while queried");
    d.watch_once();
    assert!(ra.try_recv().unwrap().is_err());
}

/// Shutdown waits for the work in flight, then refuses later calls.
#[test]
fn drain_and_close_waits_for_the_work_then_refuses_calls() {
    let d = driver();
    let (a, _ra) = enqueue(&d, 1, SEC);
    let dog = d.spawn_watchdog("test-watchdog".into()).unwrap();
    let t0 = Instant::now();
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        a.store(true, SeqCst);
    });
    assert!(d.drain_and_close(10 * SEC, "shut down"));
    assert!(t0.elapsed() >= Duration::from_millis(15));
    setter.join().unwrap();
    let e = d.make(fp(OpKind::Barrier), SEC, None).unwrap_err();
    assert!(e.to_string().contains("shut down"), "{e}");
    d.stop(Some(dog));
}
