//! Locks that survive fork(): std's, whose whole state is a futex word inside each
//! lock. parking_lot keeps one table of parked threads for the whole process: a child
//! forked while the sampling thread slept in it inherits entries for threads it does
//! not have, and its next wait walks them (a segfault, or a hang).
//!
//! The API is parking_lot's: no poisoning (a panic is contained and reported by the
//! sampling thread itself), and a condvar waits on `&mut` guard until a deadline.

use std::ops::{Deref, DerefMut};
use std::sync::{PoisonError, TryLockError};
use std::time::Instant;

#[derive(Debug, Default)]
pub struct Mutex<T>(std::sync::Mutex<T>);

/// Always holds the lock; empty only inside `Condvar::wait_until`.
pub struct MutexGuard<'a, T>(Option<std::sync::MutexGuard<'a, T>>);

impl<T> Mutex<T> {
    pub const fn new(value: T) -> Self {
        Mutex(std::sync::Mutex::new(value))
    }

    pub fn lock(&self) -> MutexGuard<'_, T> {
        MutexGuard(Some(self.0.lock().unwrap_or_else(PoisonError::into_inner)))
    }

    /// The lock, if no other thread holds it now.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        match self.0.try_lock() {
            Ok(guard) => Some(MutexGuard(Some(guard))),
            Err(TryLockError::Poisoned(poisoned)) => Some(MutexGuard(Some(poisoned.into_inner()))),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    pub fn get_mut(&mut self) -> &mut T {
        self.0.get_mut().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T> Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.0.as_deref().expect("a guard holds its lock")
    }
}

impl<T> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.as_deref_mut().expect("a guard holds its lock")
    }
}

#[derive(Debug, Default)]
pub struct Condvar(std::sync::Condvar);

impl Condvar {
    pub fn new() -> Self {
        Condvar(std::sync::Condvar::new())
    }

    /// Releases the lock until notified (or woken spuriously) or until `deadline`.
    pub fn wait_until<T>(&self, guard: &mut MutexGuard<'_, T>, deadline: Instant) -> std::sync::WaitTimeoutResult {
        let held = guard.0.take().expect("a guard holds its lock");
        let timeout = deadline.saturating_duration_since(Instant::now());
        let (held, result) = self.0.wait_timeout(held, timeout).unwrap_or_else(PoisonError::into_inner);
        guard.0 = Some(held);
        result
    }

    pub fn notify_all(&self) {
        self.0.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn waits_until_notified_or_the_deadline() {
        let pair = Arc::new((Mutex::new(false), Condvar::new()));
        let other = pair.clone();
        let notifier = std::thread::spawn(move || {
            *other.0.lock() = true;
            other.1.notify_all();
        });
        let mut done = pair.0.lock();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !*done {
            assert!(!pair.1.wait_until(&mut done, deadline).timed_out(), "notified long before the deadline");
        }
        drop(done);
        notifier.join().unwrap();
        let mut guard = pair.0.lock();
        assert!(pair.1.wait_until(&mut guard, Instant::now()).timed_out());
        *guard = false;
    }

    #[test]
    fn a_panic_while_locked_does_not_poison() {
        let m = Arc::new(Mutex::new(1));
        let other = m.clone();
        let _ = std::thread::spawn(move || {
            let _held = other.lock();
            panic!("while locked");
        })
        .join();
        assert_eq!(*m.lock(), 1);
    }
}
