//! The one `tasks_version` all pollers share (invariant 1).

use std::sync::atomic::{AtomicI64, Ordering};

/// The tasks version the next FetchTask sends.
///
/// Gitea skips the job pick when the latest version is sent and does not bump the
/// version when a job is claimed, so after any fetch that returned a task the next
/// fetch must send 0. An empty answer stores the answered version only if nobody
/// changed the shared value while the request was in flight: a poller whose request
/// skipped the pick must not overwrite another poller's reset.
#[derive(Debug, Default)]
pub struct TasksVersion(AtomicI64);

impl TasksVersion {
    /// Starts at 0, so the first fetch always picks.
    pub fn new() -> Self {
        TasksVersion(AtomicI64::new(0))
    }

    /// The version to send now.
    pub fn current(&self) -> i64 {
        self.0.load(Ordering::Acquire)
    }

    /// A fetch that sent `sent` returned a task: the next fetch sends 0.
    pub fn task_received(&self) {
        self.0.store(0, Ordering::Release);
    }

    /// A fetch that sent `sent` answered no task and version `answered`.
    pub fn empty_answer(&self, sent: i64, answered: i64) {
        // Fails (and keeps the newer value) if another poller reset it meanwhile.
        let _ = self
            .0
            .compare_exchange(sent, answered, Ordering::AcqRel, Ordering::Acquire);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shared_version_is_reset_after_a_task() {
        let v = TasksVersion::new();
        assert_eq!(v.current(), 0);
        v.empty_answer(0, 7);
        assert_eq!(v.current(), 7);
        v.task_received();
        assert_eq!(v.current(), 0, "a task resets the version to 0");
    }

    #[test]
    fn a_stale_empty_answer_does_not_undo_a_reset() {
        let v = TasksVersion::new();
        v.empty_answer(0, 7);
        // Poller A sends 7 (Gitea skips the pick); poller B gets a task meanwhile.
        let sent_by_a = v.current();
        v.task_received();
        v.empty_answer(sent_by_a, 7);
        assert_eq!(
            v.current(),
            0,
            "A's skipped pick must not hide waiting jobs"
        );
    }

    /// DESIGN invariant 1: pollers share one version; whatever order concurrent answers
    /// land in, the version never exceeds what Gitea answered and is 0 right after a task.
    #[tokio::test(start_paused = true)]
    async fn concurrent_pollers_never_send_a_version_beyond_what_gitea_answered() {
        use std::sync::Arc;
        let v = Arc::new(TasksVersion::new());
        let mut pollers = tokio::task::JoinSet::new();
        for i in 0..8i64 {
            let v = v.clone();
            pollers.spawn(async move {
                for round in 0..20i64 {
                    let sent = v.current();
                    tokio::time::sleep(std::time::Duration::from_millis(
                        (i * 7 + round) as u64 % 5,
                    ))
                    .await;
                    if round % 5 == 4 {
                        v.task_received();
                        assert_eq!(v.current(), 0);
                    } else {
                        v.empty_answer(sent, 100 + round);
                        assert!(v.current() <= 100 + 19);
                    }
                }
            });
        }
        while let Some(r) = pollers.join_next().await {
            r.unwrap();
        }
    }
}
