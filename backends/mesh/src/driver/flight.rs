//! Flight records of this process's mesh groups (TCP and QUIC): the time
//! stamps the engine's recorder gets, and `rank-K.json`
//! ([`consort_comm::flight::dump`]), written when a call of this rank
//! fails, when a peer's abort arrives (so that every rank of a failed job
//! leaves its record, as torch's `TORCH_NCCL_DUMP_ON_TIMEOUT` does), and on
//! request ([`consort_comm::flight::dump_flight_records`], on SIGUSR1). The
//! first failing rank writes before it tells its peers.

use std::sync::{Arc, Weak};

use consort_comm::flight::{Entry, FlightOut, FlightSource};

use super::{Inner, lock};

pub(super) use consort_comm::flight::now_us;

/// Where this backend's record goes, if anywhere.
pub(super) fn out(
    dir: Option<&std::path::Path>,
    rank: usize,
    world: usize,
) -> Option<Arc<FlightOut>> {
    dir.map(|d| Arc::new(FlightOut::new(d, rank, world)))
}

impl FlightSource for Inner {
    fn flight_entries(&self) -> Vec<Entry> {
        let mut engine = lock(&self.engine);
        engine.flight_mut().set_now_us(now_us());
        engine.flight().entries().collect()
    }
}

/// Registers `inner`'s record for dumps on request.
pub(super) fn register(inner: &Arc<Inner>) {
    if let Some(out) = &inner.flight {
        let weak: Weak<dyn FlightSource> = Arc::downgrade(inner) as Weak<dyn FlightSource>;
        consort_comm::flight::register(weak, out);
    }
}

/// Writes this rank's record ([`consort_comm::flight::dump`]).
pub(super) fn dump(inner: &Inner, reason: &str, force: bool) {
    if let Some(out) = &inner.flight {
        consort_comm::flight::dump(out, reason, force);
    }
}
