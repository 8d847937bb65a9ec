//! A backend's change signal: the Pod backend's watch moves it on every observed change of
//! an executor Pod, and the worker and the lifecycle reconciler wait on it next to their
//! timers, so a Pod that fails, is deleted or changes phase is looked at at once instead
//! of at the next timer. It carries no state (callers re-read the backend); a backend
//! without a watch has [`Wake::none`], which never fires.

use tokio::sync::watch;

/// Wakes its holder when the backend saw a change.
#[derive(Debug, Clone, Default)]
pub struct Wake(Option<watch::Receiver<u64>>);

impl Wake {
    /// A signal that never fires (backends without a watch).
    pub fn none() -> Self {
        Wake(None)
    }

    /// Whether a backend watch drives this signal.
    pub fn is_live(&self) -> bool {
        self.0.is_some()
    }

    /// A copy that fires only on changes after now.
    #[must_use]
    pub fn fresh(&self) -> Self {
        let mut copy = self.clone();
        if let Some(rx) = copy.0.as_mut() {
            rx.borrow_and_update();
        }
        copy
    }

    /// Resolves at the next change not seen yet; never when there is no watch (or its
    /// sender is gone).
    pub async fn changed(&mut self) {
        let alive = match self.0.as_mut() {
            Some(rx) => rx.changed().await.is_ok(),
            None => false,
        };
        if !alive {
            std::future::pending::<()>().await;
        }
    }
}

impl From<watch::Receiver<u64>> for Wake {
    fn from(rx: watch::Receiver<u64>) -> Self {
        Wake(Some(rx))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_fresh_copy_fires_only_on_changes_after_it_was_made() {
        let (tx, rx) = watch::channel(0u64);
        let wake = Wake::from(rx);
        tx.send_replace(1);
        let mut fresh = wake.fresh();
        let early = tokio::time::timeout(Duration::from_secs(1), fresh.changed()).await;
        assert!(early.is_err(), "fired for a change made before it");
        tx.send_replace(2);
        tokio::time::timeout(Duration::from_secs(1), fresh.changed())
            .await
            .expect("fires on a later change");
    }

    #[tokio::test(start_paused = true)]
    async fn no_watch_never_fires() {
        let mut none = Wake::none();
        assert!(
            tokio::time::timeout(Duration::from_secs(60), none.changed())
                .await
                .is_err()
        );
    }
}
