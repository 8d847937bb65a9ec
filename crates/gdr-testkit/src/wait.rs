//! Waiting on observable state: tests poll with a deadline, never sleep a fixed time.

use std::future::Future;
use std::time::Duration;

/// How often [`eventually`] probes.
const POLL: Duration = Duration::from_millis(50);

/// Probes until `probe` yields `Some`, and returns it; panics naming `what` (the test
/// fails) when `deadline` passes first. The deadline bounds a hang, it is not a speed
/// assertion: pick it generously.
pub async fn eventually<T, F, Fut>(deadline: Duration, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let end = tokio::time::Instant::now() + deadline;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for a condition.
pub async fn until<F, Fut>(deadline: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually(deadline, what, || {
        let check = condition();
        async move { check.await.then_some(()) }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_turns_true_ends_the_wait_with_its_value() {
        let mut n = 0;
        let got = eventually(Duration::from_secs(5), "n to reach 3", || {
            n += 1;
            let v = n;
            async move { (v >= 3).then_some(v) }
        })
        .await;
        assert_eq!(got, 3);
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "timed out after 1s waiting for never")]
    async fn a_probe_that_never_turns_true_fails_the_test_naming_what_it_waited_for() {
        until(Duration::from_secs(1), "never", || async { false }).await;
    }
}
