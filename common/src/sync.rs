//! Locking that ThreadSanitizer can follow (`make tsan`, docs/reliability.md "Race detection").
//!
//! The standard library is not built with the sanitizer here. When a `Mutex` is contended, the
//! thread that waited takes it inside std (`lock_contended`), where the sanitizer does not see
//! the acquire, and every access the lock protects then looks like a race. [`lock`] takes a lock
//! as `Mutex::lock` does, a poisoned one included (what it protects is still consistent: every
//! holder in this crate finishes or undoes its change before it can panic); in the
//! `rpma_tsan` build it takes it with `try_lock`, whose compare-and-swap is compiled into the
//! caller where the sanitizer sees it, yielding while the lock is held.

use std::sync::{Mutex, MutexGuard};

/// `m`, locked (a poisoned lock too).
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    #[cfg(rpma_tsan)]
    loop {
        match m.try_lock() {
            Ok(g) => return g,
            Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => std::thread::yield_now(),
        }
    }
    #[cfg(not(rpma_tsan))]
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
