//! Writer for pprof's format (github.com/google/pprof, proto/profile.proto), gzipped
//! as the format requires on disk. One pprof Sample per distinct (stack, task tag,
//! thread), valued in sample counts, wall nanoseconds and, where measured, CPU
//! nanoseconds; labelled with the task key, prefix and span, the process and thread.
//! One Location per frame (its line), one Function per (name, file).

use crate::formats::compress;
use crate::profile::model::{Frame, ProfileData, Tag};
use crate::profile::sample::State;
use crate::profile::views::Weight;
use prost::Message;
use rustc_hash::FxHashMap;

/// The messages of profile.proto this writer fills, with its field numbers.
pub mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "3")]
        pub mapping: Vec<Mapping>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "9")]
        pub time_nanos: i64,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
        #[prost(message, optional, tag = "11")]
        pub period_type: Option<ValueType>,
        #[prost(int64, tag = "14")]
        pub default_sample_type: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        /// Leaf first.
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
        #[prost(message, repeated, tag = "3")]
        pub label: Vec<Label>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Label {
        #[prost(int64, tag = "1")]
        pub key: i64,
        #[prost(int64, tag = "2")]
        pub str: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Mapping {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "5")]
        pub filename: i64,
        #[prost(bool, tag = "7")]
        pub has_functions: bool,
        #[prost(bool, tag = "8")]
        pub has_filenames: bool,
        #[prost(bool, tag = "9")]
        pub has_line_numbers: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub mapping_id: u64,
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
        #[prost(int64, tag = "2")]
        pub line: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
        #[prost(int64, tag = "3")]
        pub system_name: i64,
        #[prost(int64, tag = "4")]
        pub filename: i64,
    }
}

/// The string table: each string once, "" at index 0 as the format requires.
pub struct Strings {
    pub table: Vec<String>,
    index: FxHashMap<String, i64>,
}

impl Strings {
    pub fn new() -> Self {
        let mut s = Strings { table: Vec::new(), index: FxHashMap::default() };
        s.id("");
        s
    }

    pub fn id(&mut self, text: &str) -> i64 {
        if let Some(&id) = self.index.get(text) {
            return id;
        }
        let id = self.table.len() as i64;
        self.index.insert(text.to_owned(), id);
        self.table.push(text.to_owned());
        id
    }

    pub fn label(&mut self, key: &str, value: &str) -> proto::Label {
        proto::Label { key: self.id(key), str: self.id(value) }
    }

    pub fn value_type(&mut self, kind: &str, unit: &str) -> proto::ValueType {
        proto::ValueType { r#type: self.id(kind), unit: self.id(unit) }
    }
}

/// The Python frames' mapping: it says the frames are symbolized already, so readers
/// do not look for a binary to symbolize them with ("Main binary filename not available").
const MAPPING: proto::Mapping =
    proto::Mapping { id: 1, filename: 0, has_functions: true, has_filenames: true, has_line_numbers: true };

/// Functions, locations and mappings of `frames`: location id = frame index + 1 (ids
/// must be nonzero); a native frame's location is in its library's mapping.
pub fn locations(
    frames: &[Frame],
    strings: &mut Strings,
) -> (Vec<proto::Function>, Vec<proto::Location>, Vec<proto::Mapping>) {
    let mut functions: Vec<proto::Function> = Vec::new();
    let mut mappings = vec![MAPPING];
    let mut libraries: FxHashMap<&str, u64> = FxHashMap::default();
    let mut by_name: FxHashMap<(&str, &str), u64> = FxHashMap::default();
    let locations = frames
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let function_id = *by_name.entry((&f.name, &f.file)).or_insert_with(|| {
                let name = strings.id(&f.name);
                functions.push(proto::Function {
                    id: functions.len() as u64 + 1,
                    name,
                    system_name: name,
                    filename: strings.id(&f.file),
                });
                functions.len() as u64
            });
            let line = vec![proto::Line { function_id, line: f.line.max(0).into() }];
            let mapping_id = match f.native {
                false => MAPPING.id,
                true => *libraries.entry(&f.file).or_insert_with(|| {
                    let id = mappings.len() as u64 + 1;
                    let filename = strings.id(&f.file);
                    mappings.push(proto::Mapping { id, filename, has_line_numbers: false, ..MAPPING });
                    id
                }),
            };
            proto::Location { id: i as u64 + 1, mapping_id, line }
        })
        .collect();
    (functions, locations, mappings)
}

fn tag_labels(data: &ProfileData, tag: &Tag, strings: &mut Strings) -> Vec<proto::Label> {
    let mut labels = vec![strings.label("task_key", &tag.key), strings.label("task_prefix", &tag.prefix)];
    let span = data.span_names(tag);
    if !span.is_empty() {
        labels.push(strings.label("span", &span.join(" / ")));
    }
    labels
}

fn thread_labels(data: &ProfileData, thread: u32, strings: &mut Strings) -> Vec<proto::Label> {
    let process = data.threads[thread as usize].process as usize;
    vec![strings.label("process", &data.processes[process].name), strings.label("thread", &data.thread_label(thread))]
}

/// The profile as pprof messages; `data` must be valid (`ProfileData::validate`).
pub fn build(data: &ProfileData) -> proto::Profile {
    let mut strings = Strings::new();
    let with_cpu = data.samples.iter().any(|s| s.cpu_us > 0);
    let mut sample_type = vec![strings.value_type("samples", "count"), strings.value_type("wall", "nanoseconds")];
    if with_cpu {
        sample_type.push(strings.value_type("cpu", "nanoseconds"));
    }
    let period_type = sample_type[1].clone();
    let (function, location, mapping) = locations(&data.frames, &mut strings);

    // Stack, tag, activity, thread and state: what a pprof sample's labels tell apart.
    type Key = (u32, Option<u32>, Option<u32>, u32, State);
    let mut totals: FxHashMap<Key, [i64; 3]> = FxHashMap::default();
    for s in &data.samples {
        let activity = if s.tag.is_some() { None } else { s.activity };
        let t = totals.entry((s.stack, s.tag, activity, s.thread, State::of(s.flags))).or_default();
        t[0] += s.count as i64;
        t[1] += s.weight_us as i64 * 1000;
        t[2] += Weight::Cpu.of(s) as i64 * 1000;
    }
    let mut keys: Vec<_> = totals.keys().copied().collect();
    keys.sort_unstable();
    let tags: Vec<_> = data.tags.iter().map(|t| tag_labels(data, t, &mut strings)).collect();
    let activities: Vec<_> = data.activities.iter().map(|a| strings.label("activity", a)).collect();
    let threads: Vec<_> = (0..data.threads.len() as u32).map(|t| thread_labels(data, t, &mut strings)).collect();
    let sample = keys
        .into_iter()
        .map(|key @ (stack, tag, activity, thread, state)| {
            let values = &totals[&key][..sample_type.len()];
            let mut label: Vec<_> = tag
                .map_or(&[][..], |t| &tags[t as usize])
                .iter()
                .chain(activity.map(|a| &activities[a as usize]))
                .chain(&threads[thread as usize])
                .cloned()
                .collect();
            label.push(strings.label("thread_state", state.name()));
            let location_id = data.stacks[stack as usize].iter().rev().map(|&f| f as u64 + 1).collect();
            proto::Sample { location_id, value: values.to_vec(), label }
        })
        .collect();

    let first = data.samples.iter().map(|s| s.time_ns).min().unwrap_or(0);
    let last = data.samples.iter().map(|s| s.time_ns).max().unwrap_or(0);
    proto::Profile {
        default_sample_type: period_type.r#type,
        sample_type,
        sample,
        mapping,
        location,
        function,
        string_table: strings.table,
        time_nanos: first as i64,
        duration_nanos: (last - first) as i64,
        period_type: Some(period_type),
    }
}

/// The gzipped protobuf, as `go tool pprof` and other pprof readers open it.
pub fn write(data: &ProfileData) -> Vec<u8> {
    compress::kept(&build(data).encode_to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::model::tests::profile;
    use crate::profile::model::Span;

    fn decode(data: &ProfileData) -> proto::Profile {
        proto::Profile::decode(&compress::gunzip_at_most(&write(data), usize::MAX).unwrap().unwrap()[..]).unwrap()
    }

    fn text(p: &proto::Profile, id: i64) -> &str {
        &p.string_table[id as usize]
    }

    fn labels(p: &proto::Profile, s: &proto::Sample) -> Vec<(String, String)> {
        s.label.iter().map(|l| (text(p, l.key).to_string(), text(p, l.str).to_string())).collect()
    }

    /// Leaf-first function names of a sample.
    fn stack(p: &proto::Profile, s: &proto::Sample) -> Vec<String> {
        s.location_id
            .iter()
            .map(|&id| {
                let loc = p.location.iter().find(|l| l.id == id).unwrap();
                let f = p.function.iter().find(|f| f.id == loc.line[0].function_id).unwrap();
                text(p, f.name).to_string()
            })
            .collect()
    }

    #[test]
    fn samples_aggregate_by_stack_tag_and_thread() {
        let data = profile(
            "w1",
            &[
                (1, &["main", "f"], Some("f-1")),
                (1, &["main", "f"], Some("f-1")),
                (1, &["main", "f"], None),
                (2, &["main", "f"], Some("f-1")),
            ],
        );
        let p = decode(&data);
        assert_eq!(p.string_table[0], "");
        let types: Vec<_> = p.sample_type.iter().map(|t| (text(&p, t.r#type), text(&p, t.unit))).collect();
        assert_eq!(types, [("samples", "count"), ("wall", "nanoseconds")], "no CPU type when none was measured");
        assert_eq!(p.period_type.as_ref().map(|t| text(&p, t.r#type)), Some("wall"));
        assert_eq!((p.time_nanos, p.duration_nanos), (1_000, 3));
        assert_eq!(p.sample.len(), 3);
        let values: Vec<_> = p.sample.iter().map(|s| s.value.clone()).collect();
        assert_eq!(values, [vec![1, 10_000_000], vec![2, 20_000_000], vec![1, 10_000_000]]);
        assert!(p.sample.iter().all(|s| stack(&p, s) == ["f", "main"]), "leaf first");
        assert_eq!(
            labels(&p, &p.sample[1]),
            [
                ("task_key", "f-1"),
                ("task_prefix", "f"),
                ("process", "w1"),
                ("thread", "w1 T1 (0x1)"),
                ("thread_state", "cpu")
            ]
            .map(|(k, v)| (k.into(), v.into()))
        );
        let untagged = labels(&p, &p.sample[0]);
        assert_eq!(
            untagged.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            ["process", "thread", "thread_state"],
            "untagged samples have no task labels"
        );
        let f = &p.function[0];
        assert_eq!((text(&p, f.name), text(&p, f.system_name), text(&p, f.filename)), ("main", "main", "main.py"));
        assert_eq!(p.location.len(), 2);
        assert!(p.location.iter().all(|l| l.line[0].line == 1 && l.mapping_id == 1));
        assert!(p.mapping[0].has_functions);
    }

    #[test]
    fn cpu_time_and_span_labels() {
        let mut data = profile("w1", &[(1, &["main", "f"], Some("f-1")), (1, &["main", "g"], Some("g-1"))]);
        data.samples[0].cpu_us = 7_000;
        data.tags[0].span = Some("s2".into());
        data.tags[1].span = Some("unknown".into());
        data.spans.insert(
            "s2".into(),
            Span { names: vec!["load".into(), "parse".into()], ids: vec!["s1".into(), "s2".into()] },
        );
        let p = decode(&data);
        assert_eq!(p.sample_type.iter().map(|t| text(&p, t.r#type)).collect::<Vec<_>>(), ["samples", "wall", "cpu"]);
        assert_eq!(p.sample[0].value, [1, 10_000_000, 7_000_000]);
        assert_eq!(p.sample[1].value, [1, 10_000_000, 0]);
        let span = |s| labels(&p, s).into_iter().find(|(k, _)| k == "span").map(|(_, v)| v);
        assert_eq!(span(&p.sample[0]).as_deref(), Some("load / parse"));
        assert_eq!(span(&p.sample[1]).as_deref(), Some("unknown"), "an unknown span is named by its id");
        assert_eq!(text(&p, p.default_sample_type), "wall");
    }
}
