//! Differential profiles: what changed from a base profile to a new one.
//!
//! The graph is inferno's differential flame graph: frames as wide as the new
//! profile's time, coloured by the change from the base once the base is scaled to
//! the new profile's total, so runs of different lengths compare (red grew, blue
//! shrank). Its mirror is as wide as the base, so what shrank or vanished shows.
//! Frames are labelled by function (name and file, no line): an edit that moves
//! lines does not split a function in two.
//!
//! The tables rank functions (self time, by name and file) and task prefixes (time
//! outside tasks by activity) by the change in seconds, unscaled. `change_pct` is that change relative to the base's
//! seconds of the row (None when the base had none); `share_points` is the change
//! of the row's share of all sampled time, in percentage points: the scaled view
//! the graph's colours show.

use crate::formats::flamegraph::{folded, render};
use crate::profile::model::ProfileData;
use crate::profile::views::{By, Shown, Weight, NO_TASK};
use inferno::differential;
use serde::Serialize;
use std::collections::HashMap;
use std::hash::Hash;

/// Rows per table and direction.
const TOP: usize = 15;

#[derive(Serialize, Debug)]
pub struct Change {
    pub name: String,
    /// The function's file; None for task prefixes.
    pub file: Option<String>,
    pub base_seconds: f64,
    pub new_seconds: f64,
    pub seconds: f64,
    pub change_pct: Option<f64>,
    pub share_points: f64,
}

#[derive(Serialize, Debug)]
pub struct Ranked {
    /// Largest gain first.
    pub gained: Vec<Change>,
    /// Largest loss first.
    pub lost: Vec<Change>,
}

#[derive(Serialize)]
pub struct Diff {
    pub by: &'static str,
    pub base_seconds: f64,
    pub new_seconds: f64,
    pub functions: Ranked,
    pub prefixes: Ranked,
    /// As wide as the new profile.
    pub svg: Option<String>,
    /// As wide as the base.
    pub base_svg: Option<String>,
}

/// Microseconds of each function's self time (the leaf of each stack).
fn self_times(data: &ProfileData) -> HashMap<(&str, &str), u64> {
    let mut out = HashMap::new();
    for s in &data.samples {
        if let Some(&leaf) = data.stacks[s.stack as usize].last() {
            let f = &data.frames[leaf as usize];
            *out.entry((f.name.as_str(), f.file.as_str())).or_default() += s.weight_us as u64;
        }
    }
    out
}

/// Microseconds per task prefix; samples outside tasks by their activity
/// ("scheduler: task-finished"), else under NO_TASK.
fn prefix_times(data: &ProfileData) -> HashMap<&str, u64> {
    let mut out = HashMap::new();
    let activity = |a: Option<u32>| a.map_or(NO_TASK, |a| data.activities[a as usize].as_str());
    for s in &data.samples {
        let prefix = s.tag.map_or_else(|| activity(s.activity), |t| data.tags[t as usize].prefix.as_str());
        *out.entry(prefix).or_default() += s.weight_us as u64;
    }
    out
}

/// Each row of either profile with its change, gainers and losers apart.
fn rank<K: Eq + Hash + Copy + Ord>(
    base: &HashMap<K, u64>,
    new: &HashMap<K, u64>,
    totals: (u64, u64),
    row: impl Fn(K) -> (String, Option<String>),
) -> Ranked {
    let share = |us: u64, total: u64| if total == 0 { 0.0 } else { 100.0 * us as f64 / total as f64 };
    let mut keys: Vec<K> = base.keys().chain(new.keys()).copied().collect();
    keys.sort_unstable();
    keys.dedup();
    let mut changes: Vec<(i64, Change)> = keys
        .into_iter()
        .map(|k| {
            let (b, n) = (base.get(&k).copied().unwrap_or(0), new.get(&k).copied().unwrap_or(0));
            let (name, file) = row(k);
            let delta = n as i64 - b as i64;
            let change = Change {
                name,
                file,
                base_seconds: b as f64 / 1e6,
                new_seconds: n as f64 / 1e6,
                seconds: delta as f64 / 1e6,
                change_pct: (b > 0).then(|| 100.0 * delta as f64 / b as f64),
                share_points: share(n, totals.1) - share(b, totals.0),
            };
            (delta, change)
        })
        .collect();
    // Ties keep the keys' order, so the tables are deterministic.
    changes.sort_by_key(|(delta, _)| std::cmp::Reverse(*delta));
    let lost = changes.iter().rev().take_while(|(d, _)| *d < 0).take(TOP).count();
    let lost: Vec<Change> = changes.drain(changes.len() - lost..).rev().map(|(_, c)| c).collect();
    let gained = changes.into_iter().take_while(|(d, _)| *d > 0).take(TOP).map(|(_, c)| c).collect();
    Ranked { gained, lost }
}

/// The differential graph as wide as `second`, coloured by its change from `first`
/// scaled to its total; `negate` when `second` is the base, so red still means grew.
fn graph(first: &ProfileData, second: &ProfileData, by: By, title: &str, negate: bool) -> Option<String> {
    let shown = Shown { by, weight: Weight::Wall };
    let fold = |data: &ProfileData| folded(data, shown, data.samples.iter(), false).join("\n");
    let opts = differential::Options { normalize: true, strip_hex: false };
    let mut lines = Vec::new();
    differential::from_readers(opts, fold(first).as_bytes(), fold(second).as_bytes(), &mut lines).ok()?;
    render(std::str::from_utf8(&lines).ok()?.lines(), title, "μs", negate, None)
}

pub fn diff(base: &ProfileData, new: &ProfileData) -> Diff {
    let tagged = |d: &ProfileData| d.samples.iter().any(|s| s.tag.is_some());
    // Task keys differ from run to run, prefixes do not.
    let by = if tagged(base) || tagged(new) { By::Prefix } else { By::Thread };
    let totals = (base.total_us(), new.total_us());
    let functions = rank(&self_times(base), &self_times(new), totals, |(name, file)| (name.into(), Some(file.into())));
    let prefixes = rank(&prefix_times(base), &prefix_times(new), totals, |prefix| (prefix.into(), None));
    Diff {
        by: by.as_str(),
        base_seconds: totals.0 as f64 / 1e6,
        new_seconds: totals.1 as f64 / 1e6,
        functions,
        prefixes,
        svg: graph(base, new, by, "New profile, coloured by change from the base (red grew, blue shrank)", false),
        base_svg: graph(
            new,
            base,
            by,
            "Base profile, coloured by change to the new one (blue shrank or vanished, red grew)",
            true,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::model::tests::profile;

    fn run(slow: usize) -> ProfileData {
        let mut samples: Vec<(u64, &[&str], Option<&str>)> = vec![(1, &["main", "steady"][..], Some("a-1")); 10];
        samples.extend(vec![(2, &["main", "slow"][..], Some("b-1")); slow]);
        samples.push((3, &["loop"], None));
        profile("w", &samples)
    }

    #[test]
    fn ranks_changes_in_seconds_and_percent() {
        let d = diff(&run(10), &run(30));
        let top = &d.functions.gained[0];
        assert_eq!((top.name.as_str(), top.file.as_deref()), ("slow", Some("slow.py")));
        assert!((top.seconds - 0.2).abs() < 1e-9 && (top.base_seconds - 0.1).abs() < 1e-9);
        assert!((top.change_pct.unwrap() - 200.0).abs() < 1e-9);
        // Shares: slow 10/21 -> 30/41 of the samples.
        assert!((top.share_points - 100.0 * (30.0 / 41.0 - 10.0 / 21.0)).abs() < 1e-9);
        assert_eq!(d.functions.gained.len(), 1, "unchanged rows are neither gained nor lost");
        assert!(d.functions.lost.is_empty());
        assert_eq!(d.prefixes.gained[0].name, "b");
        let back = diff(&run(30), &run(10));
        assert_eq!(back.prefixes.lost[0].name, "b");
        assert!((back.prefixes.lost[0].seconds + 0.2).abs() < 1e-9);
        let vanished = diff(&run(10), &run(0));
        assert_eq!(vanished.functions.lost[0].change_pct, Some(-100.0));
        assert_eq!(diff(&run(0), &run(10)).functions.gained[0].change_pct, None, "no base time: no ratio");
    }

    #[test]
    fn time_outside_tasks_ranks_by_activity() {
        let mut new = run(10);
        new.activities.push("scheduler: task-finished".into());
        new.samples.last_mut().unwrap().activity = Some(0);
        let d = diff(&run(10), &new);
        assert_eq!(d.prefixes.gained[0].name, "scheduler: task-finished");
        assert_eq!(d.prefixes.lost[0].name, NO_TASK, "the base's loop sample had no activity");
    }

    #[test]
    fn graphs_colour_by_scaled_change() {
        let d = diff(&run(10), &run(30));
        assert_eq!(d.by, "prefix");
        let svg = d.svg.unwrap();
        // inferno's differential tooltips: "name (N μs, share%; +change%)".
        assert!(svg.contains("slow (slow.py) (300,000 μs, 73.17%; +25.55%)"), "{svg}");
        assert!(svg.contains("steady (steady.py) (100,000 μs, 24.39%; -23.23%)"));
        assert!(
            d.base_svg.unwrap().contains("slow (slow.py) (100,000 μs, 47.62%; +25.55%)"),
            "negated: red still means grew"
        );
        assert!(diff(&run(10), &profile("w", &[])).svg.is_none(), "nothing to draw as wide as an empty profile");
    }
}
