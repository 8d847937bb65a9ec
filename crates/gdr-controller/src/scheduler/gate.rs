//! The backlog gate (invariant 5b): no fetch while the stream holds `limit` unclaimed
//! assignments.
//!
//! One watcher task refreshes the stream's message count; pollers consult the cached
//! value. Between refreshes the gate counts its own admissions, so N pollers passing at
//! once cannot overshoot the limit: a poller reserves a slot before fetching and turns it
//! into a counted message when its publish is stored (or gives it back when the fetch
//! returned nothing). While the count is unknown (NATS unreachable) the gate stays shut.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::watch;

use crate::shutdown::Shutdown;

#[derive(Debug, Default)]
struct GateState {
    /// Messages in the stream as last read, plus our publishes since; `None`: unknown.
    in_stream: Option<u64>,
    /// Pollers between admission and a stored publish (or an empty answer).
    reserved: u64,
}

/// Shared admission control for the pollers.
#[derive(Debug)]
pub(crate) struct BacklogGate {
    limit: u64,
    state: Mutex<GateState>,
    /// Stored (non-duplicate) publishes so far; lets a refresh add the publishes its
    /// stream-info answer may not include.
    publishes: AtomicU64,
    changed: watch::Sender<u64>,
}

/// A reservation taken by [`BacklogGate::admit`]; give it back with one of its methods.
#[derive(Debug)]
#[must_use]
pub(crate) struct Slot;

impl BacklogGate {
    pub(crate) fn new(limit: u64) -> Self {
        BacklogGate {
            limit: limit.max(1),
            state: Mutex::new(GateState::default()),
            publishes: AtomicU64::new(0),
            changed: watch::Sender::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// The publish counter to read before asking the stream for its count.
    pub(crate) fn epoch(&self) -> u64 {
        self.publishes.load(Ordering::Acquire)
    }

    /// A fresh count read after `epoch()` returned `epoch`. Publishes stored since may be
    /// counted twice until the next refresh, which errs on the side of fetching less.
    pub(crate) fn refreshed(&self, messages: u64, epoch: u64) {
        let since = self.epoch().saturating_sub(epoch);
        self.lock().in_stream = Some(messages.saturating_add(since));
        self.notify();
    }

    /// The stream could not be read: shut the gate until it can.
    pub(crate) fn unknown(&self) {
        self.lock().in_stream = None;
        self.notify();
    }

    /// The cached number of unclaimed assignments.
    #[cfg(test)]
    fn in_stream(&self) -> Option<u64> {
        self.lock().in_stream
    }

    fn try_admit(&self) -> Option<Slot> {
        let mut s = self.lock();
        let count = s.in_stream?;
        if count.saturating_add(s.reserved) < self.limit {
            s.reserved += 1;
            Some(Slot)
        } else {
            None
        }
    }

    /// Waits for room below the limit; `None` once shutdown is requested. `waiting`
    /// is raised while this caller is held back.
    pub(crate) async fn admit(&self, shutdown: &Shutdown, waiting: &AtomicU64) -> Option<Slot> {
        let mut rx = self.changed.subscribe();
        let mut counted = false;
        let slot = loop {
            if shutdown.is_triggered() {
                break None;
            }
            rx.mark_unchanged();
            if let Some(slot) = self.try_admit() {
                break Some(slot);
            }
            if !counted {
                counted = true;
                waiting.fetch_add(1, Ordering::AcqRel);
            }
            tokio::select! {
                _ = rx.changed() => {}
                _ = shutdown.wait() => break None,
            }
        };
        if counted {
            waiting.fetch_sub(1, Ordering::AcqRel);
        }
        slot
    }

    /// The fetch returned no task (or the task never reached the stream).
    pub(crate) fn release(&self, _slot: Slot) {
        let mut s = self.lock();
        s.reserved = s.reserved.saturating_sub(1);
        drop(s);
        self.notify();
    }

    /// The assignment is stored; a duplicate was counted already.
    pub(crate) fn stored(&self, _slot: Slot, duplicate: bool) {
        let mut s = self.lock();
        s.reserved = s.reserved.saturating_sub(1);
        if !duplicate {
            self.publishes.fetch_add(1, Ordering::AcqRel);
            if let Some(n) = s.in_stream.as_mut() {
                *n += 1;
            }
        }
        drop(s);
        self.notify();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn admissions_and_stored_publishes_count_against_the_limit() {
        let gate = BacklogGate::new(2);
        assert!(
            gate.try_admit().is_none(),
            "shut while the count is unknown"
        );
        gate.refreshed(0, gate.epoch());
        let a = gate.try_admit().expect("first");
        let b = gate.try_admit().expect("second");
        assert!(gate.try_admit().is_none(), "two reserved reach the limit");
        gate.stored(a, false);
        assert!(gate.try_admit().is_none(), "one stored + one reserved");
        gate.release(b);
        let c = gate.try_admit().expect("room again");
        gate.release(c);
        let epoch = gate.epoch();
        gate.refreshed(0, epoch);
        assert_eq!(gate.in_stream(), Some(0));
    }

    /// DESIGN invariant 5b: a poller held at the limit is let through the moment a
    /// stored assignment leaves the stream (a refresh shows room), and a shutdown ends
    /// the wait without a slot.
    #[tokio::test(start_paused = true)]
    async fn a_poller_held_at_the_limit_waits_for_room_and_a_shutdown_ends_the_wait() {
        use std::sync::Arc;
        let gate = Arc::new(BacklogGate::new(1));
        gate.refreshed(1, gate.epoch());
        let waiting = Arc::new(AtomicU64::new(0));
        let (_trigger, shutdown) = crate::shutdown::shutdown_channel();
        let held = tokio::spawn({
            let (gate, waiting, shutdown) = (gate.clone(), waiting.clone(), shutdown.clone());
            async move { gate.admit(&shutdown, &waiting).await.is_some() }
        });
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
        assert!(!held.is_finished(), "admitted beyond the limit");
        assert_eq!(waiting.load(Ordering::Acquire), 1);
        gate.refreshed(0, gate.epoch());
        assert!(held.await.unwrap(), "room did not let the poller through");
        assert_eq!(waiting.load(Ordering::Acquire), 0);

        let (trigger, shutdown) = crate::shutdown::shutdown_channel();
        let stopped = tokio::spawn({
            let (gate, waiting) = (gate.clone(), waiting.clone());
            async move { gate.admit(&shutdown, &waiting).await.is_none() }
        });
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
        trigger.trigger();
        assert!(
            stopped.await.unwrap(),
            "a shutdown must end the wait without a slot"
        );
    }
}
