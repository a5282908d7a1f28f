//! consort-sim: the simulator (to be built).
//!
//! It will own a deterministic, seeded world of N ranks in one process that
//! implements `Backend` by driving `consort_comm`'s schedules on a virtual
//! clock; the fault injector (crash, drop, delay, duplicate, corrupt,
//! partition, hold); and the cost-only mode that predicts time, algbw and
//! busbw on an alpha-beta model of a topology.
