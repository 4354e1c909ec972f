//! Building profiles from others: copying the samples a window, a filter or a merge
//! keeps, re-interning only the frames, stacks, tags and threads they use, and
//! aggregating samples that differ only in time.

use crate::profile::intern::Interner;
use crate::profile::model::{Frame, Metadata, Process, ProfileData, Span, Tag, Thread};
use crate::profile::sample::{Sample, COVER_NS};
use rustc_hash::FxHashMap;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// Copies samples from one set of tables into another, re-interning only what they use.
///
/// Used for window exports (live store -> profile), compaction and merges.
#[derive(Debug, Default)]
pub struct Builder {
    pub frames: Interner<Frame>,
    pub stacks: Interner<Vec<u32>>,
    pub tags: Interner<Tag>,
    pub activities: Interner<String>,
    /// Calls by activity id, where known; may be shorter than `activities`.
    pub activity_calls: Vec<Option<u64>>,
    pub threads: Interner<Thread>,
    pub samples: Vec<Sample>,
    /// An aggregated profile's timeline (`ProfileData::timeline`).
    pub timeline: Vec<Sample>,
}

/// Where `Builder::aggregate_sample` keeps each aggregated sample. Unless `keys`, task keys
/// merge into their prefix, so an aggregated profile grows with distinct stacks, not
/// with tasks. An aggregated sample keeps the time of its first; when the time went is
/// kept in the timeline's cells, summed per `CELL_NS` step, except for the processes
/// `celled` marks (aggregated already: their source's cells are copied instead).
#[derive(Default)]
pub struct Aggregator {
    pub keys: bool,
    /// By process index in the source; empty when none is.
    pub celled: Vec<bool>,
    /// The history's bucket step, where the samples come from a store (see `cell_of`).
    pub folded_step_ns: u64,
    index: FxHashMap<Kept, usize>,
    cells: FxHashMap<Cell, usize>,
    empty_stack: Option<u32>,
}

/// Thread and stack, tag and activity (see `ids`), flags: what an aggregated sample
/// keeps apart.
pub type Kept = (u64, u64, u8);

/// Thread and tag, activity and whether it holds folded rows' parts, step start: what
/// a timeline cell keeps apart.
pub type Cell = (u64, u64, u64);

/// Two ids in a word (None: u32::MAX, which no table's index reaches): aggregating a day
/// hashes millions of samples, and two words hash in a third of the time of the fields.
fn ids(a: Option<u32>, b: Option<u32>) -> u64 {
    u64::from(a.unwrap_or(u32::MAX)) << 32 | u64::from(b.unwrap_or(u32::MAX))
}

/// The timeline cell `s` goes to: a raw sample to the `CELL_NS` step it fell in; a
/// folded row's part (or a cell of them) to the bucket of `folded_step_ns` it lies in,
/// so a bucket's rows make one cell per thread, tag and activity, reaching from the
/// first's start to the last's end, not one per 10 s their starts fall in.
fn cell_of(s: &Sample, folded_step_ns: u64) -> (u64, bool) {
    let folded = s.extent().is_some();
    let step = if folded { folded_step_ns.max(CELL_NS) } else { CELL_NS };
    (s.time_ns - s.time_ns % step, folded)
}

/// The step of an aggregated profile's timeline cells: a 24 h timeline's default step
/// is 5 minutes, a 10-minute one's 2 s, so 10 s keeps both readable while a worker's
/// cells stay a few per thread and prefix a minute.
pub const CELL_NS: u64 = 10_000_000_000;

impl Aggregator {
    /// The aggregated sample `s` goes to.
    pub fn kept(s: &Sample) -> Kept {
        (ids(Some(s.thread), Some(s.stack)), ids(s.tag, s.activity), s.flags)
    }

    /// The timeline cell `s` goes to (see `cell_of`).
    pub fn cell(s: &Sample, folded_step_ns: u64) -> Cell {
        let (start, folded) = cell_of(s, folded_step_ns);
        (ids(Some(s.thread), s.tag), ids(s.activity, Some(folded.into())), start)
    }

    fn tag(tag: &Tag, keys: bool) -> Tag {
        match keys {
            true => tag.clone(),
            false => Tag { key: tag.prefix.clone(), ..tag.clone() },
        }
    }
}

/// The time and count a sample stands for, which aggregating sums: wall and CPU
/// microseconds, and samples.
pub trait Summed {
    fn sums(&mut self) -> [&mut u32; 3];

    /// Takes in what else `other` keeps of where its time went.
    fn widen(&mut self, _other: &Self) {}
}

impl Summed for Sample {
    fn sums(&mut self) -> [&mut u32; 3] {
        [&mut self.weight_us, &mut self.cpu_us, &mut self.count]
    }

    /// Samples summed share their time (a cell's step), and cover the longer of theirs;
    /// folded rows' parts summed cover from the first's start to the last's end.
    fn widen(&mut self, other: &Sample) {
        match (self.extent(), other.extent()) {
            (Some((a, b)), Some((c, d))) => {
                let (from, to) = (a.min(c), b.max(d));
                self.time_ns = from;
                self.cover = (to - from).div_ceil(COVER_NS).min(u16::MAX.into()) as u16;
            }
            _ => self.cover = self.cover.max(other.cover),
        }
    }
}

/// Sums `s` into `samples[*slot]`; when that is none or full, pushes it and points
/// `slot` at it, so a long window's time goes on in a fresh sample.
pub fn sum_into<T: Summed>(samples: &mut Vec<T>, slot: &mut usize, mut s: T) {
    if let Some(into) = samples.get_mut(*slot) {
        let ([weight, cpu, count], [add_weight, add_cpu, add_count]) = (into.sums(), s.sums());
        if let (Some(w), Some(n)) = (weight.checked_add(*add_weight), count.checked_add(*add_count)) {
            (*weight, *cpu, *count) = (w, cpu.saturating_add(*add_cpu), n);
            into.widen(&s);
            return;
        }
    }
    *slot = samples.len();
    samples.push(s);
}

/// Maps ids of one source's tables to the builder's, filled lazily.
pub struct Remap {
    frames: Vec<Option<u32>>,
    stacks: Vec<Option<u32>>,
    tags: Vec<Option<u32>>,
    activities: Vec<Option<u32>>,
    threads: Vec<Option<u32>>,
}

/// Read access to a source's tables, so the live store and a ProfileData share one copier.
pub trait Tables {
    fn frame(&self, id: u32) -> &Frame;
    fn stack(&self, id: u32) -> &[u32];
    fn tag(&self, id: u32) -> &Tag;
    fn activity(&self, id: u32) -> &String;
    fn thread(&self, id: u32) -> &Thread;
    fn counts(&self) -> [usize; 5];
}

impl Remap {
    pub fn for_source(src: &impl Tables) -> Remap {
        let [f, s, t, a, th] = src.counts();
        Remap {
            frames: vec![None; f],
            stacks: vec![None; s],
            tags: vec![None; t],
            activities: vec![None; a],
            threads: vec![None; th],
        }
    }
}

fn remapped(slot: &mut Option<u32>, make: impl FnOnce() -> u32) -> u32 {
    *slot.get_or_insert_with(make)
}

impl Builder {
    /// Adds `sample` from `src`; `process` overrides the thread's process index when merging.
    pub fn copy_sample(&mut self, src: &impl Tables, map: &mut Remap, sample: &Sample, process: Option<u32>) {
        let copied = self.remap(src, map, sample, process, |tag| tag.clone());
        self.samples.push(copied);
    }

    /// Adds the samples and timeline cells of `src` that `place` places: None leaves one
    /// out, `Some(process)` copies it as `copy_sample` does.
    pub fn copy_from(&mut self, src: &ProfileData, map: &mut Remap, place: impl Fn(&Sample) -> Option<Option<u32>>) {
        for s in &src.samples {
            if let Some(process) = place(s) {
                self.copy_sample(src, map, s, process);
            }
        }
        for c in &src.timeline {
            if let Some(process) = place(c) {
                let copied = self.remap(src, map, c, process, |tag| tag.clone());
                self.timeline.push(copied);
            }
        }
    }

    /// Adds `sample` from `src` into the sample of `aggregator` with the same thread,
    /// stack, task prefix, span and state.
    pub fn aggregate_sample(
        &mut self,
        src: &impl Tables,
        map: &mut Remap,
        sample: &Sample,
        aggregator: &mut Aggregator,
    ) {
        let keys = aggregator.keys;
        let mut s = self.remap(src, map, sample, None, |t| Aggregator::tag(t, keys));
        // Capped per sample, as views cap it (`Weight::Cpu`): the aggregate then sums what the
        // raw samples show, where capping the sum would let one sample's excess fill
        // another's gap.
        s.cpu_us = s.cpu_us.min(s.weight_us);
        let slot = aggregator.index.entry(Aggregator::kept(&s)).or_insert(usize::MAX);
        sum_into(&mut self.samples, slot, Sample { cover: 0, ..s }); // its time says little once summed
        if aggregator.celled.get(src.thread(sample.thread).process as usize).copied().unwrap_or(false) {
            return;
        }
        // A raw sample's cell starts at its step; a folded row's part keeps where it went.
        let time_ns = if s.extent().is_some() { s.time_ns } else { s.time_ns - s.time_ns % CELL_NS };
        self.sum_cell(Sample { time_ns, ..s }, aggregator);
    }

    /// Adds timeline cell `cell` from `src` into the cell of `aggregator` with the same
    /// thread, tag, activity and step.
    pub fn aggregate_cell(&mut self, src: &impl Tables, map: &mut Remap, cell: &Sample, aggregator: &mut Aggregator) {
        let keys = aggregator.keys;
        let cell = self.remap(src, map, cell, None, |t| Aggregator::tag(t, keys));
        self.sum_cell(cell, aggregator);
    }

    /// Sums `s` into its timeline cell; cells have no stack and no state.
    fn sum_cell(&mut self, s: Sample, aggregator: &mut Aggregator) {
        let stack = *aggregator.empty_stack.get_or_insert_with(|| self.stacks.intern(Vec::new()));
        let slot = aggregator.cells.entry(Aggregator::cell(&s, aggregator.folded_step_ns)).or_insert(usize::MAX);
        sum_into(&mut self.timeline, slot, Sample { stack, flags: 0, ..s });
    }

    /// `sample` with its ids in this builder's tables, interning what it uses; `tag`
    /// makes the tag to intern from the source's.
    fn remap(
        &mut self,
        src: &impl Tables,
        map: &mut Remap,
        sample: &Sample,
        process: Option<u32>,
        tag: impl Fn(&Tag) -> Tag,
    ) -> Sample {
        let stack = remapped(&mut map.stacks[sample.stack as usize], || {
            let frames = src
                .stack(sample.stack)
                .iter()
                .map(|&f| remapped(&mut map.frames[f as usize], || self.frames.intern(src.frame(f).clone())))
                .collect();
            self.stacks.intern(frames)
        });
        let tag = sample.tag.map(|t| remapped(&mut map.tags[t as usize], || self.tags.intern(tag(src.tag(t)))));
        let activity = sample
            .activity
            .map(|a| remapped(&mut map.activities[a as usize], || self.activities.intern(src.activity(a).clone())));
        let thread = remapped(&mut map.threads[sample.thread as usize], || {
            let mut th = src.thread(sample.thread).clone();
            th.process = process.unwrap_or(th.process);
            self.threads.intern(th)
        });
        Sample { stack, tag, activity, thread, ..*sample }
    }

    /// Adds `calls` to activity `name`'s, interning it.
    pub fn add_calls(&mut self, name: &str, calls: u64) {
        let id = self.activities.find_str(name).unwrap_or_else(|| self.activities.intern(name.into())) as usize;
        if self.activity_calls.len() <= id {
            self.activity_calls.resize(id + 1, None);
        }
        let slot = &mut self.activity_calls[id];
        *slot = Some(slot.unwrap_or(0) + calls);
    }

    /// Adds every call count `src` knows, by activity name.
    pub fn add_calls_of(&mut self, src: &ProfileData) {
        for (name, calls) in src.activities.iter().zip(&src.activity_calls) {
            if let Some(calls) = *calls {
                self.add_calls(name, calls);
            }
        }
    }

    pub fn finish(self, processes: Vec<Process>, metadata: Metadata) -> ProfileData {
        let mut activity_calls = self.activity_calls;
        if activity_calls.iter().all(Option::is_none) {
            activity_calls.clear();
        } else {
            activity_calls.resize(self.activities.len(), None);
        }
        ProfileData {
            frames: self.frames.into_items(),
            stacks: self.stacks.into_items(),
            tags: self.tags.into_items(),
            activities: self.activities.into_items(),
            activity_calls,
            threads: self.threads.into_items(),
            processes,
            samples: self.samples,
            timeline: self.timeline,
            metadata,
            spans: BTreeMap::new(),
        }
    }
}

/// Merges profiles one at a time, so each can be dropped once added. Samples keep
/// each part's order (time order within a process); parts are not interleaved.
#[derive(Default)]
pub struct Merger {
    out: Builder,
    processes: Vec<Process>,
    spans: BTreeMap<String, Span>,
    tasks: Map<String, Value>,
}

impl Merger {
    /// Room for `samples` more samples, so the merged column is not copied as it grows.
    pub fn reserve(&mut self, samples: usize) {
        self.out.samples.reserve(samples);
    }

    pub fn add(&mut self, part: &ProfileData) {
        let mut map = Remap::for_source(part);
        let mut offsets = Vec::with_capacity(part.processes.len());
        for p in &part.processes {
            let known = self.processes.iter().any(|q| q.token == p.token);
            offsets.push((!known).then_some(self.processes.len() as u32));
            if !known {
                self.processes.push(p.clone());
            }
        }
        self.out.copy_from(part, &mut map, |s| offsets[part.threads[s.thread as usize].process as usize].map(Some));
        // Calls are by name, not by process: a part with a process seen already (reached
        // through two workers) would count that process's calls twice.
        if offsets.iter().all(Option::is_some) {
            self.out.add_calls_of(part);
        }
        self.spans.extend(part.spans.iter().map(|(id, s)| (id.clone(), s.clone())));
        if let Value::Object(tasks) = &part.metadata.tasks {
            self.tasks.extend(tasks.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
    }

    /// The merged profile: `metadata`, with the parts' `tasks` (per process) combined.
    pub fn finish(self, mut metadata: Metadata) -> ProfileData {
        let mut tasks = self.tasks;
        match std::mem::take(&mut metadata.tasks) {
            Value::Object(given) => {
                tasks.extend(given);
                metadata.tasks = Value::Object(tasks);
            }
            other if tasks.is_empty() => metadata.tasks = other,
            _ => metadata.tasks = Value::Object(tasks),
        }
        let mut merged = self.out.finish(self.processes, metadata);
        merged.spans = self.spans;
        merged
    }
}

impl Tables for ProfileData {
    fn frame(&self, id: u32) -> &Frame {
        &self.frames[id as usize]
    }
    fn stack(&self, id: u32) -> &[u32] {
        &self.stacks[id as usize]
    }
    fn tag(&self, id: u32) -> &Tag {
        &self.tags[id as usize]
    }
    fn activity(&self, id: u32) -> &String {
        &self.activities[id as usize]
    }
    fn thread(&self, id: u32) -> &Thread {
        &self.threads[id as usize]
    }
    fn counts(&self) -> [usize; 5] {
        [self.frames.len(), self.stacks.len(), self.tags.len(), self.activities.len(), self.threads.len()]
    }
}

impl Tables for Builder {
    fn frame(&self, id: u32) -> &Frame {
        self.frames.get(id)
    }
    fn stack(&self, id: u32) -> &[u32] {
        self.stacks.get(id)
    }
    fn tag(&self, id: u32) -> &Tag {
        self.tags.get(id)
    }
    fn activity(&self, id: u32) -> &String {
        self.activities.get(id)
    }
    fn thread(&self, id: u32) -> &Thread {
        self.threads.get(id)
    }
    fn counts(&self) -> [usize; 5] {
        [self.frames.len(), self.stacks.len(), self.tags.len(), self.activities.len(), self.threads.len()]
    }
}

impl ProfileData {
    /// Combines profiles of several processes; a process seen twice (same token) is kept once.
    pub fn merge(parts: &[&ProfileData], metadata: Metadata) -> ProfileData {
        let mut merger = Merger::default();
        for part in parts {
            merger.add(part);
        }
        merger.finish(metadata)
    }

    /// The samples of one process only; calls, which are not kept by process, only
    /// where it is the only one.
    pub fn only_process(&self, process: u32) -> ProfileData {
        let mut out = Builder::default();
        let mut map = Remap::for_source(self);
        out.copy_from(self, &mut map, |s| (self.threads[s.thread as usize].process == process).then_some(Some(0)));
        if self.processes.len() == 1 {
            out.add_calls_of(self);
        }
        let mut one = out.finish(vec![self.processes[process as usize].clone()], self.metadata.clone());
        one.spans = self.spans.clone();
        one
    }

    /// The same totals in fewer samples, not in time order (see `Aggregator`).
    pub fn aggregated(&self, keys: bool) -> ProfileData {
        let mut out = Builder::default();
        let mut map = Remap::for_source(self);
        let mut aggregator = Aggregator { keys, celled: self.processes_with_cells(), ..Aggregator::default() };
        for s in &self.samples {
            out.aggregate_sample(self, &mut map, s, &mut aggregator);
        }
        for c in &self.timeline {
            out.aggregate_cell(self, &mut map, c, &mut aggregator);
        }
        out.add_calls_of(self);
        let mut aggregated = out.finish(self.processes.clone(), self.metadata.clone());
        aggregated.spans = self.spans.clone();
        aggregated
    }

    /// The profile with the native frames left out of its stacks: the Python-only picture.
    pub fn python_only(&self) -> ProfileData {
        let mut stacks: Interner<Vec<u32>> = Interner::default();
        let python = |s: &Vec<u32>| s.iter().copied().filter(|&f| !self.frames[f as usize].native).collect();
        let ids: Vec<u32> = self.stacks.iter().map(|s| stacks.intern(python(s))).collect();
        let mut out = self.clone();
        out.stacks = stacks.into_items();
        for s in out.samples.iter_mut().chain(out.timeline.iter_mut()) {
            s.stack = ids[s.stack as usize];
        }
        out
    }

    /// The samples `keep` keeps, with every process and span; no calls, which a
    /// selection of samples does not select.
    pub fn filtered(&self, keep: impl Fn(&Sample) -> bool) -> ProfileData {
        let mut out = Builder::default();
        let mut map = Remap::for_source(self);
        out.copy_from(self, &mut map, |s| keep(s).then_some(None));
        let mut kept = out.finish(self.processes.clone(), self.metadata.clone());
        kept.spans = self.spans.clone();
        kept
    }
}
