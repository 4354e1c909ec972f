//! The profile data model shared by the live store, merges and every exporter.
//!
//! Stacks and frames are interned: a sample is a handful of integers, so a window
//! of millions of samples stays small and exporters never re-hash strings.

use crate::profile::intern::{Footprint, Interner};
use crate::profile::sample::Sample;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, HashMap};

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Frame {
    pub name: String,
    /// The Python file, or a native frame's library.
    pub file: String,
    pub line: i32,
    /// Machine code (C, C++, Rust), from the native stack; `file` is its library.
    #[serde(default)]
    pub native: bool,
}

impl Frame {
    pub fn python(name: String, file: String, line: i32) -> Frame {
        Frame { name, file, line, native: false }
    }

    pub fn native(name: String, library: String) -> Frame {
        Frame { name, file: library, line: 0, native: true }
    }
}

/// The dask task a thread was running, as the key's repr and its `key_split` prefix,
/// and the id of the dask span the task belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Tag {
    pub key: String,
    pub prefix: String,
    #[serde(default)]
    pub span: Option<String>,
}

/// A dask span (`distributed.span("load")`): its name path and the ids of the spans
/// on that path, both outermost first; the last id is the span's own.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub names: Vec<String>,
    pub ids: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Thread {
    pub process: u32,
    pub ident: u64,
    pub name: Option<String>,
}

/// One sampled process (a worker, the scheduler, or a plain Python process).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Process {
    pub name: String,
    pub pid: u32,
    pub host: String,
    /// Unique per sampler, so one process reached through two workers is kept once.
    pub token: String,
    pub stats: Value,
}

/// The run's facts. Rust combines `tasks` in merges and adds to `missing` in wire
/// merges; every other key is kept as Python gave it. Python checks the types of
/// them all where a profile is loaded, so any JSON value is kept here as it came.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    /// By process: its tasks' count and seconds by prefix.
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub tasks: Value,
    /// By process left out of the profile: why.
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub missing: Value,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

impl Metadata {
    /// These facts with `extra`'s over them.
    pub fn extend(&mut self, extra: Metadata) {
        if !extra.tasks.is_null() {
            self.tasks = extra.tasks;
        }
        if !extra.missing.is_null() {
            self.missing = extra.missing;
        }
        self.other.extend(extra.other);
    }
}

/// A self-contained profile: what a window export produces and what merges combine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfileData {
    pub frames: Vec<Frame>,
    /// Frame ids, root first.
    pub stacks: Vec<Vec<u32>>,
    pub tags: Vec<Tag>,
    /// Event-loop activities, "scheduler: task-finished".
    #[serde(default)]
    pub activities: Vec<String>,
    /// Times each activity was dispatched in the profile's window, by activity; None
    /// where not counted (a connection's reads), empty where none is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub activity_calls: Vec<Option<u64>>,
    pub threads: Vec<Thread>,
    pub processes: Vec<Process>,
    #[serde(with = "crate::profile::sample::columns")]
    pub samples: Vec<Sample>,
    /// When an aggregated profile's time went, since its samples keep no times: per
    /// thread, tag, activity and 10 s step (or folded bucket), its samples summed into
    /// one with an empty stack. Empty in a raw profile. See `timeline.rs`.
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "crate::profile::sample::columns")]
    pub timeline: Vec<Sample>,
    pub metadata: Metadata,
    /// The spans tags name, by id, as far as known; an unknown id is its own name.
    #[serde(default)]
    pub spans: BTreeMap<String, Span>,
}

impl Footprint for Frame {
    fn heap_bytes(&self) -> usize {
        self.name.len() + self.file.len()
    }
}

impl Footprint for Tag {
    fn heap_bytes(&self) -> usize {
        self.key.len() + self.prefix.len() + self.span.as_ref().map_or(0, |s| s.len())
    }
}

impl Footprint for String {
    fn heap_bytes(&self) -> usize {
        self.len()
    }
}

impl Footprint for Thread {
    fn heap_bytes(&self) -> usize {
        self.name.as_ref().map_or(0, |n| n.len())
    }
}

impl ProfileData {
    /// The span path of `tag`, outermost first: names where known, else the id alone.
    pub fn span_names<'a>(&'a self, tag: &'a Tag) -> Vec<&'a str> {
        match (&tag.span, tag.span.as_ref().and_then(|id| self.spans.get(id))) {
            (_, Some(span)) => span.names.iter().map(String::as_str).collect(),
            (Some(id), None) => vec![id.as_str()],
            (None, None) => Vec::new(),
        }
    }

    /// Names recorded with the samples win, so a reused ident keeps each thread's
    /// own name; a thread recorded without one takes the name Python gives now, or
    /// else the one seen later for its ident, unless that ident was reused under
    /// several names. Then equal threads merge.
    pub fn resolve_thread_names(&mut self, given: impl Fn(u64) -> Option<String>) {
        let mut names: HashMap<(u32, u64), Option<String>> = HashMap::new();
        for t in self.threads.iter().filter(|t| t.name.is_some()) {
            let slot = names.entry((t.process, t.ident)).or_insert_with(|| t.name.clone());
            if *slot != t.name {
                *slot = None;
            }
        }
        let mut ids: Interner<Thread> = Interner::default();
        let remap: Vec<u32> = self
            .threads
            .iter()
            .map(|t| {
                let name = t
                    .name
                    .clone()
                    .or_else(|| given(t.ident))
                    .or_else(|| names.get(&(t.process, t.ident)).cloned().flatten());
                ids.intern(Thread { name, ..t.clone() })
            })
            .collect();
        for s in self.samples.iter_mut().chain(&mut self.timeline) {
            s.thread = remap[s.thread as usize];
        }
        self.threads = ids.into_items();
    }

    /// Per process: whether its time is in timeline cells (it was aggregated) rather
    /// than in its samples' times. A merge can mix both kinds of process.
    pub fn processes_with_cells(&self) -> Vec<bool> {
        let mut celled = vec![false; self.processes.len()];
        for c in &self.timeline {
            celled[self.threads[c.thread as usize].process as usize] = true;
        }
        celled
    }

    /// Every id points into its table, so exporters can index without checks.
    pub fn validate(&self) -> Result<(), String> {
        let frames = self.frames.len() as u32;
        if self.stacks.iter().flatten().any(|&f| f >= frames) {
            return Err("a stack names a frame that does not exist".into());
        }
        let processes = self.processes.len() as u32;
        if self.threads.iter().any(|t| t.process >= processes) {
            return Err("a thread names a process that does not exist".into());
        }
        let (threads, stacks, tags) = (self.threads.len() as u32, self.stacks.len() as u32, self.tags.len() as u32);
        let activities = self.activities.len() as u32;
        let missing = |s: &Sample| {
            s.thread >= threads
                || s.stack >= stacks
                || s.tag.is_some_and(|t| t >= tags)
                || s.activity.is_some_and(|a| a >= activities)
        };
        if self.samples.iter().chain(&self.timeline).any(missing) {
            return Err("a sample names a thread, stack, tag or activity that does not exist".into());
        }
        if !self.activity_calls.is_empty() && self.activity_calls.len() != self.activities.len() {
            return Err("activity calls and activities differ in length".into());
        }
        Ok(())
    }

    /// Approximate memory the profile takes: samples and tables.
    pub fn memory_bytes(&self) -> usize {
        fn table<T: Footprint>(items: &[T]) -> usize {
            items.iter().map(|i| i.heap_bytes() + std::mem::size_of::<T>()).sum()
        }
        let samples = (self.samples.len() + self.timeline.len()) * std::mem::size_of::<Sample>();
        samples
            + table(&self.frames)
            + table(&self.stacks)
            + table(&self.tags)
            + table(&self.activities)
            + std::mem::size_of_val(self.activity_calls.as_slice())
            + table(&self.threads)
    }

    /// Samples taken, counting each aggregated one as the samples it stands for.
    pub fn n_samples(&self) -> u64 {
        self.samples.iter().map(|s| s.count as u64).sum()
    }

    /// Total sampled time in microseconds.
    pub fn total_us(&self) -> u64 {
        self.samples.iter().map(|s| s.weight_us as u64).sum()
    }

    /// Total sampled time in seconds.
    pub fn total_seconds(&self) -> f64 {
        // Summed as integers: exact, and an empty sum is 0.0, not -0.0.
        self.total_us() as f64 / 1e6
    }

    /// A hash of every table and sample, equal only for equal profiles (in any
    /// process running this build).
    pub fn digest(&self) -> String {
        let mut hasher = std::hash::DefaultHasher::new();
        std::hash::Hasher::write(&mut hasher, &serde_json::to_vec(self).expect("profiles serialise"));
        format!("{:016x}", std::hash::Hasher::finish(&hasher))
    }

    /// A copy as another process named `name`, its task keys suffixed with
    /// `key_suffix`: benchmarks build many workers' parts from one real part.
    pub fn as_process(&self, name: &str, key_suffix: &str) -> ProfileData {
        let mut data = self.clone();
        for p in &mut data.processes {
            (p.name, p.token) = (name.to_owned(), format!("{}-{name}", p.token));
        }
        data.tags.iter_mut().for_each(|t| t.key.push_str(key_suffix));
        data
    }

    /// Ids of the spans the samples' tags name, sorted.
    pub fn span_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.tags.iter().filter_map(|t| t.span.clone()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    pub fn thread_label(&self, id: u32) -> String {
        let th = &self.threads[id as usize];
        let process = self.processes.get(th.process as usize).map(|p| p.name.as_str()).unwrap_or("?");
        match &th.name {
            // Worker threads are named with their worker's address already.
            Some(name) if name.starts_with(process) => format!("{name} ({:#x})", th.ident),
            Some(name) => format!("{process} {name} ({:#x})", th.ident),
            None => format!("{process} thread {:#x}", th.ident),
        }
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::profile::build::Builder;
    use crate::profile::sample::FLAG_ACTIVE;

    pub fn frame(name: &str) -> Frame {
        Frame::python(name.into(), format!("{name}.py"), 1)
    }

    /// A one-process profile with the given (thread ident, stack names, tag key) samples.
    pub fn profile(token: &str, samples: &[(u64, &[&str], Option<&str>)]) -> ProfileData {
        let mut b = Builder::default();
        for (i, (ident, names, tag)) in samples.iter().enumerate() {
            let stack = names.iter().map(|n| b.frames.intern(frame(n))).collect();
            let stack = b.stacks.intern(stack);
            let tag = tag
                .map(|k| b.tags.intern(Tag { key: k.into(), prefix: k.split('-').next().unwrap().into(), span: None }));
            let thread = b.threads.intern(Thread { process: 0, ident: *ident, name: Some(format!("T{ident}")) });
            b.samples.push(Sample {
                time_ns: 1_000 + i as u64,
                thread,
                stack,
                tag,
                activity: None,
                weight_us: 10_000,
                cpu_us: 0,
                count: 1,
                flags: FLAG_ACTIVE,
                cover: 0,
            });
        }
        let proc = Process { name: token.into(), pid: 1, host: "h".into(), token: token.into(), stats: Value::Null };
        b.finish(vec![proc], Metadata::default())
    }

    #[test]
    fn interner_dedups() {
        let mut i = Interner::default();
        assert_eq!(i.intern(frame("a")), 0);
        assert_eq!(i.intern(frame("b")), 1);
        assert_eq!(i.intern(frame("a")), 0);
        assert_eq!(i.len(), 2);
    }

    #[test]
    fn merge_remaps_and_dedups_processes() {
        let a = profile("w1", &[(1, &["main", "f"], Some("f-1"))]);
        let b = profile("w2", &[(1, &["main", "g"], None), (2, &["main", "f"], Some("f-1"))]);
        let m = ProfileData::merge(&[&a, &b, &a], Metadata::default());
        assert_eq!(m.processes.len(), 2);
        assert_eq!(m.samples.len(), 3);
        assert_eq!(m.frames.len(), 3);
        assert_eq!(m.tags.len(), 1);
        let names: Vec<_> = m.samples.iter().map(|s| m.thread_label(s.thread)).collect();
        assert!(names.contains(&"w2 T2 (0x2)".to_string()));
        let w2 = m.only_process(1);
        assert_eq!((w2.processes[0].name.as_str(), w2.samples.len(), w2.frames.len()), ("w2", 2, 3));
    }

    /// `profile` with samples in `activities` and their calls.
    fn with_calls(token: &str, activities: &[&str], calls: Vec<Option<u64>>) -> ProfileData {
        let mut p = profile(token, &vec![(1, &["loop"][..], None); activities.len()]);
        p.activities = activities.iter().map(|a| a.to_string()).collect();
        p.samples.iter_mut().enumerate().for_each(|(i, s)| s.activity = Some(i as u32));
        p.activity_calls = calls;
        p
    }

    #[test]
    fn calls_add_up_by_activity_name_across_processes() {
        let a = with_calls("w1", &["w: get_data", "w: reading"], vec![Some(3), None]);
        let b = with_calls("w2", &["w: gather", "w: get_data"], vec![Some(5), Some(4)]);
        let plain = profile("w3", &[(1, &["f"], None)]);
        let m = ProfileData::merge(&[&a, &b, &a, &plain], Metadata::default());
        let calls =
            |p: &ProfileData, name: &str| p.activity_calls[p.activities.iter().position(|a| a == name).unwrap()];
        assert_eq!(calls(&m, "w: get_data"), Some(7), "a process seen twice counts once");
        assert_eq!((calls(&m, "w: gather"), calls(&m, "w: reading")), (Some(5), None));
        assert!(m.validate().is_ok());
        let aggregated = m.aggregated(false);
        assert_eq!(calls(&aggregated, "w: get_data"), Some(7));
        assert!(m.only_process(0).activity_calls.is_empty(), "calls are not kept by process");
        assert_eq!(calls(&a.only_process(0), "w: get_data"), Some(3));
        assert!(m.filtered(|_| true).activity_calls.is_empty());
        assert!(ProfileData::merge(&[&plain], Metadata::default()).activity_calls.is_empty());
    }

    #[test]
    fn thread_names_resolve_and_merge() {
        let mut p = profile("w", &[(1, &["a"], None), (1, &["a"], None), (2, &["a"], None)]);
        p.threads[0].name = None; // py-spy had not named thread 1 yet
        p.threads.push(Thread { process: 0, ident: 1, name: Some("late".into()) });
        p.samples[1].thread = 2;
        p.samples.push(Sample { thread: 1, ..p.samples[2] });
        p.threads.push(Thread { process: 0, ident: 2, name: None });
        p.samples[3].thread = 3;
        p.resolve_thread_names(|ident| (ident == 2).then(|| "given".to_string()));
        let names: Vec<_> = p.samples.iter().map(|s| p.threads[s.thread as usize].name.clone().unwrap()).collect();
        // Recorded names win (ident 2 was recorded as T2 once); the given one fills a gap.
        assert_eq!(names, ["late", "late", "T2", "given"]);
        assert_eq!(p.threads.len(), 3);
    }

    #[test]
    fn merging_threads_by_name_keeps_timeline_cells_valid() {
        // Thread 1 first unnamed, then named: an export of an aggregated window merges
        // them after its cells name both.
        let mut p = profile("w", &[(1, &["a"], None), (1, &["a"], None)]);
        p.threads[0].name = None;
        p.threads.push(Thread { process: 0, ident: 1, name: Some("late".into()) });
        p.samples[1].thread = 1;
        let mut aggregated = p.aggregated(false);
        assert!(aggregated.timeline.iter().any(|c| c.thread == 1));
        aggregated.resolve_thread_names(|_| None);
        assert_eq!(aggregated.threads.len(), 1);
        assert!(aggregated.validate().is_ok() && aggregated.timeline.iter().all(|c| c.thread == 0));
    }

    #[test]
    fn aggregating_caps_cpu_per_sample() {
        let mut p = profile("w", &[(1, &["f"], None), (1, &["f"], None)]);
        p.samples[0].cpu_us = 25_000; // a late tick's CPU, over its 10 ms share
        p.samples[1].cpu_us = 2_000;
        let aggregated = p.aggregated(false);
        assert_eq!(aggregated.samples.len(), 1);
        assert_eq!(aggregated.samples[0].cpu_us, 12_000, "10 ms capped + 2 ms, not min(27, 20) ms");
    }

    /// The JSON form `.pyspy.gz` files hold (the wire form is tested in `wire.rs`).
    #[test]
    fn json_form_round_trip() {
        let a = profile("w1", &[(1, &["main", "f"], Some("f-1"))]);
        let json = serde_json::to_string(&a).unwrap();
        assert!(json.contains(r#""time_delta_ns":[1000]"#), "{json}");
        let back: ProfileData = serde_json::from_str(&json).unwrap();
        assert_eq!(back, a);
        assert!(back.validate().is_ok());
        let mut broken = a.clone();
        broken.samples[0].stack = 9;
        assert!(broken.validate().unwrap_err().contains("stack"));
        let uneven = json.replace(r#""flags":[1]"#, r#""flags":[1,1]"#);
        assert!(serde_json::from_str::<ProfileData>(&uneven).is_err());
        assert!(!json.contains("activity_calls"), "absent where none is known, as in older files");
        let counted = with_calls("w", &["w: get_data", "w: reading"], vec![Some(3), None]);
        let back: ProfileData = serde_json::from_str(&serde_json::to_string(&counted).unwrap()).unwrap();
        assert_eq!(back, counted);
        let mut uneven = counted;
        uneven.activity_calls.pop();
        assert!(uneven.validate().unwrap_err().contains("calls"));
    }
}
