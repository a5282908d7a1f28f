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

/// The longest wait consort honours, about 100 years: a timeout past it is
/// clamped in code ([`deadline`]) and refused as text ([`parse_seconds`]),
/// so that no deadline can overflow `Instant`.
pub const MAX_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);

/// `Instant::now() + timeout`, with `timeout` clamped to [`MAX_TIMEOUT`]
/// (`Duration::MAX` means "wait for ever", in effect). Never panics.
pub fn deadline(timeout: std::time::Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout.min(MAX_TIMEOUT))
        .or_else(|| now.checked_add(std::time::Duration::from_secs(86_400)))
        .unwrap_or(now)
}

/// Seconds as a user writes them in a variable or a flag (`30`, `0.5`):
/// finite, not negative, zero only with `allow_zero`, and at most
/// [`MAX_TIMEOUT`]. The error says which rule failed, for a message that
/// names the variable or flag.
pub fn parse_seconds(text: &str, allow_zero: bool) -> Result<std::time::Duration, String> {
    let s: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    check_seconds(s, allow_zero)
}

/// [`parse_seconds`] for a number already parsed (a flag's `f64`).
pub fn check_seconds(s: f64, allow_zero: bool) -> Result<std::time::Duration, String> {
    let shown = if s.abs() >= 1e9 {
        format!("{s:e}")
    } else {
        s.to_string()
    };
    if !s.is_finite() || s < 0.0 || (s == 0.0 && !allow_zero) {
        let want = if allow_zero {
            "zero or more"
        } else {
            "more than zero"
        };
        return Err(format!("{shown} seconds: expected a finite number, {want}"));
    }
    if s > MAX_TIMEOUT.as_secs_f64() {
        return Err(format!(
            "{shown} seconds is more than {} (about 100 years), the longest wait consort takes",
            MAX_TIMEOUT.as_secs()
        ));
    }
    let d = std::time::Duration::from_secs_f64(s);
    if d.is_zero() && !allow_zero {
        return Err(format!(
            "{shown} seconds rounds to zero: expected at least 1 ns"
        ));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn deadlines_never_overflow() {
        let far = deadline(Duration::MAX);
        assert!(far > Instant::now() + Duration::from_secs(86_400 * 365 * 99));
        let _ = deadline(Duration::ZERO);
    }

    #[test]
    fn seconds_are_checked_not_panicked_on() {
        assert_eq!(
            parse_seconds(" 1.5 ", false),
            Ok(Duration::from_millis(1500))
        );
        assert_eq!(parse_seconds("0", true), Ok(Duration::ZERO));
        for bad in ["1e19", "1e20", "inf", "NaN", "-1", "x", "", "0"] {
            let e = parse_seconds(bad, false).unwrap_err();
            assert!(e.contains(bad) || e.contains("seconds"), "{bad}: {e}");
        }
        assert!(
            check_seconds(1e300, true)
                .unwrap_err()
                .starts_with("1e300 seconds")
        );
        assert!(
            parse_seconds("1e19", true)
                .unwrap_err()
                .contains("100 years")
        );
    }
}
