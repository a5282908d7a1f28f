//! The synchronisation the stream-ordered driver uses: std's, or loom's
//! when built with `--cfg loom`, so the loom model (`stream::model`) runs
//! the driver's own code, not a copy of it.

#[cfg(not(loom))]
pub(crate) use crate::lock;
#[cfg(loom)]
pub(crate) use loom::sync::{
    Condvar, Mutex, MutexGuard,
    atomic::{AtomicBool, Ordering},
};
pub(crate) use std::sync::TryLockError;
#[cfg(not(loom))]
pub(crate) use std::sync::{
    Condvar, Mutex, MutexGuard,
    atomic::{AtomicBool, Ordering},
};

/// [`crate::lock`] on loom's mutex.
#[cfg(loom)]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
