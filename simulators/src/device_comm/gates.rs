//! The emulated device's half of the stream-ordered driver
//! ([`consort_comm::stream::DeviceComm`]): a call's gate is its completion
//! event, what the communication thread found is the asynchronous error,
//! and an abort makes that thread skip the communicator's calls. Every
//! other rule (turns, the launch lock, tracking, the watchdog, the abort
//! sequence, the side channel's verdicts) is the driver NCCL runs.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicBool, Ordering},
};

use consort_comm::{CommError, EventId, Result, lock, stream::DeviceComm};

use super::outcome::{Reply, Slot, is_remote_error};
use crate::device::EmulatedDevice;

/// The driver of one emulated communicator.
pub(super) type Driver = consort_comm::stream::Driver<Gates>;

/// One emulated communicator's device state.
pub(super) struct Gates {
    pub(super) device: Arc<EmulatedDevice>,
    /// What the communication thread found (`ncclCommGetAsyncError`).
    async_error: Mutex<Option<CommError>>,
    /// Aborted: the communication thread skips the communicator's calls.
    aborted: AtomicBool,
}

impl Gates {
    pub(super) fn new(device: Arc<EmulatedDevice>) -> Self {
        Gates {
            device,
            async_error: Mutex::new(None),
            aborted: AtomicBool::new(false),
        }
    }

    /// Whether the communicator was aborted.
    pub(super) fn aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// The communicator's asynchronous error, if a call failed.
    pub(super) fn async_error(&self) -> Option<CommError> {
        lock(&self.async_error).clone()
    }

    /// A call failed on the communication thread: the first failure is the
    /// communicator's asynchronous error.
    pub(super) fn failed(&self, e: CommError) {
        lock(&self.async_error).get_or_insert(e);
    }
}

/// The driver's handle on one enqueued call.
pub(super) struct Tracked {
    pub(super) gate: EventId,
    pub(super) reply: Option<Reply>,
    pub(super) slot: Arc<Mutex<Slot>>,
}

impl DeviceComm for Gates {
    type Work = Tracked;
    type Probe = (EventId, Arc<Mutex<Slot>>);

    fn probe(&self, w: &Tracked) -> Self::Probe {
        (w.gate, w.slot.clone())
    }

    fn fired(&self, (gate, slot): &Self::Probe) -> Result<bool> {
        match &lock(slot).err {
            // A lost peer, as NCCL reports it: held until the side channel
            // names the rank (the driver's asynchronous error path).
            Some(e) if is_remote_error(e) => Ok(false),
            Some(e) => Err(e.clone()),
            None => Ok(self.device.event_done(*gate)),
        }
    }

    fn async_error(&self, w: &Tracked) -> Option<Result<()>> {
        Some(match lock(&w.slot).err.clone().filter(is_remote_error) {
            Some(e) => Err(e),
            None => Ok(()),
        })
    }

    fn abort(&self, _locked: bool) {
        self.aborted.store(true, Ordering::SeqCst);
    }

    fn finish(&self, w: Tracked, r: Result<()>) {
        self.device.release_event(w.gate);
        if let Some(reply) = w.reply {
            let out = r.map(|()| lock(&w.slot).out.take());
            let _ = reply.send(out);
        }
    }
}
