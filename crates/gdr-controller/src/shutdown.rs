//! The one stop signal of the controller: every component and server takes a [`Shutdown`]
//! and stops when it is triggered. `main` owns the trigger (signals), the runtime derives
//! the component-level ones (stop fetching first, then the rest).

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
