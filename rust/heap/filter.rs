//! Which addresses may be a sampled block's: frees are nearly all of blocks never
//! sampled, and such a free reads one bit and returns; only the rest take the lock.
//!
//! One bit per hash of an address, 8 KiB in all, so that it stays in cache. The hash
//! keeps neighbours apart by 16 bytes as neighbouring bits: blocks freed in the order
//! they were made (a list dropped) read the same cache line. Bits are set and cleared
//! under the table's lock, by a count of the sampled blocks per hash.

use std::sync::atomic::{AtomicU64, Ordering};

const BITS: u32 = 16;
static MAY_HOLD: [AtomicU64; 1 << (BITS - 6)] = [const { AtomicU64::new(0) }; 1 << (BITS - 6)];

/// 16-byte granules of a MiB in order, with the higher bits folded in.
fn hash(addr: usize) -> usize {
    let granule = addr >> 4;
    (granule ^ granule >> BITS ^ granule >> (2 * BITS)) & ((1 << BITS) - 1)
}

fn word(h: usize) -> (&'static AtomicU64, u64) {
    (&MAY_HOLD[h >> 6], 1 << (h & 63))
}

/// Whether `addr` may be a sampled block's (false: it is not).
#[inline(always)]
pub fn may_hold(addr: usize) -> bool {
    let (word, bit) = word(hash(addr));
    word.load(Ordering::Relaxed) & bit != 0
}

/// Forgets every block. Async-signal-safe (a forked child calls it).
pub fn clear() {
    MAY_HOLD.iter().for_each(|w| w.store(0, Ordering::Relaxed));
}

/// The sampled blocks per hash, kept under the table's lock; the bits follow them.
#[derive(Default)]
pub struct Counts(Vec<u32>);

impl Counts {
    pub fn add(&mut self, addr: usize) {
        if self.0.is_empty() {
            self.0 = vec![0; 1 << BITS];
        }
        let h = hash(addr);
        self.0[h] += 1;
        if self.0[h] == 1 {
            let (word, bit) = word(h);
            word.fetch_or(bit, Ordering::Relaxed);
        }
    }

    pub fn remove(&mut self, addr: usize) {
        let h = hash(addr);
        self.0[h] -= 1;
        if self.0[h] == 0 {
            let (word, bit) = word(h);
            word.fetch_and(!bit, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbours_read_one_cache_line_and_far_blocks_differ() {
        let base = 0x7f00_1234_4000usize; // 8 KiB aligned
        let line = |addr: usize| hash(addr) >> 9; // 512 bits to a 64-byte line
        assert!((0..8192).step_by(16).all(|off| line(base + off) == line(base)));
        assert_ne!(hash(base), hash(base + (1 << 20)), "a MiB apart");
        assert_ne!(hash(base), hash(base + (1 << 36)), "far apart");
    }
}
