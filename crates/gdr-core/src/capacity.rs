//! Admission pools: how many executors a backend may run at once (DESIGN invariants 6, 7).
//!
//! A pool holds only rebuildable state. At start it is restored from the backend's
//! non-terminal executors; a slot is released when the terminal update is persisted or
//! the executor is failed and cleaned. Admission is idempotent per assignment, so a
//! redelivered assignment that already holds a slot is admitted again without taking
//! a second one.
//!
//! Assignments that found the pool full may wait in line (at most `capacity` of them): a
//! freed slot goes to the first in line, and nobody who is not in line takes a slot a
//! waiter is owed.

use std::collections::{BTreeSet, VecDeque};

use super::assignment::AssignmentId;

/// The answer to an admission request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// A new slot was taken for this assignment.
    Admitted,
    /// This assignment already holds a slot (redelivery, restart).
    AlreadyAdmitted,
    /// Every slot is taken: leave the assignment pending and retry later.
    Full,
}

/// A fixed-capacity set of admitted assignments.
#[derive(Debug, Clone)]
pub struct Pool {
    capacity: usize,
    admitted: BTreeSet<AssignmentId>,
    /// Assignments waiting for a slot, first come first served.
    waiting: VecDeque<AssignmentId>,
}

impl Pool {
    /// An empty pool of `capacity` slots.
    pub fn new(capacity: usize) -> Self {
        Pool {
            capacity,
            admitted: BTreeSet::new(),
            waiting: VecDeque::new(),
        }
    }

    /// Rebuilds the pool from the executors a backend reports as not terminal.
    /// Restored executors may exceed the capacity (it was lowered across a restart);
    /// they keep their slots and nothing new is admitted until enough are released.
    pub fn restore(capacity: usize, live: impl IntoIterator<Item = AssignmentId>) -> Self {
        Pool {
            capacity,
            admitted: live.into_iter().collect(),
            waiting: VecDeque::new(),
        }
    }

    /// Admits an assignment if it holds a slot already, or if a slot is free that no
    /// waiter ahead of it is owed (a waiter leaves the line when admitted).
    pub fn admit(&mut self, id: &AssignmentId) -> Admission {
        if self.admitted.contains(id) {
            return Admission::AlreadyAdmitted;
        }
        let position = self.waiting.iter().position(|w| w == id);
        let ahead = position.unwrap_or(self.waiting.len());
        if self.admitted.len().saturating_add(ahead) >= self.capacity {
            return Admission::Full;
        }
        if let Some(p) = position {
            self.waiting.remove(p);
        }
        self.admitted.insert(id.clone());
        Admission::Admitted
    }

    /// Puts an assignment in line for the next free slot (idempotent); `false` when
    /// `capacity` assignments wait already.
    pub fn wait(&mut self, id: &AssignmentId) -> bool {
        if self.waiting.contains(id) {
            return true;
        }
        if self.waiting.len() >= self.capacity {
            return false;
        }
        self.waiting.push_back(id.clone());
        true
    }

    /// Takes an assignment out of the line (it gave up waiting).
    pub fn stop_waiting(&mut self, id: &AssignmentId) {
        self.waiting.retain(|w| w != id);
    }

    /// Assignments in line.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Frees the assignment's slot; `false` when it held none (idempotent).
    pub fn release(&mut self, id: &AssignmentId) -> bool {
        self.admitted.remove(id)
    }

    /// Whether the assignment holds a slot.
    pub fn holds(&self, id: &AssignmentId) -> bool {
        self.admitted.contains(id)
    }

    /// Slots in use.
    pub fn in_use(&self) -> usize {
        self.admitted.len()
    }

    /// Total slots.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: i64) -> AssignmentId {
        AssignmentId::from_task_id(n).unwrap()
    }

    #[test]
    fn no_assignment_is_admitted_beyond_capacity() {
        let mut pool = Pool::new(2);
        assert_eq!(pool.admit(&id(1)), Admission::Admitted);
        assert_eq!(pool.admit(&id(2)), Admission::Admitted);
        assert_eq!(pool.admit(&id(3)), Admission::Full);
        assert_eq!(pool.in_use(), 2);
    }

    #[test]
    fn readmitting_an_admitted_assignment_takes_no_second_slot() {
        let mut pool = Pool::new(1);
        assert_eq!(pool.admit(&id(1)), Admission::Admitted);
        assert_eq!(pool.admit(&id(1)), Admission::AlreadyAdmitted);
        assert_eq!(pool.in_use(), 1);
    }

    #[test]
    fn a_released_slot_admits_the_next_assignment_and_release_is_idempotent() {
        let mut pool = Pool::new(1);
        pool.admit(&id(1));
        assert!(pool.release(&id(1)));
        assert!(!pool.release(&id(1)));
        assert_eq!(pool.admit(&id(2)), Admission::Admitted);
    }

    /// DESIGN invariant 6: a freed slot goes to the first assignment in line, never to
    /// one that arrives later, and the line holds at most `capacity` assignments.
    #[test]
    fn a_freed_slot_goes_to_the_first_waiter_and_latecomers_queue_behind() {
        let mut pool = Pool::new(2);
        pool.admit(&id(1));
        pool.admit(&id(2));
        assert_eq!(pool.admit(&id(3)), Admission::Full);
        assert!(pool.wait(&id(3)));
        assert!(pool.wait(&id(4)));
        assert!(pool.wait(&id(3)), "waiting again keeps the place");
        assert!(!pool.wait(&id(5)), "the line is as long as the pool");
        assert_eq!(pool.waiting(), 2);

        pool.release(&id(1));
        assert_eq!(
            pool.admit(&id(5)),
            Admission::Full,
            "a latecomer jumps no line"
        );
        assert_eq!(pool.admit(&id(4)), Admission::Full, "4 waits behind 3");
        assert_eq!(pool.admit(&id(3)), Admission::Admitted);
        assert_eq!(pool.waiting(), 1);

        pool.release(&id(2));
        pool.stop_waiting(&id(4));
        assert_eq!(pool.waiting(), 0);
        assert_eq!(
            pool.admit(&id(5)),
            Admission::Admitted,
            "4 gave up its place"
        );
    }

    #[test]
    fn a_restored_pool_counts_live_executors_even_above_a_lowered_capacity() {
        let mut pool = Pool::restore(1, [id(1), id(2)]);
        assert_eq!(pool.in_use(), 2);
        assert_eq!(pool.admit(&id(3)), Admission::Full);
        assert_eq!(pool.admit(&id(2)), Admission::AlreadyAdmitted);
        pool.release(&id(1));
        assert_eq!(
            pool.admit(&id(3)),
            Admission::Full,
            "still at capacity with id 2"
        );
        pool.release(&id(2));
        assert_eq!(pool.admit(&id(3)), Admission::Admitted);
    }
}
