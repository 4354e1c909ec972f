//! Writer for speedscope's file format (https://www.speedscope.app/file-format-schema.json):
//! one sampled profile per thread, weights in seconds, stacks root first.

use crate::model::ProfileData;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::str::FromStr;

/// What the synthetic root frame of each sample is, so left-heavy views group by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum By {
    Thread,
    Task,
    Prefix,
}

impl FromStr for By {
    type Err = String;
    fn from_str(s: &str) -> Result<By, String> {
        match s {
            "thread" => Ok(By::Thread),
            "task" => Ok(By::Task),
            "prefix" => Ok(By::Prefix),
            _ => Err(format!("by must be one of 'thread', 'task', 'prefix', got {s:?}")),
        }
    }
}

#[derive(Serialize)]
struct File<'a> {
    #[serde(rename = "$schema")]
    schema: &'static str,
    shared: Shared<'a>,
    profiles: Vec<Profile>,
    name: &'a str,
    #[serde(rename = "activeProfileIndex")]
    active_profile_index: usize,
    exporter: String,
    /// Not read by speedscope; keeps the run's facts with the file.
    #[serde(rename = "x-dask-pyspy")]
    metadata: Value,
}

#[derive(Serialize)]
struct Shared<'a> {
    frames: Vec<SFrame<'a>>,
}

#[derive(Serialize)]
struct SFrame<'a> {
    name: &'a str,
    file: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    line: Option<i32>,
}

#[derive(Serialize)]
struct Profile {
    #[serde(rename = "type")]
    kind: &'static str,
    name: String,
    unit: &'static str,
    #[serde(rename = "startValue")]
    start_value: f64,
    #[serde(rename = "endValue")]
    end_value: f64,
    samples: Vec<Vec<u32>>,
    weights: Vec<f64>,
}

const TASK_FILE: &str = "dask task";

/// Synthetic root frames: one per tag (task) or per prefix, appended after the real frames.
fn root_frames<'a>(data: &'a ProfileData, by: By, frames: &mut Vec<SFrame<'a>>) -> Vec<Option<u32>> {
    let mut by_name: HashMap<&str, u32> = HashMap::new();
    data.tags
        .iter()
        .map(|tag| {
            let name = match by {
                By::Thread => return None,
                By::Task => tag.key.as_str(),
                By::Prefix => tag.prefix.as_str(),
            };
            Some(*by_name.entry(name).or_insert_with(|| {
                frames.push(SFrame { name, file: TASK_FILE, line: None });
                frames.len() as u32 - 1
            }))
        })
        .collect()
}

fn thread_profile(data: &ProfileData, thread: u32, by_tag: &[Option<u32>]) -> Profile {
    let mut samples: Vec<Vec<u32>> = Vec::new();
    let mut weights: Vec<f64> = Vec::new();
    let mut last: Option<(u32, Option<u32>)> = None;
    for s in data.samples.iter().filter(|s| s.thread == thread) {
        let root = s.tag.and_then(|t| by_tag[t as usize]);
        let weight = s.weight_us as f64 / 1e6;
        // Consecutive identical samples merge into one longer one: same picture, smaller file.
        if last == Some((s.stack, root)) {
            *weights.last_mut().unwrap() += weight;
            continue;
        }
        last = Some((s.stack, root));
        samples.push(root.into_iter().chain(data.stacks[s.stack as usize].iter().copied()).collect());
        weights.push(weight);
    }
    let total: f64 = weights.iter().sum();
    Profile {
        kind: "sampled",
        name: data.thread_label(thread),
        unit: "seconds",
        start_value: 0.0,
        end_value: total,
        samples,
        weights,
    }
}

pub fn write(data: &ProfileData, by: By, name: &str) -> Vec<u8> {
    let mut frames: Vec<SFrame> = data
        .frames
        .iter()
        .map(|f| SFrame { name: &f.name, file: &f.file, line: (f.line > 0).then_some(f.line) })
        .collect();
    let by_tag = root_frames(data, by, &mut frames);
    let mut threads: Vec<u32> = (0..data.threads.len() as u32).collect();
    threads.sort_by_key(|&t| data.thread_label(t));
    let profiles: Vec<Profile> = threads
        .into_iter()
        .map(|t| thread_profile(data, t, &by_tag))
        .filter(|p| !p.samples.is_empty())
        .collect();
    let busiest = (0..profiles.len())
        .max_by(|&a, &b| profiles[a].end_value.total_cmp(&profiles[b].end_value))
        .unwrap_or(0);
    let file = File {
        schema: "https://www.speedscope.app/file-format-schema.json",
        shared: Shared { frames },
        profiles,
        name,
        active_profile_index: busiest,
        exporter: format!("dask-pyspy {}", env!("CARGO_PKG_VERSION")),
        metadata: json!({"metadata": data.metadata, "processes": data.processes}),
    };
    serde_json::to_vec(&file).expect("speedscope documents always serialise")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::profile;

    fn doc(by: By) -> Value {
        let data = profile(
            "w1",
            &[
                (1, &["main", "f"], Some("f-1")),
                (1, &["main", "f"], Some("f-1")),
                (1, &["main", "g"], Some("g-2")),
                (2, &["main", "h"], None),
            ],
        );
        serde_json::from_slice(&write(&data, by, "test")).unwrap()
    }

    #[test]
    fn structure_matches_the_format() {
        let d = doc(By::Thread);
        assert_eq!(d["$schema"], "https://www.speedscope.app/file-format-schema.json");
        let profiles = d["profiles"].as_array().unwrap();
        assert_eq!(profiles.len(), 2);
        let p = &profiles[0];
        assert_eq!(p["type"], "sampled");
        assert_eq!(p["unit"], "seconds");
        assert_eq!(p["name"], "w1 T1 (0x1)");
        // Two identical consecutive samples merged; weights add up.
        assert_eq!(p["samples"].as_array().unwrap().len(), 2);
        assert_eq!(p["weights"][0], 0.02);
        assert_eq!(p["endValue"], 0.03);
        let frames = d["shared"]["frames"].as_array().unwrap();
        let root = p["samples"][0][0].as_u64().unwrap() as usize;
        assert_eq!(frames[root]["name"], "main", "stacks are root first");
        assert_eq!(d["activeProfileIndex"], 0, "opens on the busiest thread");
    }

    #[test]
    fn grouping_adds_a_root_frame_per_task_or_prefix() {
        for (by, expect) in [(By::Task, ["f-1", "g-2"]), (By::Prefix, ["f", "g"])] {
            let d = doc(by);
            let frames = d["shared"]["frames"].as_array().unwrap();
            let roots: Vec<_> = d["profiles"][0]["samples"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| frames[s[0].as_u64().unwrap() as usize]["name"].as_str().unwrap().to_string())
                .collect();
            assert_eq!(roots, expect);
            // The untagged thread keeps its own root.
            let s = &d["profiles"][1]["samples"][0];
            assert_eq!(frames[s[0].as_u64().unwrap() as usize]["name"], "main");
        }
    }

    #[test]
    fn by_parses_and_rejects() {
        assert_eq!("prefix".parse::<By>(), Ok(By::Prefix));
        assert!("stack".parse::<By>().unwrap_err().contains("'thread', 'task', 'prefix'"));
    }
}
