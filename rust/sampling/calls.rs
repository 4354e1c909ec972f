//! Calls per activity: how many times each dispatched activity ran, by second.
//!
//! An event loop dispatches thousands of messages a second, so counting one must cost
//! little and never wait on the store (an export holds its lock for a while): a call
//! goes into `Pending` under its own short lock, keyed by second and activity, with no
//! allocation once the key is there. The sampling thread folds `Pending` into the
//! store's `Buckets` every tick, so a window sums calls at one-second resolution and
//! the buckets go with the samples of their seconds.

use crate::reader::tags::Activity;
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::BTreeMap;
use std::sync::Arc;

pub const NS_PER_S: u64 = 1_000_000_000;

/// What a bucket takes: its entry and a share of the B-tree's nodes.
const BUCKET_BYTES: usize = std::mem::size_of::<((u64, Arc<str>), u64)>() + 16;

/// Calls counted since the last fold. Keyed by the activity's address, which the held
/// `Arc` keeps from being reused: hashing a pointer is cheaper than hashing a name.
#[derive(Default)]
pub struct Pending {
    counts: FxHashMap<(u64, usize), (Arc<Activity>, u64)>,
}

impl Pending {
    /// One call of `activity` in `second` (since the Unix epoch).
    pub fn count(&mut self, second: u64, activity: &Arc<Activity>) {
        let key = (second, Arc::as_ptr(activity) as usize);
        self.counts.entry(key).or_insert_with(|| (activity.clone(), 0)).1 += 1;
    }
}

/// Calls per (second, activity name), and the names ever counted: an activity whose
/// calls are not counted (a connection's reads) has unknown calls, not zero.
#[derive(Default)]
pub struct Buckets {
    by_second: BTreeMap<(u64, Arc<str>), u64>,
    counted: FxHashSet<Arc<str>>,
    /// What `counted` takes, kept as names are added: the store asks at every sample.
    counted_bytes: usize,
}

impl Buckets {
    /// Takes every pending count; `pending` keeps its capacity for the next ones.
    pub fn fold(&mut self, pending: &mut Pending) {
        for ((second, _), (activity, calls)) in pending.counts.drain() {
            let name = &activity.name;
            *self.by_second.entry((second, name.clone())).or_default() += calls;
            if !self.counted.contains(name) {
                self.counted.insert(name.clone());
                self.counted_bytes += name.len() + std::mem::size_of::<Arc<str>>();
            }
        }
    }

    /// Drops the buckets of seconds before `second`.
    pub fn evict_before(&mut self, second: u64) {
        self.by_second = self.by_second.split_off(&(second, Arc::from("")));
    }

    /// Counts the calls of the seconds in `[from_ns, to_ns)` at the first of them, as
    /// the store's history sums its samples at the start of their bucket.
    pub fn coarsen(&mut self, from_ns: u64, to_ns: u64) {
        let (from, to) = (from_ns / NS_PER_S, to_ns / NS_PER_S);
        let mut inside = self.by_second.split_off(&(from, Arc::from("")));
        let mut after = inside.split_off(&(to, Arc::from("")));
        for ((_, name), calls) in inside {
            *self.by_second.entry((from, name)).or_default() += calls;
        }
        self.by_second.append(&mut after);
    }

    /// Drops the oldest second's buckets; false if there were none.
    pub fn evict_oldest(&mut self) -> bool {
        let Some(&(oldest, _)) = self.by_second.keys().next() else { return false };
        self.evict_before(oldest + 1);
        true
    }

    pub fn bytes(&self) -> usize {
        self.by_second.len() * BUCKET_BYTES + self.counted_bytes
    }

    /// Every counted activity's calls in the seconds `[start_ns, stop_ns]` overlaps,
    /// zero for one with none there.
    pub fn window(&self, start_ns: u64, stop_ns: u64) -> FxHashMap<&str, u64> {
        let mut sums: FxHashMap<&str, u64> = self.counted.iter().map(|n| (&**n, 0)).collect();
        let (first, last) = (start_ns / NS_PER_S, stop_ns / NS_PER_S);
        let buckets = self.by_second.range((first, Arc::from(""))..).take_while(|((s, _), _)| *s <= last);
        for ((_, name), calls) in buckets {
            *sums.entry(name).or_default() += calls;
        }
        sums
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::reader::tags::Level;

    pub fn dispatch(name: &str) -> Arc<Activity> {
        Arc::new(Activity { name: name.into(), level: Level::Dispatch })
    }

    fn buckets(counts: &[(u64, &Arc<Activity>, u64)]) -> Buckets {
        let mut pending = Pending::default();
        for &(second, activity, n) in counts {
            (0..n).for_each(|_| pending.count(second, activity));
        }
        let mut b = Buckets::default();
        b.fold(&mut pending);
        assert!(pending.counts.is_empty());
        b
    }

    #[test]
    fn calls_sum_by_name_over_the_seconds_a_window_overlaps() {
        let (get, other_get, gather) = (dispatch("w: get_data"), dispatch("w: get_data"), dispatch("w: gather"));
        let b = buckets(&[(10, &get, 3), (10, &other_get, 2), (11, &gather, 4), (13, &get, 1)]);
        let at = |first: u64, last: u64| {
            let w = b.window(first, last);
            (w["w: get_data"], w["w: gather"])
        };
        assert_eq!(at(0, u64::MAX), (6, 4));
        assert_eq!(at(10_500_000_000, 11_000_000_000), (5, 4), "a second counts if the window touches it");
        assert_eq!(at(12 * NS_PER_S, 12 * NS_PER_S + 1), (0, 0), "counted activities without calls are 0");
        assert_eq!(at(13 * NS_PER_S, 20 * NS_PER_S), (1, 0));
        assert!(!b.window(0, 1).contains_key("w: reading"), "activities never counted are unknown");
    }

    #[test]
    fn coarsened_calls_count_at_the_start_of_their_span() {
        let get = dispatch("w: get_data");
        let mut b = buckets(&[(9, &get, 1), (10, &get, 2), (11, &get, 3), (12, &get, 4)]);
        b.coarsen(10 * NS_PER_S, 12 * NS_PER_S);
        assert_eq!(b.window(10 * NS_PER_S, 10 * NS_PER_S)["w: get_data"], 5);
        assert_eq!(b.window(11 * NS_PER_S, 11 * NS_PER_S)["w: get_data"], 0);
        assert_eq!(b.window(0, u64::MAX)["w: get_data"], 10, "none lost");
    }

    #[test]
    fn eviction_drops_old_seconds_and_memory() {
        let get = dispatch("w: get_data");
        let mut b = buckets(&[(10, &get, 1), (11, &get, 1), (12, &get, 1)]);
        let full = b.bytes();
        b.evict_before(11);
        assert_eq!(b.window(0, u64::MAX)["w: get_data"], 2);
        assert!(b.bytes() < full);
        assert!(b.evict_oldest() && b.evict_oldest() && !b.evict_oldest());
        assert_eq!(b.window(0, u64::MAX)["w: get_data"], 0, "the name stays counted");
    }
}
