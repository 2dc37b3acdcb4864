//! The RFC 7306 atomics, executed on registered memory.

use std::sync::atomic::{AtomicU64, Ordering};

/// Executes an RFC 7306 masked fetch-and-add on the 8 bytes at `ptr`; returns the original.
///
/// A set bit `i` in `mask` stops the carry out of bit `i` (partitioned adds); mask 0 is a plain
/// 64-bit add, done with one `lock xadd`.
pub(crate) fn fetch_add(target: &AtomicU64, add: u64, mask: u64) -> u64 {
    if mask == 0 {
        return target.fetch_add(add, Ordering::AcqRel);
    }
    let mut cur = target.load(Ordering::Acquire);
    loop {
        let new = masked_add(cur, add, mask);
        match target.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(orig) => return orig,
            Err(actual) => cur = actual,
        }
    }
}

fn masked_add(a: u64, b: u64, mask: u64) -> u64 {
    let mut r = 0u64;
    let mut carry = 0u64;
    for i in 0..64 {
        let s = ((a >> i) & 1) + ((b >> i) & 1) + carry;
        r |= (s & 1) << i;
        carry = if (mask >> i) & 1 == 1 { 0 } else { s >> 1 };
    }
    r
}

/// Executes an RFC 7306 masked compare-and-swap; returns the original value. The swap happens
/// when the bits selected by `cmp_mask` equal `compare`'s; then the bits selected by
/// `swap_mask` take `swap`'s.
pub(crate) fn compare_swap(
    target: &AtomicU64,
    compare: u64,
    cmp_mask: u64,
    swap: u64,
    swap_mask: u64,
) -> u64 {
    let mut cur = target.load(Ordering::Acquire);
    loop {
        if cur & cmp_mask != compare & cmp_mask {
            return cur;
        }
        let new = (cur & !swap_mask) | (swap & swap_mask);
        match target.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(orig) => return orig,
            Err(actual) => cur = actual,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_atomics() {
        let a = AtomicU64::new(5);
        assert_eq!(fetch_add(&a, 3, 0), 5);
        assert_eq!(a.load(Ordering::Relaxed), 8);
        // Two 32-bit lanes: the carry out of bit 31 is stopped.
        let a = AtomicU64::new(0x0000_0001_FFFF_FFFF);
        assert_eq!(fetch_add(&a, 1, 1 << 31), 0x0000_0001_FFFF_FFFF);
        assert_eq!(a.load(Ordering::Relaxed), 0x0000_0001_0000_0000);
        let a = AtomicU64::new(10);
        assert_eq!(compare_swap(&a, 11, !0, 99, !0), 10);
        assert_eq!(a.load(Ordering::Relaxed), 10, "no swap on mismatch");
        assert_eq!(compare_swap(&a, 10, !0, 99, !0), 10);
        assert_eq!(a.load(Ordering::Relaxed), 99);
        // Compare only the low byte, swap only the high byte.
        let a = AtomicU64::new(0x1100_0000_0000_0022);
        compare_swap(&a, 0x22, 0xFF, 0xAA00_0000_0000_0000, 0xFF00_0000_0000_0000);
        assert_eq!(a.load(Ordering::Relaxed), 0xAA00_0000_0000_0022);
    }
}
