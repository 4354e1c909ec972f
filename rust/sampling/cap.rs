//! Keeping the store under its memory cap. Past it, in this order: compact the tables
//! when they grew (task keys only folded samples had); merge the history's oldest
//! buckets into coarser ones; fold the oldest raw samples early; drop the oldest
//! buckets. Nothing goes while something can still be folded or merged.

use crate::profile::build::{Builder, Remap};
use crate::sampling::calls::NS_PER_S;
use crate::sampling::store::{Store, SAMPLE_BYTES};

impl Store {
    pub(super) fn enforce_cap(&mut self) {
        while self.bytes() > self.max_bytes {
            let tables = self.tables_bytes();
            if tables > self.max_bytes / 2 || tables > self.compacted_tables + self.max_bytes / 32 {
                // Folded samples leave task keys behind: compacting drops them. Only if the
                // samples left still need more does the oldest half of them go.
                self.compact();
                if self.tables_bytes() > self.max_bytes / 2 {
                    self.shed_oldest_half();
                    self.compact();
                }
            } else if let Some((from, to)) = self.history.merge_oldest(self.retention.step_ns) {
                self.calls.coarsen(from, to);
            } else if !self.ring.is_empty() {
                // In batches, so the cost amortises over many pushes.
                let excess = (self.bytes() - self.max_bytes).div_ceil(SAMPLE_BYTES);
                self.fold_oldest(excess.max(self.ring.len() / 64));
            } else if let Some(end) = self.drop_oldest_bucket() {
                self.calls.evict_before(end / NS_PER_S);
            } else if !self.calls.evict_oldest() {
                break; // only calls were left (counted while nothing was sampled), and they went
            }
        }
    }

    fn drop_oldest_bucket(&mut self) -> Option<u64> {
        let before = self.history.dropped_samples;
        let end = self.history.drop_oldest()?;
        self.evicted += self.history.dropped_samples - before;
        Some(end)
    }

    /// Drops the oldest half of the history's buckets, or of the raw samples if there is none.
    fn shed_oldest_half(&mut self) {
        let buckets = self.history.buckets();
        let kept_from = if buckets > 0 {
            (0..buckets.div_ceil(2)).filter_map(|_| self.drop_oldest_bucket()).last()
        } else {
            let n = self.ring.len().div_ceil(2);
            let last = n.checked_sub(1).map(|i| self.ring[i].time_ns + 1);
            self.ring.drain(..n);
            self.evicted += n as u64;
            last
        };
        if let Some(kept_from) = kept_from {
            self.calls.evict_before(kept_from / NS_PER_S);
        }
    }

    /// Rebuilds the tables from the samples still held, dropping what nothing uses.
    fn compact(&mut self) {
        let mut fresh = Builder::default();
        let mut map = Remap::for_source(&self.tables);
        for s in &self.ring {
            fresh.copy_sample(&self.tables, &mut map, s, None);
        }
        self.ring = std::mem::take(&mut fresh.samples).into();
        self.history.renumber(|s| {
            fresh.copy_sample(&self.tables, &mut map, &s, None);
            fresh.samples.pop().expect("just copied")
        });
        self.tables = fresh;
        self.compacted_tables = self.tables_bytes();
        self.compactions += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::build::Tables;
    use crate::profile::model::Metadata;
    use crate::sampling::store::tests::*;
    use crate::sampling::store::Retention;

    #[test]
    fn past_the_cap_the_oldest_raw_samples_fold_before_any_go() {
        let cap = 64 * 1024;
        let mut s = Store::new(cap);
        for t in 0..100_000 {
            push(&mut s, t, &["main", "work"], None);
        }
        let st = s.stats();
        assert!(st.bytes <= cap, "{} > {cap}", st.bytes);
        assert_eq!(st.samples_evicted, 0, "one stack folds into one sample: nothing had to go");
        assert!(st.folded_held > 0 && st.samples_held < 100_000);
        let w = s.window(all(0, u64::MAX), proc(), Metadata::default());
        assert_eq!(total_us(&w), 100_000 * 10_000);
        assert_eq!(w.samples.iter().map(|s| u64::from(s.count)).sum::<u64>(), 100_000);
        assert_eq!(w.samples.last().unwrap().time_ns, 99_999, "the newest stay raw");
    }

    #[test]
    fn the_oldest_buckets_go_when_folding_is_not_enough() {
        let cap = 256 * 1024;
        let mut s = Store::new(cap);
        s.set_retention(Retention { recent_ns: 10 * NS_PER_S, step_ns: NS_PER_S });
        for t in 0..20_000u64 {
            push(&mut s, t * NS_PER_S / 10, &["main", &format!("f{t}")], None);
        }
        let st = s.stats();
        assert!(st.bytes <= cap && st.samples_evicted > 0, "{st:?}");
        let w = s.window(all(0, u64::MAX), proc(), Metadata::default());
        assert_eq!(w.samples.iter().map(|s| u64::from(s.count)).sum::<u64>() + st.samples_evicted, 20_000);
        assert_eq!(w.samples.last().unwrap().time_ns, 19_999 * NS_PER_S / 10, "the newest stay raw");
    }

    #[test]
    fn buckets_merge_into_coarser_ones_before_any_go() {
        let cap = 48 * 1024;
        let mut s = Store::new(cap);
        s.set_retention(Retention { recent_ns: 10 * NS_PER_S, step_ns: NS_PER_S });
        for t in 0..20_000u64 {
            push(&mut s, t * NS_PER_S / 10, &["main", &format!("f{}", t % 20)], None);
        }
        let st = s.stats();
        assert!(st.bytes <= cap && st.bucket_merges > 0 && st.samples_evicted == 0, "{st:?}");
        let w = s.window(all(0, u64::MAX), proc(), Metadata::default());
        assert_eq!(total_us(&w), 20_000 * 10_000, "every microsecond kept");
        let steps: Vec<f64> = w.processes[0].stats["resolution"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["step"].as_f64().unwrap())
            .collect();
        assert!(steps.first() > steps.get(1), "the oldest are the coarsest: {steps:?}");
    }

    #[test]
    fn a_lower_cap_folds_the_oldest_at_once() {
        let mut s = Store::new(1 << 20);
        for t in 0..20_000 {
            push(&mut s, t, &["main", "work"], None);
        }
        let cap = 64 * 1024;
        s.set_max_bytes(cap);
        let st = s.stats();
        assert!(st.bytes <= cap && st.samples_held > 0 && st.samples_evicted == 0, "{st:?}");
        let w = s.window(all(0, u64::MAX), proc(), Metadata::default());
        let first_raw = w.samples.iter().find(|s| s.count == 1).unwrap();
        assert_eq!(first_raw.time_ns, 20_000 - st.samples_held as u64, "the newest stay raw");
    }

    #[test]
    fn compaction_keeps_the_history() {
        let mut s = Store::new(1 << 20);
        s.set_retention(Retention { recent_ns: NS_PER_S, step_ns: NS_PER_S });
        for t in 0..100u64 {
            push_task(&mut s, t * NS_PER_S / 10, &format!("f{}", t % 3), &format!("load-{t}"));
        }
        let before = s.window(all(0, u64::MAX), proc(), Metadata::default());
        s.compact();
        let after = s.window(all(0, u64::MAX), proc(), Metadata::default());
        assert_eq!(before.digest(), after.digest());
        assert!(s.tables.tags.len() < 100, "the folded samples' keys went");
    }

    #[test]
    fn churn_of_distinct_keys_compacts_tables() {
        let cap = 256 * 1024;
        let mut s = Store::new(cap);
        for t in 0..50_000u64 {
            let key = format!("task-{t}-{}", "x".repeat(40));
            push(&mut s, t, &["main", &format!("f{}", t % 5000)], Some(&key));
        }
        let st = s.stats();
        assert!(st.bytes <= cap);
        assert!(st.compactions > 0);
        // Tables only hold what live samples use.
        assert_eq!(s.tables.counts()[2], st.samples_held);
        let w = s.window(all(0, u64::MAX), proc(), Metadata::default());
        assert_eq!(w.samples.len(), st.samples_held);
        assert!(w.tags.iter().all(|t| t.key.starts_with("task-")));
    }
}
