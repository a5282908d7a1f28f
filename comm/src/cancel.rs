//! Why a call is cancelled: a cause that travels with a dropped [`Work`].
//!
//! Dropping a call's [`Work`] before it ends cancels the call and aborts
//! its group (on backends that run calls as their works are polled; a
//! stream-ordered one has enqueued the call already, and it runs to its
//! end); the peers are told "a call was cancelled". When the caller
//! knows *why* it gave up (a fingerprint check found a mismatch, a side
//! channel lost a peer), the peers should hear that instead: a cancellation
//! that reaches a third rank before that rank's own verdict would
//! otherwise stick there as the first cause, and that rank would report
//! "cancelled" where its peers report the mismatch.
//!
//! [`drop_because`] drops a value (a [`Work`], or a future that holds one)
//! with a cause; the backends' cancellation guards read it with [`cause`]
//! and hand it to [`crate::engine::Engine::cancel`], which ends the call
//! with that error and tells the peers it.
//!
//! The cause is kept per thread for the length of the drop, since a drop is
//! synchronous: it is never seen by a drop on another thread or after.
//!
//! [`Work`]: crate::Work

use std::cell::RefCell;

use crate::CommError;

thread_local! {
    static CAUSE: RefCell<Option<CommError>> = const { RefCell::new(None) };
}

/// Drops `value` with `cause`: every call that `value` cancels as it drops
/// (a [`crate::Work`], or a future holding one) ends with `cause`, and its
/// peers are told `cause`, as if the call had failed with it.
pub fn drop_because<T>(value: T, cause: &CommError) {
    /// Clears the cause again, even if a drop panics.
    struct Reset(Option<CommError>);
    impl Drop for Reset {
        fn drop(&mut self) {
            let before = self.0.take();
            CAUSE.with(|c| *c.borrow_mut() = before);
        }
    }
    let before = CAUSE.with(|c| c.borrow_mut().replace(cause.clone()));
    let _reset = Reset(before);
    drop(value);
}

/// The cause of the drop under way on this thread ([`drop_because`]), if
/// any: what a backend's cancellation guard passes to the engine.
pub fn cause() -> Option<CommError> {
    CAUSE.with(|c| c.borrow().clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Probe(std::rc::Rc<RefCell<Option<Option<CommError>>>>);
    impl Drop for Probe {
        fn drop(&mut self) {
            *self.0.borrow_mut() = Some(cause());
        }
    }

    #[test]
    fn the_cause_is_seen_during_the_drop_only() {
        let seen = std::rc::Rc::new(RefCell::new(None));
        let e = CommError::invalid("because");
        drop_because(Probe(seen.clone()), &e);
        let got = seen.borrow_mut().take().flatten();
        assert_eq!(got.map(|e| e.to_string()), Some(e.to_string()));
        assert!(cause().is_none(), "the cause ends with the drop");
        drop(Probe(seen.clone()));
        assert!(
            seen.borrow().as_ref().is_some_and(Option::is_none),
            "a plain drop has no cause"
        );
    }

    #[test]
    fn nested_drops_restore_the_outer_cause() {
        struct Outer(Option<Probe>, CommError);
        impl Drop for Outer {
            fn drop(&mut self) {
                drop_because(self.0.take(), &CommError::invalid("inner"));
                assert_eq!(cause().map(|e| e.to_string()), Some(self.1.to_string()));
            }
        }
        let seen = std::rc::Rc::new(RefCell::new(None));
        let outer = CommError::invalid("outer");
        drop_because(Outer(Some(Probe(seen.clone())), outer.clone()), &outer);
        let got = seen.borrow_mut().take().flatten().map(|e| e.to_string());
        assert_eq!(got, Some(CommError::invalid("inner").to_string()));
    }
}
