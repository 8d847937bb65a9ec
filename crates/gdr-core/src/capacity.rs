//! Admission pools: how many executors a backend may run at once (DESIGN invariants 6, 7).
//!
//! A pool holds only rebuildable state. At start it is restored from the backend's
//! non-terminal executors; a slot is released when the terminal update is persisted or
//! the executor is failed and cleaned. Admission is idempotent per assignment, so a
//! redelivered assignment that already holds a slot is admitted again without taking
//! a second one.

use std::collections::BTreeSet;

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
}

impl Pool {
    /// An empty pool of `capacity` slots.
    pub fn new(capacity: usize) -> Self {
        Pool {
            capacity,
            admitted: BTreeSet::new(),
        }
    }

    /// Rebuilds the pool from the executors a backend reports as not terminal.
    /// Restored executors may exceed the capacity (it was lowered across a restart);
    /// they keep their slots and nothing new is admitted until enough are released.
    pub fn restore(capacity: usize, live: impl IntoIterator<Item = AssignmentId>) -> Self {
        Pool {
            capacity,
            admitted: live.into_iter().collect(),
        }
    }

    /// Admits an assignment if it holds a slot already or one is free.
    pub fn admit(&mut self, id: &AssignmentId) -> Admission {
        if self.admitted.contains(id) {
            Admission::AlreadyAdmitted
        } else if self.admitted.len() >= self.capacity {
            Admission::Full
        } else {
            self.admitted.insert(id.clone());
            Admission::Admitted
        }
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
