//! The cap on all-gathers in flight on a device (torch FSDP's
//! `limit_all_gathers`).
//!
//! On a device a gather returns once it is enqueued, and dropping its
//! [`super::Gathered`] frees the unit's buffer in stream order, after the
//! gather and the compute that used it. A host that runs ahead of the
//! device (a forward with little compute) would otherwise enqueue every
//! unit's gather before the first has finished, and every unit's whole
//! parameters would be allocated at once: the memory FSDP exists to save.
//!
//! Each unit's gather carries a [`Recorder`] into its calls' futures. When
//! the last of them is done with it (the calls are enqueued, or failed),
//! it records an event on the compute stream, which fires once the gather
//! has finished there. Before the next unit's gather is launched,
//! [`GatherLimit::room`] waits until fewer than [`IN_FLIGHT`] gathers are
//! unfinished, counting those not yet enqueued. On the host, gathers
//! finish before they return, and nothing is counted.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use consort_comm::{EventId, device::Placement};

/// How many unit gathers may be unfinished on the device at once: the one
/// in use and the prefetched one.
pub(super) const IN_FLIGHT: usize = 2;

/// The gathers not yet known finished on one device's compute stream.
struct Pending {
    place: Placement,
    /// Launched, their end not yet recorded.
    unrecorded: usize,
    /// Their ends, oldest first.
    events: VecDeque<EventId>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        for e in self.events.drain(..) {
            // SAFETY: recorded by a `Recorder` on this device, released once.
            let _ = unsafe { self.place.device.release(e) };
        }
    }
}

use consort_comm::lock;

/// The cap of one sharded model (`None` inside: host memory).
pub(super) struct GatherLimit(Option<Arc<Mutex<Pending>>>);

/// One unit's gather, until its calls are enqueued: dropped by the last of
/// them, it records the gather's end on the compute stream.
pub(super) struct Recorder(Option<Arc<Mutex<Pending>>>);

impl Drop for Recorder {
    fn drop(&mut self) {
        let Some(m) = self.0.take() else {
            return;
        };
        let mut p = lock(&m);
        p.unrecorded -= 1;
        // An event that cannot be recorded counts the gather finished: the
        // cap only bounds memory, and the call reports the device's error.
        if let Ok(e) = p.place.device.record(p.place.stream) {
            p.events.push_back(e);
        }
    }
}

impl GatherLimit {
    /// The cap on `place`'s compute stream (`None`: host memory).
    pub(super) fn new(place: Option<Placement>) -> Self {
        GatherLimit(place.map(|place| {
            Arc::new(Mutex::new(Pending {
                place,
                unrecorded: 0,
                events: VecDeque::new(),
            }))
        }))
    }

    /// A unit's gather is being launched: its recorder, to be moved into
    /// its calls (shared by them: `Arc`).
    pub(super) fn recorder(&self) -> Arc<Recorder> {
        if let Some(m) = &self.0 {
            lock(m).unrecorded += 1;
        }
        Arc::new(Recorder(self.0.clone()))
    }

    /// Waits, polling every 50 µs, until fewer than [`IN_FLIGHT`] gathers
    /// are unfinished, or `timeout` passes: then the gather is launched
    /// anyway. A device that never finishes one is a communicator that
    /// failed, whose own error the launch reports.
    pub(super) async fn room(&self, timeout: Duration) {
        let Some(m) = &self.0 else {
            return;
        };
        let start = Instant::now();
        loop {
            {
                let mut p = lock(m);
                while let Some(&oldest) = p.events.front() {
                    // SAFETY: recorded by a `Recorder` on this device, not
                    // released (only popped events are).
                    match unsafe { p.place.device.query(oldest) } {
                        Ok(false) => break,
                        // Finished, or unknowable: either way not waited on.
                        Ok(true) | Err(_) => {
                            p.events.pop_front();
                            // SAFETY: as above; released once, now popped.
                            let _ = unsafe { p.place.device.release(oldest) };
                        }
                    }
                }
                if p.unrecorded + p.events.len() < IN_FLIGHT {
                    return;
                }
            }
            if start.elapsed() >= timeout {
                return;
            }
            tokio::time::sleep(Duration::from_micros(50)).await;
        }
    }
}
