//! How late the sampling thread's last ticks began against the times it drew for
//! them: a tick that waited for a CPU, or for a lock, shows here.

use serde::{Serialize, Serializer};
use serde_json::json;
use std::collections::VecDeque;
use std::time::Duration;

/// Ticks remembered: 10 s at 100 Hz.
const KEPT: usize = 1024;

#[derive(Clone, Debug, Default)]
pub struct Lateness {
    /// Microseconds, oldest first.
    recent: VecDeque<u32>,
}

impl Lateness {
    pub fn add(&mut self, late: Duration) {
        if self.recent.len() == KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(late.as_micros().min(u32::MAX.into()) as u32);
    }

    /// The `p`-th percentile (0-100) of the ticks remembered, in seconds.
    fn percentile(sorted: &[u32], p: f64) -> f64 {
        let at = ((sorted.len() - 1) as f64 * p / 100.0).round() as usize;
        f64::from(sorted[at]) / 1e6
    }
}

/// The median, 99th percentile and most of the ticks remembered, in seconds.
impl Serialize for Lateness {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut sorted: Vec<u32> = self.recent.iter().copied().collect();
        sorted.sort_unstable();
        let summary = match sorted.last() {
            None => json!({"ticks": 0}),
            Some(&most) => json!({
                "ticks": sorted.len(),
                "p50": Lateness::percentile(&sorted, 50.0),
                "p99": Lateness::percentile(&sorted, 99.0),
                "max": f64::from(most) / 1e6,
            }),
        };
        summary.serialize(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_ticks_and_their_percentiles() {
        let mut l = Lateness::default();
        assert_eq!(serde_json::to_value(&l).unwrap(), json!({"ticks": 0}));
        (0..2 * KEPT as u64).for_each(|ms| l.add(Duration::from_millis(ms)));
        let summary = serde_json::to_value(&l).unwrap();
        let seconds = |key: &str| summary[key].as_f64().unwrap();
        assert_eq!(summary["ticks"], KEPT, "the older half is gone");
        assert_eq!((seconds("p50"), seconds("p99"), seconds("max")), (1.536, 2.037, 2.047));
    }
}
