//! Idle parking of the pollers: while Gitea has nothing for us, one poller keeps polling
//! and the others wait without calling Gitea, so the idle load on Gitea is one FetchTask
//! per idle interval whatever the capacity. A task wakes every parked poller at once, so
//! a burst is fetched by all of them.
//!
//! The count of active (unparked) pollers never drops below one: a poller parks only
//! while another one stays active, and the last active poller is the idle poller. The
//! scheduler starts with one active poller; the others start parked.

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::watch;

use crate::shutdown::Shutdown;

/// Shared by the pollers of one scheduler.
#[derive(Debug)]
pub(crate) struct IdleControl {
    /// Pollers not parked.
    active: AtomicUsize,
    /// Bumped by [`IdleControl::wake_all`].
    wake: watch::Sender<u64>,
}

/// The place of a parked poller: it sees every wake from the moment it was taken.
#[derive(Debug)]
pub(crate) struct Waker(watch::Receiver<u64>);

/// What [`IdleControl::park`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parked {
    /// This poller is the last active one: it keeps polling at the idle pace.
    IdlePoller,
    /// It parked and was woken: a task arrived, fetch now.
    Woken,
    /// It parked and shutdown was requested meanwhile.
    Stopped,
}

impl IdleControl {
    /// One active poller; every other one starts with [`IdleControl::parked`].
    pub(crate) fn new() -> Self {
        IdleControl {
            active: AtomicUsize::new(1),
            wake: watch::Sender::new(0),
        }
    }

    /// A place for a poller that starts parked (it does not count as active). Taken before
    /// the pollers run, so no wake is missed.
    pub(crate) fn parked(&self) -> Waker {
        let mut rx = self.wake.subscribe();
        rx.mark_unchanged();
        Waker(rx)
    }

    /// Pollers not parked right now.
    #[cfg(test)]
    pub(crate) fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    /// Parks the caller unless it is the last active poller; a parked caller returns once
    /// [`IdleControl::wake_all`] (or the shutdown) ends the wait.
    pub(crate) async fn park(&self, shutdown: &Shutdown) -> Parked {
        // Subscribed before leaving the active set, so a wake between the two counts.
        let waker = self.parked();
        let left = self
            .active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n > 1).then(|| n - 1)
            })
            .is_ok();
        if !left {
            return Parked::IdlePoller;
        }
        self.wait(waker, shutdown).await
    }

    /// Waits parked until the next wake (or the shutdown), then counts as active again.
    pub(crate) async fn wait(&self, mut waker: Waker, shutdown: &Shutdown) -> Parked {
        let outcome = tokio::select! {
            _ = waker.0.changed() => Parked::Woken,
            _ = shutdown.wait() => Parked::Stopped,
        };
        self.active.fetch_add(1, Ordering::AcqRel);
        outcome
    }

    /// A task arrived: every parked poller fetches again.
    pub(crate) fn wake_all(&self) {
        self.wake.send_modify(|v| *v = v.wrapping_add(1));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::shutdown::shutdown_channel;

    /// One poller always stays active: with three pollers of which two start parked, the
    /// active one that finds nothing is told to keep polling; a wake brings the others
    /// back, and when they find nothing either, all but one park again.
    #[tokio::test(start_paused = true)]
    async fn all_but_one_idle_poller_park_and_a_wake_brings_them_back() {
        let control = Arc::new(IdleControl::new());
        let (_trigger, shutdown) = shutdown_channel();
        let parked: Vec<_> = (0..2)
            .map(|_| {
                let waker = control.parked();
                let (control, shutdown) = (control.clone(), shutdown.clone());
                tokio::spawn(async move { control.wait(waker, &shutdown).await })
            })
            .collect();
        assert_eq!(control.park(&shutdown).await, Parked::IdlePoller);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(control.active(), 1, "the idle poller never parks");
        assert!(parked.iter().all(|p| !p.is_finished()));

        control.wake_all();
        for p in parked {
            assert_eq!(p.await.unwrap(), Parked::Woken);
        }
        assert_eq!(control.active(), 3);
        let again: Vec<_> = (0..3)
            .map(|_| {
                let (control, shutdown) = (control.clone(), shutdown.clone());
                tokio::spawn(async move { control.park(&shutdown).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(control.active(), 1);
        assert_eq!(again.iter().filter(|p| p.is_finished()).count(), 1);
        control.wake_all();
    }

    /// A parked poller ends its wait at shutdown.
    #[tokio::test(start_paused = true)]
    async fn a_shutdown_ends_the_wait_of_a_parked_poller() {
        let control = Arc::new(IdleControl::new());
        let (trigger, shutdown) = shutdown_channel();
        let waker = control.parked();
        let parked = tokio::spawn({
            let (control, shutdown) = (control.clone(), shutdown.clone());
            async move { control.wait(waker, &shutdown).await }
        });
        tokio::time::sleep(Duration::from_secs(60)).await;
        trigger.trigger();
        assert_eq!(parked.await.unwrap(), Parked::Stopped);
    }
}
