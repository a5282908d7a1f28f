//! Deadlines without an async runtime: [`before`] races a future against a
//! timer thread (`futures-timer`), so stores and drivers can bound every
//! wait whatever executor runs them. Schedules never use it: they take no
//! time at all.

use std::{pin::pin, task::Poll, time::Instant};

/// Runs `fut` until `deadline`; `None` if the deadline came first.
pub async fn before<F: Future>(deadline: Instant, fut: F) -> Option<F::Output> {
    let mut fut = pin!(fut);
    let mut delay = futures_timer::Delay::new(deadline.saturating_duration_since(Instant::now()));
    std::future::poll_fn(|cx| {
        if let Poll::Ready(v) = fut.as_mut().poll(cx) {
            return Poll::Ready(Some(v));
        }
        match std::pin::Pin::new(&mut delay).poll(cx) {
            Poll::Ready(()) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}
