//! The cap on all-gathers in flight on a device (torch FSDP's
//! `limit_all_gathers`).
//!
//! On a device a gather returns once it is enqueued, and dropping its
//! [`super::Gathered`] frees the unit's buffer in stream order, after the
//! gather and the compute that used it. A host that runs ahead of the
//! device (a forward with little compute) would otherwise enqueue every
//! unit's gather before the first has finished, and every unit's whole
//! parameters would be allocated at once: the memory FSDP exists to
//! save. [`GatherLimit`] records an event after each gather on the compute
//! stream and, before the next is launched, waits until fewer than
//! [`IN_FLIGHT`] are unfinished. On the host, gathers finish before they
//! return and nothing is recorded.

use std::{collections::VecDeque, time::Duration};

use consort_comm::{CommError, ErrorContext, EventId, device::Placement};

/// How many unit gathers may be unfinished on the device at once: the one
/// in use and the prefetched one.
pub(super) const IN_FLIGHT: usize = 2;

/// The gathers enqueued on a device and not yet known finished.
pub(super) struct GatherLimit {
    place: Option<Placement>,
    pending: VecDeque<EventId>,
}

impl GatherLimit {
    /// The limit on `place`'s compute stream (`None`: host memory).
    pub(super) fn new(place: Option<Placement>) -> Self {
        GatherLimit {
            place,
            pending: VecDeque::new(),
        }
    }

    /// A unit's gathers were just enqueued: marks their end.
    pub(super) fn launched(&mut self) -> Result<(), CommError> {
        if let Some(p) = &self.place {
            self.pending.push_back(p.device.record(p.stream)?);
        }
        Ok(())
    }

    /// Waits, polling every 50 µs, until fewer than [`IN_FLIGHT`] gathers
    /// are unfinished; `Timeout` after `timeout` (the device is stuck, and
    /// the communicator's watchdog reports why).
    pub(super) async fn room(&mut self, timeout: Duration) -> Result<(), CommError> {
        let Some(p) = self.place.clone() else {
            return Ok(());
        };
        let start = std::time::Instant::now();
        while let Some(&oldest) = self.pending.front() {
            // SAFETY: recorded by `launched` on this device, not released.
            let done = unsafe { p.device.query(oldest) }?;
            if done {
                self.pending.pop_front();
                // SAFETY: as above; released once, after it was popped.
                unsafe { p.device.release(oldest) }?;
                continue;
            }
            if self.pending.len() < IN_FLIGHT {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                return Err(CommError::Timeout {
                    ctx: ErrorContext::default(),
                    after: timeout,
                    waiting_on: Vec::new(),
                });
            }
            tokio::time::sleep(Duration::from_micros(50)).await;
        }
        Ok(())
    }
}

impl Drop for GatherLimit {
    fn drop(&mut self) {
        if let Some(p) = &self.place {
            for e in self.pending.drain(..) {
                // SAFETY: recorded by `launched`, not released yet.
                let _ = unsafe { p.device.release(e) };
            }
        }
    }
}
