//! The one rule for a collective made in the background, shared by DDP's
//! bucket worker and the sharded strategies: the call's future is polled
//! once, at once, where it is launched. That first poll makes the call
//! (`Backend::submit`), which fixes its place in the group's sequence, so
//! every rank orders its background calls as it launched them, whatever
//! order they are driven in afterwards.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, Waker},
};

/// Polls `fut` once, with a waker that does nothing (whoever drives it
/// next polls it again and registers their own): its output if it already
/// finished.
pub(crate) fn make_now<F: Future + ?Sized>(fut: Pin<&mut F>) -> Option<F::Output> {
    match fut.poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => Some(out),
        Poll::Pending => None,
    }
}
