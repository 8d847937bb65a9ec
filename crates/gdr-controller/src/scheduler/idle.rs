//! Idle parking of the pollers: while Gitea has nothing for us, one poller keeps polling
//! and the others wait without calling Gitea, so the idle load on Gitea is one FetchTask
//! per idle interval whatever the capacity. A wake ends every wait at once, the idle
//! poller's pause included: a task (more may be waiting, so a burst is fetched by all
//! pollers) and labels declared anew (a backend whose backlog drained is offered its jobs
//! again; without the wake its free slots would wait out the idle interval).
//!
//! A poller takes its [`Waker`] before it calls FetchTask, so a wake while the request is
//! in flight (sent with the old labels or version) ends the park that follows.
//!
//! The count of active (unparked) pollers never drops below one: a poller parks only
//! while another one stays active, and the last active poller is the idle poller. The
//! scheduler starts with one active poller; the others start parked.

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::watch;
use tokio::time::Instant;

use crate::shutdown::Shutdown;

/// Shared by the pollers of one scheduler.
#[derive(Debug)]
pub(crate) struct IdleControl {
    /// Pollers not parked.
    active: AtomicUsize,
    /// Bumped by [`IdleControl::wake_all`].
    wake: watch::Sender<u64>,
}

/// A poller's view of the wakes: it sees every wake from the moment it was taken.
#[derive(Debug)]
pub(crate) struct Waker(watch::Receiver<u64>);

/// What [`IdleControl::park`] or [`IdleControl::pause`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parked {
    /// This poller is the last active one: it keeps polling at the idle pace (after a
    /// pause: the pause ran out).
    IdlePoller,
    /// A wake came (or had come since the waker was taken): fetch now.
    Woken,
    /// Shutdown was requested meanwhile.
    Stopped,
}

impl IdleControl {
    /// One active poller; every other one starts parked, with a [`IdleControl::waker`].
    pub(crate) fn new() -> Self {
        IdleControl {
            active: AtomicUsize::new(1),
            wake: watch::Sender::new(0),
        }
    }

    /// A view of the wakes from now on. Taken before the pollers run for those that start
    /// parked (they do not count as active), and by each poller before its FetchTask.
    pub(crate) fn waker(&self) -> Waker {
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
    /// a wake seen by `waker` (or the shutdown) ends the wait, at once if one came after
    /// the waker was taken.
    pub(crate) async fn park(&self, waker: &mut Waker, shutdown: &Shutdown) -> Parked {
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
    pub(crate) async fn wait(&self, waker: &mut Waker, shutdown: &Shutdown) -> Parked {
        let outcome = tokio::select! {
            _ = waker.0.changed() => Parked::Woken,
            _ = shutdown.wait() => Parked::Stopped,
        };
        self.active.fetch_add(1, Ordering::AcqRel);
        outcome
    }

    /// The idle poller's pause until `until`: a wake seen by `waker` ends it early
    /// ([`Parked::Woken`]); [`Parked::IdlePoller`] once it ran out.
    pub(crate) async fn pause(
        &self,
        waker: &mut Waker,
        until: Instant,
        shutdown: &Shutdown,
    ) -> Parked {
        tokio::select! {
            _ = waker.0.changed() => Parked::Woken,
            _ = shutdown.wait() => Parked::Stopped,
            () = tokio::time::sleep_until(until) => Parked::IdlePoller,
        }
    }

    /// A task arrived, or Gitea has new labels: every parked poller fetches again, and the
    /// idle poller ends its pause.
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
                let mut waker = control.waker();
                let (control, shutdown) = (control.clone(), shutdown.clone());
                tokio::spawn(async move { control.wait(&mut waker, &shutdown).await })
            })
            .collect();
        assert_eq!(
            control.park(&mut control.waker(), &shutdown).await,
            Parked::IdlePoller
        );
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
                tokio::spawn(async move { control.park(&mut control.waker(), &shutdown).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(control.active(), 1);
        assert_eq!(again.iter().filter(|p| p.is_finished()).count(), 1);
        control.wake_all();
    }

    /// Issue 39: a wake (labels declared anew once a full backlog drained) ends the idle
    /// poller's pause at once instead of at the end of its interval, and a wake that came
    /// while a poller's FetchTask was in flight ends the park that follows it.
    #[tokio::test(start_paused = true)]
    async fn a_wake_ends_the_idle_pause_and_one_during_the_fetch_is_not_missed() {
        let control = Arc::new(IdleControl::new());
        let (_trigger, shutdown) = shutdown_channel();
        let hour = Duration::from_secs(3600);
        let mut waker = control.waker();
        let idle = tokio::spawn({
            let (control, shutdown) = (control.clone(), shutdown.clone());
            async move {
                let until = Instant::now() + hour;
                control.pause(&mut waker, until, &shutdown).await
            }
        });
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!idle.is_finished(), "the pause ended without a wake");
        control.wake_all();
        assert_eq!(idle.await.unwrap(), Parked::Woken);

        // A second active poller, so that the one below may park.
        let mut second = control.waker();
        let woken = tokio::spawn({
            let (control, shutdown) = (control.clone(), shutdown.clone());
            async move { control.wait(&mut second, &shutdown).await }
        });
        control.wake_all();
        assert_eq!(woken.await.unwrap(), Parked::Woken);
        assert_eq!(control.active(), 2);
        let mut before_fetch = control.waker();
        control.wake_all();
        let parked = tokio::time::timeout(hour, control.park(&mut before_fetch, &shutdown)).await;
        assert_eq!(
            parked,
            Ok(Parked::Woken),
            "a wake during the fetch was missed"
        );
    }

    /// A parked poller ends its wait at shutdown.
    #[tokio::test(start_paused = true)]
    async fn a_shutdown_ends_the_wait_of_a_parked_poller() {
        let control = Arc::new(IdleControl::new());
        let (trigger, shutdown) = shutdown_channel();
        let mut waker = control.waker();
        let parked = tokio::spawn({
            let (control, shutdown) = (control.clone(), shutdown.clone());
            async move { control.wait(&mut waker, &shutdown).await }
        });
        tokio::time::sleep(Duration::from_secs(60)).await;
        trigger.trigger();
        assert_eq!(parked.await.unwrap(), Parked::Stopped);
    }
}
