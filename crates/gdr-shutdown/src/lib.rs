//! The one stop signal of every component and server of gitea-dynamic-runner (the
//! controller, the executor, the Workload API servers, sandbox-identity): each takes a
//! [`Shutdown`] and stops when it is triggered. Whoever starts a component owns the
//! [`ShutdownTrigger`] (`main` the process's, from signals; the controller's runtime the
//! component-level ones: stop fetching first, then the rest).
//!
//! One type, not four: before it, the crates stopped on a raw `watch::Receiver<bool>`, an
//! `impl Future`, or a `oneshot` plus `abort()`, and a server could not be stopped by the
//! signal that stopped the rest.

use tokio::sync::watch;

/// Triggers a [`Shutdown`]; dropping it triggers nothing (only [`ShutdownTrigger::trigger`] does).
#[derive(Debug, Clone)]
pub struct ShutdownTrigger(watch::Sender<bool>);

/// A cloneable stop signal: once triggered it stays triggered.
#[derive(Debug, Clone)]
pub struct Shutdown(watch::Receiver<bool>);

/// A connected trigger and signal.
pub fn shutdown_channel() -> (ShutdownTrigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (ShutdownTrigger(tx), Shutdown(rx))
}

impl ShutdownTrigger {
    /// Signals every [`Shutdown`] clone.
    pub fn trigger(&self) {
        self.0.send_replace(true);
    }

    /// A signal connected to this trigger.
    pub fn signal(&self) -> Shutdown {
        Shutdown(self.0.subscribe())
    }

    /// This trigger, fired when the guard is dropped: for a server owned by a handle or a
    /// scope that must stop it on every way out, early returns and panics included.
    pub fn into_guard(self) -> ShutdownGuard {
        ShutdownGuard(self)
    }
}

/// Triggers its [`Shutdown`] when dropped (see [`ShutdownTrigger::into_guard`]).
#[derive(Debug)]
pub struct ShutdownGuard(ShutdownTrigger);

impl Drop for ShutdownGuard {
    fn drop(&mut self) {
        self.0.trigger();
    }
}

impl Shutdown {
    /// Whether stopping was requested.
    pub fn is_triggered(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once stopping is requested (or the trigger is gone without firing:
    /// then it never resolves).
    pub async fn wait(&self) {
        let mut rx = self.0.clone();
        if rx.wait_for(|stop| *stop).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// A signal that never triggers (a component run without a stop, e.g. in a test).
    pub fn never() -> Self {
        // A trigger that is gone without firing never fires (see `wait`).
        let (_, rx) = watch::channel(false);
        Shutdown(rx)
    }

    /// Sleeps for `d` unless stopping is requested first; true if the sleep completed.
    pub async fn sleep(&self, d: std::time::Duration) -> bool {
        tokio::select! {
            _ = tokio::time::sleep(d) => true,
            _ = self.wait() => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A trigger stops every clone of its signal, those made before it fired and after.
    #[tokio::test]
    async fn a_trigger_stops_every_clone_of_its_signal_and_stays_triggered() {
        let (trigger, early) = shutdown_channel();
        let waiting = tokio::spawn({
            let early = early.clone();
            async move { early.wait().await }
        });
        assert!(!early.is_triggered());
        trigger.trigger();
        waiting.await.unwrap();
        let late = trigger.signal();
        assert!(late.is_triggered() && early.is_triggered());
        late.wait().await;
        assert!(!late.sleep(Duration::from_secs(3600)).await);
    }

    /// A trigger dropped without firing is not a stop: a component whose owner went away
    /// without asking it to stop runs on (the owner's exit ends the process anyway).
    #[tokio::test(start_paused = true)]
    async fn a_trigger_dropped_without_firing_never_stops_its_signal() {
        let (trigger, signal) = shutdown_channel();
        drop(trigger);
        assert!(signal.sleep(Duration::from_secs(60)).await);
        assert!(!signal.is_triggered());
        assert!(Shutdown::never().sleep(Duration::from_secs(60)).await);
    }

    /// A guard stops its signal on every way out of its scope, an early return included.
    #[tokio::test]
    async fn a_dropped_guard_triggers_its_signal() {
        fn leave_early(guard: ShutdownGuard) -> Result<(), ()> {
            let _guard = guard;
            Err(())
        }
        let (trigger, signal) = shutdown_channel();
        assert!(leave_early(trigger.into_guard()).is_err());
        assert!(signal.is_triggered());
        signal.wait().await;
    }
}
