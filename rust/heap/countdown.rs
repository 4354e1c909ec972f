//! Which allocations are sampled: by bytes, as tcmalloc, Go and Datadog's memalloc do.
//! Each thread counts the bytes it allocates down from a distance drawn from an
//! exponential distribution of mean `MEAN_BYTES`; the allocation that reaches it is
//! sampled and stands for every byte counted since the last sample, so the totals are
//! unbiased whatever the sizes. Most allocations cost a thread-local subtraction.

use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// The mean distance between samples, in bytes.
pub const MEAN_BYTES: u64 = 512 * 1024;

static MEAN: AtomicU64 = AtomicU64::new(MEAN_BYTES);

thread_local! {
    /// Bytes this thread may allocate before its next sample: the only state most
    /// allocations touch. 0 until its first allocation, which draws its first distance.
    /// Const-initialised and without destructors, so a hook called while the thread
    /// exits still finds them.
    static LEFT: Cell<i64> = const { Cell::new(0) };
    /// The distance last drawn, and the generator's state (0: not seeded yet).
    static DRAWN: Cell<(i64, u64)> = const { Cell::new((0, 0)) };
}

/// The same, for allocations made under the GIL (MEM and OBJ on a GIL build): one
/// count, as the GIL serialises them, and a static is cheaper to reach than a shared
/// library's thread-local (a call to `__tls_get_addr`). Interpreters with GILs of
/// their own may race on it (a lost subtraction, never a fault).
static GIL_LEFT: AtomicI64 = AtomicI64::new(0);
static GIL_DRAWN: AtomicI64 = AtomicI64::new(0);
static GIL_RNG: AtomicU64 = AtomicU64::new(0);

pub fn set_mean(bytes: u64) {
    MEAN.store(bytes.max(1), Ordering::Relaxed);
}

pub fn mean() -> u64 {
    MEAN.load(Ordering::Relaxed)
}

/// Counts `size` bytes allocated by this thread (`UNDER_GIL`: under the GIL, on the
/// GIL's count); the bytes the allocation stands for if it is sampled.
#[inline(always)]
pub fn take<const UNDER_GIL: bool>(size: usize) -> Option<u64> {
    let left = if UNDER_GIL {
        let left = GIL_LEFT.load(Ordering::Relaxed) - size as i64;
        GIL_LEFT.store(left, Ordering::Relaxed);
        Ok(left)
    } else {
        LEFT.try_with(|l| {
            let left = l.get() - size as i64;
            l.set(left);
            left
        })
    };
    match left {
        Ok(left) if left <= 0 => due::<UNDER_GIL>(left),
        _ => None,
    }
}

/// The count reached 0 (`left` past it): the bytes counted since the last draw, and a
/// new distance. A count's first allocation draws its first distance and counts on.
#[cold]
#[inline(never)]
fn due<const UNDER_GIL: bool>(mut left: i64) -> Option<u64> {
    let (mut drawn, mut rng) = if UNDER_GIL {
        (GIL_DRAWN.load(Ordering::Relaxed), GIL_RNG.load(Ordering::Relaxed))
    } else {
        DRAWN.try_with(Cell::get).ok()?
    };
    if rng == 0 {
        drawn = draw(&mut rng);
        left += drawn;
    }
    let counted = (left <= 0).then(|| {
        let counted = (drawn - left) as u64;
        drawn = draw(&mut rng);
        left = drawn;
        counted
    });
    if UNDER_GIL {
        GIL_DRAWN.store(drawn, Ordering::Relaxed);
        GIL_RNG.store(rng, Ordering::Relaxed);
        GIL_LEFT.store(left, Ordering::Relaxed);
    } else {
        _ = DRAWN.try_with(|d| d.set((drawn, rng)));
        _ = LEFT.try_with(|l| l.set(left));
    }
    counted
}

/// A distance from the exponential distribution of mean `MEAN`. The generator is
/// xorshift64*, seeded from the thread's stack address and the clock on first use.
fn draw(state: &mut u64) -> i64 {
    if *state == 0 {
        let here = state as *const u64 as u64;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        *state = (here ^ now as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    }
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    let bits = state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
    let u = (bits as f64 + 0.5) / (1u64 << 53) as f64; // in (0, 1)
    (-u.ln() * MEAN.load(Ordering::Relaxed) as f64) as i64 + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts `sizes` on one count from a thread of its own; the bytes sampled, the
    /// samples, and the bytes counted since the last sample.
    fn count<const UNDER_GIL: bool>(sizes: impl Iterator<Item = usize> + Send + 'static) -> (u64, u64, u64) {
        std::thread::spawn(move || {
            let (mut sampled, mut samples) = (0u64, 0u64);
            for size in sizes {
                if let Some(stands_for) = take::<UNDER_GIL>(size) {
                    sampled += stands_for;
                    samples += 1;
                }
            }
            let left = if UNDER_GIL {
                GIL_DRAWN.load(Ordering::Relaxed) - GIL_LEFT.load(Ordering::Relaxed)
            } else {
                DRAWN.with(Cell::get).0 - LEFT.with(Cell::get)
            };
            (sampled, samples, left as u64)
        })
        .join()
        .unwrap()
    }

    #[test]
    fn samples_stand_for_every_byte_counted() {
        let sizes = || (0..2_000_000u64).map(|i| 16 + (i % 7) as usize * 100);
        let allocated: u64 = sizes().map(|s| s as u64).sum();
        // The GIL's count is this test's alone: no other test allocates through it.
        for (sampled, samples, left) in [count::<false>(sizes()), count::<true>(sizes())] {
            assert_eq!(sampled + left, allocated, "each byte counted once");
            let mean = allocated as f64 / samples as f64;
            assert!((mean / MEAN_BYTES as f64 - 1.0).abs() < 0.1, "{samples} samples, mean distance {mean}");
        }
    }
}
