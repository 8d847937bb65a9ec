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

/// [`until`] for a condition read without awaiting (a watch value, a fake's store).
pub async fn until_sync<F>(deadline: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> bool,
{
    until(deadline, what, || std::future::ready(condition())).await;
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

    #[tokio::test(start_paused = true)]
    async fn a_synchronous_condition_is_polled_until_it_holds() {
        let mut n = 0;
        until_sync(Duration::from_secs(5), "n to reach 3", || {
            n += 1;
            n >= 3
        })
        .await;
        assert_eq!(n, 3);
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "timed out after 1s waiting for never")]
    async fn a_synchronous_condition_that_never_holds_fails_the_test() {
        until_sync(Duration::from_secs(1), "never", || false).await;
    }
}
