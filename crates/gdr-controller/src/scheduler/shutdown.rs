//! The stop signal shared by the pollers and the heartbeater.

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

    /// Sleeps for `d` unless stopping is requested first; true if the sleep completed.
    pub async fn sleep(&self, d: std::time::Duration) -> bool {
        tokio::select! {
            _ = tokio::time::sleep(d) => true,
            _ = self.wait() => false,
        }
    }
}
