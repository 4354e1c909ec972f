//! Memory per task as files and graphs: each process's allocation sites (a task prefix,
//! a Python stack, and the bytes and objects it allocated and holds) as speedscope
//! (bytes in use and bytes allocated, a profile each per process), pprof
//! (`alloc_objects`, `alloc_space`, `inuse_objects`, `inuse_space`, labelled with the
//! task prefix and the process) and a flame graph of bytes in use.
//!
//! Every stack is rooted at its task prefix, as the CPU views root a task's stacks.

use crate::formats::pprof::{locations, proto, Strings};
use crate::formats::speedscope::TASK_FILE;
use crate::formats::{compress, flamegraph};
use crate::heap::sites::SMALLER;
use crate::profile::model::Frame;
use crate::profile::views::is_machinery;
use prost::Message;
use rustc_hash::FxHashMap;
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeMap;

/// How views name allocations made outside any task (prefix None).
pub const OUTSIDE: &str = "(outside tasks)";
/// The file of the frames that stand for a row without a stack ("(smaller stacks)").
const NOTE_FILE: &str = "dask-pyspy";

/// One site as `live::SiteRow` exports it: frames root first; without frames, `note`
/// says what the row stands for.
#[derive(Debug, Deserialize)]
pub struct Site {
    pub prefix: Option<String>,
    #[serde(default)]
    pub frames: Vec<Frame>,
    #[serde(default)]
    pub note: Option<String>,
    pub allocated: f64,
    pub in_use: f64,
    #[serde(default)]
    pub allocated_objects: f64,
    #[serde(default)]
    pub in_use_objects: f64,
}

/// What one process counted; only its sites are read here.
#[derive(Debug, Default, Deserialize)]
pub struct Counted {
    #[serde(default)]
    pub sites: Vec<Site>,
}

/// Sites by process name.
pub type Processes = BTreeMap<String, Counted>;

impl Site {
    fn prefix_name(&self) -> &str {
        self.prefix.as_deref().unwrap_or(OUTSIDE)
    }

    /// Its frames, a task's cut to the task's own code as the CPU views cut them (the
    /// leaf stays where all are the machinery's).
    fn task_frames(&self) -> &[Frame] {
        if self.prefix.is_none() {
            return &self.frames;
        }
        let own = self.frames.iter().position(|f| !is_machinery(f));
        &self.frames[own.unwrap_or(self.frames.len().saturating_sub(1))..]
    }

    /// What a row without frames stands for, as its one frame is named.
    fn note_name(&self) -> Option<String> {
        self.note.as_ref().filter(|_| self.frames.is_empty()).map(|n| format!("({n})"))
    }

    /// The frames shown for this site, root first: its prefix, its stack or its note.
    fn shown(&self) -> impl Iterator<Item = Frame> + '_ {
        let prefix = Frame::python(self.prefix_name().into(), TASK_FILE.into(), 0);
        let note = self.note_name().map(|n| Frame::python(n, NOTE_FILE.into(), 0));
        std::iter::once(prefix).chain(self.frames.iter().cloned()).chain(note)
    }
}

/// Frames interned in first-seen order, and each site's stack as indices, root first.
struct Interned {
    frames: Vec<Frame>,
    stacks: Vec<Vec<u32>>,
}

fn intern<'a>(sites: impl Iterator<Item = &'a Site>) -> Interned {
    let mut ids: FxHashMap<Frame, u32> = FxHashMap::default();
    let mut frames = Vec::new();
    let mut stack_of = |site: &Site| -> Vec<u32> {
        site.shown()
            .map(|f| {
                *ids.entry(f.clone()).or_insert_with(|| {
                    frames.push(f);
                    frames.len() as u32 - 1
                })
            })
            .collect()
    };
    let stacks = sites.map(&mut stack_of).collect();
    Interned { frames, stacks }
}

/// A site's value in one view.
type Value = fn(&Site) -> f64;
/// Each process's speedscope profiles, in order.
const VIEWS: [(&str, Value); 2] = [("bytes in use", |s| s.in_use), ("bytes allocated", |s| s.allocated)];

/// The speedscope document: per process, bytes in use then bytes allocated; it opens
/// on the process holding most.
pub fn speedscope(processes: &Processes, name: &str) -> Vec<u8> {
    let all: Vec<(&str, &Site)> =
        processes.iter().flat_map(|(p, c)| c.sites.iter().map(move |s| (p.as_str(), s))).collect();
    let interned = intern(all.iter().map(|(_, s)| *s));
    let mut profiles = Vec::new();
    let mut held_most = (0.0, 0);
    for process in processes.keys() {
        let of_process: Vec<usize> = (0..all.len()).filter(|&i| all[i].0 == process).collect();
        for (what, value) in VIEWS {
            let kept: Vec<usize> = of_process.iter().copied().filter(|&i| value(all[i].1) >= 0.5).collect();
            let weights: Vec<f64> = kept.iter().map(|&i| value(all[i].1).round()).collect();
            let total: f64 = weights.iter().sum();
            if what == "bytes in use" && total > held_most.0 {
                held_most = (total, profiles.len());
            }
            profiles.push(json!({
                "type": "sampled",
                "name": format!("{process}: {what}"),
                "unit": "bytes",
                "startValue": 0,
                "endValue": total,
                "samples": kept.iter().map(|&i| &interned.stacks[i]).collect::<Vec<_>>(),
                "weights": weights,
            }));
        }
    }
    let frames: Vec<_> = interned
        .frames
        .iter()
        .map(|f| {
            if f.line > 0 {
                json!({"name": f.name, "file": f.file, "line": f.line})
            } else {
                json!({"name": f.name, "file": f.file})
            }
        })
        .collect();
    let doc = json!({
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": profiles,
        "name": name,
        "activeProfileIndex": held_most.1,
        "exporter": format!("dask-pyspy {}", env!("CARGO_PKG_VERSION")),
    });
    serde_json::to_vec(&doc).expect("JSON values serialise")
}

/// The pprof profile, gzipped: one sample per site, valued in objects and bytes
/// allocated and in use (`go tool pprof -sample_index=inuse_space` shows what is held).
pub fn pprof(processes: &Processes) -> Vec<u8> {
    let mut strings = Strings::new();
    let sample_type: Vec<_> =
        [("alloc_objects", "count"), ("alloc_space", "bytes"), ("inuse_objects", "count"), ("inuse_space", "bytes")]
            .into_iter()
            .map(|(kind, unit)| strings.value_type(kind, unit))
            .collect();
    let all: Vec<(&str, &Site)> =
        processes.iter().flat_map(|(p, c)| c.sites.iter().map(move |s| (p.as_str(), s))).collect();
    let interned = intern(all.iter().map(|(_, s)| *s));
    let (function, location, mapping) = locations(&interned.frames, &mut strings);
    let sample = all
        .iter()
        .zip(&interned.stacks)
        .map(|((process, site), stack)| {
            let values = [site.allocated_objects, site.allocated, site.in_use_objects, site.in_use];
            let prefix = site.prefix_name();
            proto::Sample {
                // Leaf first, below the prefix's frame (which the label names too).
                location_id: stack.iter().skip(1).rev().map(|&f| f as u64 + 1).collect(),
                value: values.iter().map(|v| v.round() as i64).collect(),
                label: vec![strings.label("task_prefix", prefix), strings.label("process", process)],
            }
        })
        .collect();
    let profile = proto::Profile {
        default_sample_type: sample_type[3].r#type,
        period_type: Some(sample_type[1].clone()),
        sample_type,
        sample,
        mapping,
        location,
        function,
        string_table: strings.table,
        time_nanos: 0,
        duration_nanos: 0,
    };
    compress::kept(&profile.encode_to_vec())
}

/// Stacks holding less than this share of the graph's bytes are summed under their
/// prefix: a sliver would set the graph's height without being readable.
const SMALLEST_SHARE: f64 = 0.005;

/// Folded stacks (`prefix;...;leaf bytes`) of the bytes in use, task stacks cut to
/// the task's code, slivers summed under their prefix.
fn folded(processes: &Processes) -> Vec<String> {
    let sites: Vec<&Site> = processes.values().flat_map(|c| &c.sites).filter(|s| s.in_use >= 1.0).collect();
    let least = SMALLEST_SHARE * sites.iter().map(|s| s.in_use).sum::<f64>();
    let mut folded: BTreeMap<String, f64> = BTreeMap::new();
    for site in sites {
        let mut line = vec![flamegraph::clean(site.prefix_name())];
        if site.in_use < least {
            line.push(flamegraph::clean(&format!("({SMALLER})")));
        } else {
            line.extend(site.task_frames().iter().map(|f| flamegraph::label(f, true)));
            line.extend(site.note_name().map(|n| flamegraph::clean(&n)));
        }
        *folded.entry(line.join(";")).or_default() += site.in_use;
    }
    folded.into_iter().map(|(stack, bytes)| format!("{stack} {}", bytes.round())).collect()
}

/// A flame graph of the bytes in use by task prefix, over every process (`folded`);
/// None when nothing is held.
pub fn flamegraph_svg(processes: &Processes, title: &str) -> Option<String> {
    let lines = folded(processes);
    flamegraph::render(lines.iter().map(String::as_str), title, "bytes", false, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn site(prefix: Option<&str>, frames: &[(&str, &str)], in_use: f64, allocated: f64) -> Site {
        Site {
            prefix: prefix.map(Into::into),
            frames: frames.iter().map(|&(name, file)| Frame::python(name.into(), file.into(), 3)).collect(),
            note: frames.is_empty().then(|| SMALLER.into()),
            allocated,
            in_use,
            allocated_objects: allocated / 100.0,
            in_use_objects: in_use / 100.0,
        }
    }

    fn processes() -> Processes {
        let run = ("_run_task", "/site-packages/distributed/worker.py");
        let a = vec![
            site(Some("load"), &[run, ("load", "job.py"), ("read", "io.py")], 3e8, 4e8),
            site(Some("load"), &[], 1e3, 2e3),
            site(None, &[("loop", "/asyncio/base_events.py")], 0.0, 5e6),
        ];
        let b = vec![site(Some("sum"), &[run, ("total", "job.py")], 5e8, 5e8)];
        [("worker a".to_string(), Counted { sites: a }), ("worker b".to_string(), Counted { sites: b })].into()
    }

    #[test]
    fn speedscope_has_bytes_in_use_and_allocated_per_process_and_opens_on_the_largest() {
        let doc: Value = serde_json::from_slice(&speedscope(&processes(), "m")).unwrap();
        let names: Vec<&str> =
            doc["profiles"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            [
                "worker a: bytes in use", "worker a: bytes allocated", "worker b: bytes in use",
                "worker b: bytes allocated"
            ]
        );
        assert_eq!(doc["activeProfileIndex"], 2, "worker b holds most");
        let in_use = &doc["profiles"][0];
        assert_eq!(in_use["unit"], "bytes");
        assert_eq!(in_use["endValue"], 3e8 + 1e3, "sites holding nothing are left out");
        let frames = &doc["shared"]["frames"];
        let stack: Vec<&str> = in_use["samples"][0]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| frames[f.as_u64().unwrap() as usize]["name"].as_str().unwrap())
            .collect();
        assert_eq!(stack, ["load", "_run_task", "load", "read"], "rooted at the prefix, whole stacks kept");
        assert_eq!(frames[in_use["samples"][0][0].as_u64().unwrap() as usize]["file"], TASK_FILE);
        let note = in_use["samples"][1].as_array().unwrap();
        assert_eq!(frames[note[1].as_u64().unwrap() as usize]["name"], "(smaller stacks)");
    }

    #[test]
    fn pprof_values_each_site_in_objects_and_bytes_with_its_labels() {
        let bytes = compress::gunzip_at_most(&pprof(&processes()), usize::MAX).unwrap().unwrap();
        let p = proto::Profile::decode(&bytes[..]).unwrap();
        let text = |id: i64| p.string_table[id as usize].as_str();
        let types: Vec<&str> = p.sample_type.iter().map(|t| text(t.r#type)).collect();
        assert_eq!(types, ["alloc_objects", "alloc_space", "inuse_objects", "inuse_space"]);
        assert_eq!(text(p.default_sample_type), "inuse_space");
        assert_eq!(p.sample.len(), 4);
        let s = &p.sample[0];
        assert_eq!(s.value, [4e6 as i64, 4e8 as i64, 3e6 as i64, 3e8 as i64]);
        let labels: Vec<(&str, &str)> = s.label.iter().map(|l| (text(l.key), text(l.str))).collect();
        assert_eq!(labels, [("task_prefix", "load"), ("process", "worker a")]);
        let leaf = p.location.iter().find(|l| l.id == s.location_id[0]).unwrap();
        let function = p.function.iter().find(|f| f.id == leaf.line[0].function_id).unwrap();
        assert_eq!((text(function.name), s.location_id.len()), ("read", 3), "leaf first, below the prefix");
        assert_eq!(text(p.sample[2].label[0].str), OUTSIDE);
    }

    #[test]
    fn the_graph_cuts_task_stacks_to_task_code_and_sums_slivers() {
        let lines = folded(&processes());
        assert_eq!(
            lines,
            [
                "load;(smaller stacks) 1000",
                "load;load (job.py:3);read (io.py:3) 300000000",
                "sum;total (job.py:3) 500000000"
            ],
            "the machinery above a task is cut; what holds nothing is not drawn"
        );
        assert!(flamegraph_svg(&processes(), "held").unwrap().contains("read (io.py:3)"));
        let nothing: Processes = [("w".to_string(), Counted::default())].into();
        assert!(flamegraph_svg(&nothing, "held").is_none());
    }
}
