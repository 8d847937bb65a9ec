//! The backlog gate (invariants 5b and 22): each backend may have at most its limit of
//! unclaimed assignments in the stream, counted on its own subject, and a full or dead
//! backend never stops fetching for the other.
//!
//! FetchTask cannot ask for one backend's jobs, but Gitea offers a runner only jobs whose
//! `runs-on` its declared labels cover. So a backend whose backlog is full is *closed*: the
//! controller re-declares its labels without it (the scheduler's declarer does, whenever
//! the set of open backends changes) and pollers fetch only while the labels Gitea has are
//! exactly those of the open backends. A fetch already in flight when a backend closes
//! may still bring one of its jobs; its reservation was counted against every open
//! backend's room, so that job still fits. The other way round, a backend reopens (its
//! labels are declared again) only once the fetches in flight fit its room: Gitea answers
//! a held fetch with the labels it has when it answers.
//!
//! One watcher task refreshes the per-subject message counts; pollers consult the cached
//! values. Between refreshes the gate counts its own admissions, so N pollers passing at
//! once cannot overshoot: a poller reserves a slot before fetching (at most as many as the
//! smallest room of an open backend) and turns it into a counted message when its publish
//! is stored (or gives it back when the fetch returned nothing). While the counts are
//! unknown (NATS unreachable) the gate stays shut.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use gdr_core::backend::Backend;
use tokio::sync::watch;

use crate::shutdown::Shutdown;

/// Stored publishes per backend, as counted when a refresh started.
pub(crate) type Epoch = BTreeMap<Backend, u64>;

#[derive(Debug, Default)]
struct GateState {
    /// Messages per backend subject as last read, plus our publishes since; `None`:
    /// unknown.
    in_stream: Option<BTreeMap<Backend, u64>>,
    /// Reservations between admission and a stored publish (or a failed task or an empty
    /// answer): several per poller while its publishes await their acks.
    reserved: u64,
    /// The backends whose labels Gitea has now (`None` before the first Declare).
    declared: Option<BTreeSet<Backend>>,
    /// Stored (non-duplicate) publishes so far, per backend; lets a refresh add the
    /// publishes its stream-info answer may not include.
    publishes: BTreeMap<Backend, u64>,
}

/// Shared admission control for the pollers.
#[derive(Debug)]
pub(crate) struct BacklogGate {
    /// The limit of each enabled backend (≥ 1).
    limits: BTreeMap<Backend, u64>,
    state: Mutex<GateState>,
    changed: watch::Sender<u64>,
}

/// A reservation taken by [`BacklogGate::admit`]; give it back with one of its methods.
#[derive(Debug)]
#[must_use]
pub(crate) struct Slot;

impl BacklogGate {
    pub(crate) fn new(limits: BTreeMap<Backend, u64>) -> Self {
        BacklogGate {
            limits: limits.into_iter().map(|(b, l)| (b, l.max(1))).collect(),
            state: Mutex::new(GateState::default()),
            changed: watch::Sender::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Wakes on every change of counts, reservations or declared labels.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The publish counters to read before asking the stream for its counts.
    pub(crate) fn epoch(&self) -> Epoch {
        self.lock().publishes.clone()
    }

    /// Fresh per-subject counts read after `epoch()` returned `epoch`. Publishes stored
    /// since may be counted twice until the next refresh, which errs on the side of
    /// fetching less. Backends absent from `messages` have none.
    pub(crate) fn refreshed(&self, messages: &BTreeMap<Backend, u64>, epoch: &Epoch) {
        let mut s = self.lock();
        let counts = self
            .limits
            .keys()
            .map(|b| {
                let since = s
                    .publishes
                    .get(b)
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(epoch.get(b).copied().unwrap_or(0));
                let read = messages.get(b).copied().unwrap_or(0);
                (*b, read.saturating_add(since))
            })
            .collect();
        s.in_stream = Some(counts);
        drop(s);
        self.notify();
    }

    /// The stream could not be read: shut the gate until it can.
    pub(crate) fn unknown(&self) {
        self.lock().in_stream = None;
        self.notify();
    }

    /// The backends with room in their backlog; `None` while the counts are unknown.
    fn open(&self, s: &GateState) -> Option<BTreeSet<Backend>> {
        let counts = s.in_stream.as_ref()?;
        Some(
            self.limits
                .iter()
                .filter(|(b, limit)| counts.get(b).copied().unwrap_or(0) < **limit)
                .map(|(b, _)| *b)
                .collect(),
        )
    }

    /// The backends whose labels Gitea should have now: the open ones, when that set is
    /// known, not empty and not what Gitea has already. Gitea answers a fetch in flight
    /// with the labels it has when it answers, so a fetch admitted while a backend was
    /// closed may bring that backend's job once its labels are back: labels widen only
    /// when every fetch in flight fits the room of each backend they would offer.
    pub(crate) fn wanted(&self) -> Option<BTreeSet<Backend>> {
        let s = self.lock();
        let open = self.open(&s)?;
        if open.is_empty() || s.declared.as_ref() == Some(&open) {
            return None;
        }
        let widens = s.declared.as_ref().is_some_and(|d| !open.is_subset(d));
        if widens && s.reserved > self.room(&s, &open)? {
            return None;
        }
        Some(open)
    }

    /// The fewest free places among `open` backends: what any fetch may fill.
    fn room(&self, s: &GateState, open: &BTreeSet<Backend>) -> Option<u64> {
        let counts = s.in_stream.as_ref()?;
        open.iter()
            .map(|b| {
                let limit = self.limits.get(b).copied().unwrap_or(0);
                limit.saturating_sub(counts.get(b).copied().unwrap_or(0))
            })
            .min()
    }

    /// Gitea now has the labels of `backends`.
    pub(crate) fn declared(&self, backends: BTreeSet<Backend>) {
        self.lock().declared = Some(backends);
        self.notify();
    }

    /// The cached number of unclaimed assignments of `backend`.
    #[cfg(test)]
    fn in_stream(&self, backend: Backend) -> Option<u64> {
        self.lock()
            .in_stream
            .as_ref()
            .map(|c| c.get(&backend).copied().unwrap_or(0))
    }

    fn try_admit(&self) -> Option<Slot> {
        let mut s = self.lock();
        let open = self.open(&s)?;
        if open.is_empty() || s.declared.as_ref() != Some(&open) {
            return None;
        }
        // Every fetch in flight may bring a job of any open backend.
        let room = self.room(&s, &open)?;
        if s.reserved < room {
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

    /// The assignment of `backend` is stored; a duplicate was counted already.
    pub(crate) fn stored(&self, _slot: Slot, backend: Backend, duplicate: bool) {
        let mut s = self.lock();
        s.reserved = s.reserved.saturating_sub(1);
        if !duplicate {
            *s.publishes.entry(backend).or_default() += 1;
            if let Some(n) = s.in_stream.as_mut().and_then(|c| c.get_mut(&backend)) {
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

    fn both(pod: u64, vm: u64) -> BTreeMap<Backend, u64> {
        BTreeMap::from([(Backend::Pod, pod), (Backend::Vm, vm)])
    }

    fn set(backends: &[Backend]) -> BTreeSet<Backend> {
        backends.iter().copied().collect()
    }

    #[tokio::test]
    async fn admissions_and_stored_publishes_count_against_the_limit() {
        let gate = BacklogGate::new(BTreeMap::from([(Backend::Pod, 2)]));
        gate.declared(set(&[Backend::Pod]));
        assert!(
            gate.try_admit().is_none(),
            "shut while the count is unknown"
        );
        gate.refreshed(&BTreeMap::new(), &gate.epoch());
        let a = gate.try_admit().expect("first");
        let b = gate.try_admit().expect("second");
        assert!(gate.try_admit().is_none(), "two reserved reach the limit");
        gate.stored(a, Backend::Pod, false);
        assert!(gate.try_admit().is_none(), "one stored + one reserved");
        gate.release(b);
        let c = gate.try_admit().expect("room again");
        gate.release(c);
        let epoch = gate.epoch();
        gate.refreshed(&BTreeMap::new(), &epoch);
        assert_eq!(gate.in_stream(Backend::Pod), Some(0));
    }

    /// DESIGN invariant 22: a backend whose backlog is full (nothing consumes it: a dead or
    /// disabled worker) closes only itself. The gate wants the other backend's labels alone
    /// declared and admits fetches once Gitea has them; when the full backend drains, it
    /// wants both again.
    #[tokio::test]
    async fn a_full_backlog_closes_only_its_own_backend() {
        let gate = BacklogGate::new(both(2, 2));
        gate.declared(set(&[Backend::Pod, Backend::Vm]));
        gate.refreshed(&both(2, 0), &gate.epoch());
        assert!(
            gate.try_admit().is_none(),
            "no fetch while Gitea may still offer the full backend's jobs"
        );
        assert_eq!(gate.wanted(), Some(set(&[Backend::Vm])));
        gate.declared(set(&[Backend::Vm]));
        assert_eq!(gate.wanted(), None);
        let a = gate.try_admit().expect("the vm backlog has room");
        let b = gate.try_admit().expect("twice");
        assert!(gate.try_admit().is_none(), "the vm room is two");
        gate.stored(a, Backend::Vm, false);
        gate.release(b);
        gate.refreshed(&both(0, 1), &gate.epoch());
        assert_eq!(gate.wanted(), Some(set(&[Backend::Pod, Backend::Vm])));
        gate.refreshed(&both(2, 2), &gate.epoch());
        assert_eq!(gate.wanted(), None, "nothing to declare with both full");
        assert!(gate.try_admit().is_none());
    }

    /// DESIGN invariants 5b and 22: fetches admitted while a backend was closed are still
    /// in flight when it drains; Gitea would answer them with the reopened backend's jobs
    /// once its labels are back, so the labels widen only when those fetches fit its room.
    #[tokio::test]
    async fn a_drained_backend_reopens_only_when_the_fetches_in_flight_fit_its_room() {
        let gate = BacklogGate::new(both(3, 2));
        gate.declared(set(&[Backend::Pod, Backend::Vm]));
        gate.refreshed(&both(0, 2), &gate.epoch());
        assert_eq!(gate.wanted(), Some(set(&[Backend::Pod])));
        gate.declared(set(&[Backend::Pod]));
        let in_flight: Vec<Slot> = (0..3)
            .map(|_| gate.try_admit().expect("pod room"))
            .collect();
        gate.refreshed(&both(0, 0), &gate.epoch());
        assert_eq!(
            gate.wanted(),
            None,
            "three fetches in flight could bring three vm jobs into a room of two"
        );
        let mut in_flight = in_flight.into_iter();
        gate.release(in_flight.next().expect("slot"));
        assert_eq!(gate.wanted(), Some(set(&[Backend::Pod, Backend::Vm])));
        for slot in in_flight {
            gate.release(slot);
        }
    }

    /// DESIGN invariant 5b: a poller held at the limit is let through the moment a
    /// stored assignment leaves the stream (a refresh shows room), and a shutdown ends
    /// the wait without a slot.
    #[tokio::test(start_paused = true)]
    async fn a_poller_held_at_the_limit_waits_for_room_and_a_shutdown_ends_the_wait() {
        use std::sync::Arc;
        let gate = Arc::new(BacklogGate::new(BTreeMap::from([(Backend::Pod, 1)])));
        gate.declared(set(&[Backend::Pod]));
        gate.refreshed(&BTreeMap::from([(Backend::Pod, 1)]), &gate.epoch());
        let waiting = Arc::new(AtomicU64::new(0));
        let (_trigger, shutdown) = crate::shutdown::shutdown_channel();
        let held = tokio::spawn({
            let (gate, waiting, shutdown) = (gate.clone(), waiting.clone(), shutdown.clone());
            async move { gate.admit(&shutdown, &waiting).await.is_some() }
        });
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
        assert!(!held.is_finished(), "admitted beyond the limit");
        assert_eq!(waiting.load(Ordering::Acquire), 1);
        gate.refreshed(&BTreeMap::new(), &gate.epoch());
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
