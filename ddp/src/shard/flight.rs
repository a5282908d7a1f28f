//! [`InFlight`]: one collective made now and finished later, so that a
//! prefetch or a gradient reduction overlaps the caller's compute.
//!
//! The call's future owns its buffers and its group handle. It is made
//! where it is launched ([`crate::launch`]: its place in the group's
//! sequence is fixed then, the same on every rank), and a task of its own
//! drives it to the end.

use std::{future::Future, pin::Pin};

use consort_comm::CommError;

use super::vals::Vals;

type Outcome = Result<Vals, CommError>;

/// A launched collective and where its result will come from.
#[derive(Debug)]
pub(crate) enum InFlight {
    /// It finished during its first poll.
    Done(Outcome),
    /// A task is driving it.
    Running(tokio::task::JoinHandle<Outcome>),
}

impl InFlight {
    /// Makes the call in `fut` now (its first poll, with a waker that does
    /// nothing: the task polls it again at once and registers its own), and
    /// leaves the rest to a task on the current tokio runtime.
    pub(crate) fn launch(fut: impl Future<Output = Outcome> + Send + 'static) -> Self {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return InFlight::Done(Err(CommError::invalid(
                "the sharded strategies run their collectives on tokio: call them from inside a \
                 tokio runtime",
            )));
        };
        let mut fut: Pin<Box<dyn Future<Output = Outcome> + Send>> = Box::pin(fut);
        match crate::launch::make_now(fut.as_mut()) {
            Some(out) => InFlight::Done(out),
            None => InFlight::Running(runtime.spawn(fut)),
        }
    }

    /// The error of a call that failed before it was made (its buffers
    /// could not be allocated), if it did.
    pub(crate) fn failed(&self) -> Option<&CommError> {
        match self {
            InFlight::Done(Err(e)) => Some(e),
            _ => None,
        }
    }

    /// Its result.
    pub(crate) async fn wait(self) -> Outcome {
        match self {
            InFlight::Done(out) => out,
            InFlight::Running(task) => task.await.unwrap_or_else(|e| {
                Err(CommError::protocol(
                    None,
                    format!("the task driving a sharded collective ended without a result: {e}"),
                ))
            }),
        }
    }
}
