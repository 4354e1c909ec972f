//! Reads back a speedscope file dask-pyspy wrote (`speedscope.rs`): its per-thread
//! profiles become samples again, a leading "dask task" root frame becomes the
//! sample's task tag (by span, under the "dask span" frames of its span path), and
//! processes and metadata come from "x-dask-pyspy".
//!
//! What the format does not hold stays lost: sample times (all 0), thread states
//! and CPU time (every sample is "running"), lines <= 0, by prefix or span the task
//! keys (each tag's key is its prefix), and spans but for their name paths by span
//! (a path is its own id). Consecutive equal samples come back as one. Files of
//! other tools are refused: they hold no processes or tags.

use crate::error::Error;
use crate::formats::limits::{self, Limits};
use crate::formats::speedscope::{Extension, ThreadProfile, ACTIVITY_FILE, SPAN_FILE, TASK_FILE};
use crate::profile::build::Builder;
use crate::profile::model::{Frame, ProfileData, Span, Tag};
use crate::profile::sample::{Sample, FLAG_ACTIVE};
use crate::profile::views::By;
use crate::profile::views::NO_SPAN;
use serde::de::{DeserializeSeed, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::BTreeMap;

#[derive(Deserialize)]
struct Doc {
    #[serde(default)]
    shared: Shared,
    #[serde(default)]
    profiles: Vec<SProfile>,
    exporter: Option<String>,
    #[serde(rename = "x-dask-pyspy")]
    extension: Option<Extension>,
}

#[derive(Deserialize, Default)]
struct Shared {
    frames: Vec<SFrame>,
}

#[derive(Deserialize)]
struct SFrame {
    name: String,
    file: Option<String>,
    line: Option<i32>,
}

#[derive(Deserialize)]
struct SProfile {
    #[serde(rename = "type")]
    kind: String,
    unit: Option<String>,
    #[serde(default)]
    samples: Stacks,
    #[serde(default)]
    weights: Vec<f64>,
}

/// A profile's stacks as two flat columns: a `Vec` per stack would take ~50 bytes
/// for the 4 bytes of `[0],`, so a small file would parse into gigabytes.
#[derive(Default)]
struct Stacks {
    frames: Vec<u32>,
    /// Where each stack ends in `frames`.
    ends: Vec<usize>,
}

impl Stacks {
    fn len(&self) -> usize {
        self.ends.len()
    }

    fn iter(&self) -> impl Iterator<Item = &[u32]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts.zip(&self.ends).map(|(start, &end)| &self.frames[start..end])
    }
}

impl<'de> Deserialize<'de> for Stacks {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Stacks, D::Error> {
        d.deserialize_seq(StacksVisitor)
    }
}

struct StacksVisitor;

impl<'de> Visitor<'de> for StacksVisitor {
    type Value = Stacks;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of stacks (lists of frame indices)")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Stacks, A::Error> {
        let mut out = Stacks::default();
        while seq.next_element_seed(AppendStack(&mut out.frames))?.is_some() {
            out.ends.push(out.frames.len());
        }
        Ok(out)
    }
}

/// Appends one stack's frame indices to the flat column.
struct AppendStack<'a>(&'a mut Vec<u32>);

impl<'de> DeserializeSeed<'de> for AppendStack<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for AppendStack<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a stack (a list of frame indices)")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(frame) = seq.next_element()? {
            self.0.push(frame);
        }
        Ok(())
    }
}

/// A merged sample of more than ~49 days is damage, not a profile.
const MAX_WEIGHT_SECONDS: f64 = 4.0e6;

/// `seconds` in microseconds, checked.
fn micros(seconds: f64) -> Result<u64, String> {
    if !(0.0..=MAX_WEIGHT_SECONDS).contains(&seconds) {
        return Err(format!("a sample weight of {seconds} seconds"));
    }
    Ok((seconds * 1e6).round() as u64)
}

/// Samples a weight of `us` microseconds becomes: split where one would overflow.
fn pieces(us: u64) -> u64 {
    us.div_ceil(u32::MAX as u64)
}

/// `us` as sample weights, split where one would overflow.
fn weights_us(mut left: u64) -> impl Iterator<Item = u32> {
    std::iter::from_fn(move || {
        let w = left.min(u32::MAX as u64);
        left -= w;
        (w > 0).then_some(w as u32)
    })
}

/// A stack's tag, activity and frames below its synthetic roots.
type Rooted<'s> = (Option<u32>, Option<u32>, &'s [u32]);

struct Reader<'a> {
    doc: &'a Doc,
    by: By,
    extension: &'a Extension,
    limits: Limits,
    out: Builder,
    /// Speedscope frame index -> our frame id, once used.
    frames: Vec<Option<u32>>,
    /// Profiles a thread was read from: each holds one thread's samples.
    taken: Vec<bool>,
    /// By span: the span paths seen, each its own id.
    spans: BTreeMap<String, Span>,
}

impl Reader<'_> {
    fn frame(&mut self, index: u32) -> Result<u32, String> {
        let f = self
            .doc
            .shared
            .frames
            .get(index as usize)
            .ok_or_else(|| format!("a sample names frame {index}, which does not exist"))?;
        if matches!(f.file.as_deref(), Some(TASK_FILE | SPAN_FILE | ACTIVITY_FILE)) {
            return Err(format!("the task frame {:?} below the root of a stack", f.name));
        }
        let out = &mut self.out;
        Ok(*self.frames[index as usize].get_or_insert_with(|| {
            let file = f.file.clone().unwrap_or_default();
            // Our writer gives a native frame its library as the file, and no line.
            let native = f.line.is_none() && file.contains(".so");
            out.frames.intern(Frame { name: f.name.clone(), file, line: f.line.unwrap_or(0), native })
        }))
    }

    fn root_named(&self, index: u32, file: &str) -> Option<&str> {
        self.doc.shared.frames.get(index as usize).filter(|f| f.file.as_deref() == Some(file)).map(|f| f.name.as_str())
    }

    /// The tag or else the activity the root frames stand for, if `stack` starts with
    /// them; and the rest.
    fn split_root<'s>(&mut self, stack: &'s [u32]) -> Result<Rooted<'s>, String> {
        let kind: Vec<String> =
            stack.iter().map_while(|&i| self.root_named(i, ACTIVITY_FILE)).map(String::from).collect();
        let stack = &stack[kind.len()..];
        let path: Vec<String> = stack.iter().map_while(|&i| self.root_named(i, SPAN_FILE)).map(String::from).collect();
        let Some(key) = stack.get(path.len()).and_then(|&i| self.root_named(i, TASK_FILE)).map(String::from) else {
            return match (kind.is_empty(), path.is_empty()) {
                (_, false) => Err("span frames without a task frame below them".into()),
                (true, true) => Ok((None, None, stack)),
                (false, true) => Ok((None, Some(self.out.activities.intern(kind.join(": "))), stack)),
            };
        };
        let prefix = match self.by {
            By::Thread => return Err(format!("a task frame {key:?} in a file grouped by thread")),
            By::Task => self.extension.prefixes.get(&key).cloned().unwrap_or_else(|| key.clone()),
            By::Prefix | By::Span | By::Activity => key.clone(),
        };
        let depth = path.len() + 1;
        let span = self.span(path);
        Ok((Some(self.out.tags.intern(Tag { key, prefix, span })), None, &stack[depth..]))
    }

    /// The id of a span path read from the file: the path itself.
    fn span(&mut self, names: Vec<String>) -> Option<String> {
        if names.is_empty() || names == [NO_SPAN] {
            return None;
        }
        let id = names.join(" / ");
        self.spans.entry(id.clone()).or_insert_with(|| Span { names, ids: vec![id.clone()] });
        Some(id)
    }

    fn thread(&mut self, tp: &ThreadProfile) -> Result<(), String> {
        let p =
            self.doc.profiles.get(tp.profile).ok_or_else(|| format!("thread profile {} does not exist", tp.profile))?;
        if std::mem::replace(&mut self.taken[tp.profile], true) {
            return Err(format!("profile {} is named by more than one thread", tp.profile));
        }
        if p.kind != "sampled" || p.unit.as_deref() != Some("seconds") || p.samples.len() != p.weights.len() {
            return Err(format!("profile {} is not a sampled profile in seconds with a weight per sample", tp.profile));
        }
        self.make_room(&p.weights)?;
        let thread = self.out.threads.intern(tp.thread.clone());
        for (stack, &seconds) in p.samples.iter().zip(&p.weights) {
            let (tag, activity, rest) = self.split_root(stack)?;
            let frames = rest.iter().map(|&i| self.frame(i)).collect::<Result<Vec<u32>, String>>()?;
            let stack = self.out.stacks.intern(frames);
            for weight_us in weights_us(micros(seconds)?) {
                self.out.samples.push(Sample {
                    time_ns: 0,
                    thread,
                    stack,
                    tag,
                    activity,
                    weight_us,
                    cpu_us: 0,
                    count: 1,
                    flags: FLAG_ACTIVE,
                    cover: 0,
                });
            }
        }
        Ok(())
    }

    /// Room for the samples `weights` become, refused before any is made if they would
    /// take more than `limits.memory` (a few bytes of weights can ask for gigabytes).
    fn make_room(&mut self, weights: &[f64]) -> Result<(), String> {
        let mut samples = self.out.samples.len() as u64;
        for &seconds in weights {
            samples += pieces(micros(seconds)?);
        }
        if samples.saturating_mul(std::mem::size_of::<Sample>() as u64) > self.limits.memory as u64 {
            return Err(format!(
                "its sample weights expand into {samples} samples, more than config pyspy.max-result ({} MiB) holds",
                self.limits.memory >> 20
            ));
        }
        self.out.samples.reserve(samples as usize - self.out.samples.len());
        Ok(())
    }
}

/// The profile and its grouping, from a speedscope document (gzip-compressed or not).
pub fn read(bytes: &[u8], limits: Limits) -> Result<(ProfileData, By), Error> {
    parse(bytes, limits).map_err(Error::BadInput)
}

fn parse(bytes: &[u8], limits: Limits) -> Result<(ProfileData, By), String> {
    let json = match limits::is_gzip(bytes) {
        true => Cow::Owned(limits.gunzip(bytes)?),
        false => limits.check_json(bytes.len()).map(|()| Cow::Borrowed(bytes))?,
    };
    let json = std::str::from_utf8(&json).map_err(|e| format!("not a speedscope file ({e})"))?;
    limits.check_parse(json, limits::raw_field(json, &["profiles"]))?;
    let doc: Doc = serde_json::from_str(json).map_err(|e| format!("not a speedscope file ({e})"))?;
    let Some(extension) = &doc.extension else {
        if doc.profiles.is_empty() {
            return Err("not a speedscope file (no \"profiles\")".into());
        }
        let exporter = doc.exporter.as_deref().unwrap_or("no exporter named");
        return Err(format!(
            "a speedscope file not written by dask-pyspy ({exporter}): only dask-pyspy's load, \
             since only they hold processes and task tags"
        ));
    };
    let (Some(by), Some(threads)) = (&extension.by, &extension.threads) else {
        return Err("written by an earlier dask-pyspy, which did not record its threads".into());
    };
    let frames = vec![None; doc.shared.frames.len()];
    let taken = vec![false; doc.profiles.len()];
    let mut reader = Reader {
        by: by.parse().map_err(|e: Error| e.to_string())?,
        doc: &doc,
        extension,
        limits,
        out: Builder::default(),
        frames,
        taken,
        spans: BTreeMap::new(),
    };
    for tp in threads {
        reader.thread(tp)?;
    }
    let by = reader.by;
    let mut data = reader.out.finish(extension.processes.clone(), extension.metadata.clone());
    data.spans = reader.spans;
    data.validate()?;
    Ok((data, by))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::files::tests::rich;
    use crate::formats::limits::tests::LOOSE;
    use crate::formats::speedscope;
    use crate::profile::model::tests::profile;
    use crate::profile::views::{Shown, Weight};
    use serde_json::{json, Value};
    use std::collections::BTreeMap;

    fn read(bytes: &[u8]) -> Result<(ProfileData, By), String> {
        super::parse(bytes, LOOSE)
    }

    fn wall(by: By) -> Shown {
        Shown { by, weight: Weight::Wall }
    }

    type Held = BTreeMap<(u64, Option<(String, String)>, Option<String>, Vec<String>), u64>;

    /// Microseconds per (thread, shown tag, activity if `activities`, stack of frame
    /// names): what a file can hold.
    fn held(data: &ProfileData, shown: impl Fn(&Tag) -> Option<(String, String)>, activities: bool) -> Held {
        let mut out = BTreeMap::new();
        for s in &data.samples {
            let tag = s.tag.and_then(|t| shown(&data.tags[t as usize]));
            let activity = s.activity.filter(|_| activities).map(|a| data.activities[a as usize].clone());
            let names = data.stacks[s.stack as usize].iter().map(|&f| data.frames[f as usize].name.clone()).collect();
            let thread = data.threads[s.thread as usize].ident;
            *out.entry((thread, tag, activity, names)).or_default() += s.weight_us as u64;
        }
        out
    }

    #[test]
    fn reads_back_what_the_file_holds() {
        let data = rich();
        for by in [By::Thread, By::Task, By::Prefix, By::Span, By::Activity] {
            let (back, by_back) = read(&speedscope::write(&data, wall(by), "t")).unwrap();
            assert_eq!(by_back, by);
            assert_eq!((&back.processes, &back.metadata), (&data.processes, &data.metadata));
            assert_eq!(back.threads.len(), data.threads.len());
            assert!(back.samples.iter().all(|s| s.time_ns == 0 && s.flags == FLAG_ACTIVE));
            // By prefix the file holds prefixes only; by thread, no tags or activities at all.
            let shown = |t: &Tag| match by {
                By::Thread => None,
                By::Task => Some((t.key.clone(), t.prefix.clone())),
                By::Prefix | By::Span | By::Activity => Some((t.prefix.clone(), t.prefix.clone())),
            };
            let expect = held(&data, shown, by != By::Thread);
            assert_eq!(held(&back, |t| Some((t.key.clone(), t.prefix.clone())), true), expect, "{by:?}");
            // By span the file holds span paths: each comes back as its own id.
            let paths: Vec<Vec<&str>> = back.tags.iter().map(|t| back.span_names(t)).collect();
            let expect: Vec<Vec<&str>> =
                if by == By::Span { vec![vec!["load"], vec![]] } else { vec![vec![]; back.tags.len()] };
            assert_eq!(paths, expect, "{by:?}");
        }
    }

    #[test]
    fn long_merged_samples_split_instead_of_overflowing() {
        let mut data = profile("w", &[(1, &["f"], None), (1, &["f"], None)]);
        data.samples.iter_mut().for_each(|s| s.weight_us = u32::MAX);
        let (back, _) = read(&speedscope::write(&data, wall(By::Thread), "t")).unwrap();
        assert_eq!(back.samples.len(), 2);
        assert_eq!(back.total_seconds(), data.total_seconds());
    }

    fn doc(by: By) -> Value {
        serde_json::from_slice(&speedscope::write(&rich(), wall(by), "t")).unwrap()
    }

    fn err(doc: &Value) -> String {
        read(&serde_json::to_vec(doc).unwrap()).unwrap_err()
    }

    #[test]
    fn foreign_earlier_and_damaged_files_say_so() {
        let profile = json!({"type": "sampled", "unit": "none", "samples": [[0]], "weights": [1]});
        let pyspy = json!({"$schema": "https://www.speedscope.app/file-format-schema.json", "exporter": "py-spy@0.3.14",
                           "shared": {"frames": [{"name": "f"}]}, "profiles": [profile]});
        assert!(err(&pyspy).starts_with("a speedscope file not written by dask-pyspy (py-spy@0.3.14)"));
        assert!(err(&json!([1])).starts_with("not a speedscope file"));
        assert_eq!(err(&json!({"a": 1})), "not a speedscope file (no \"profiles\")");
        assert!(read(b"\x00\x01garbage").unwrap_err().starts_with("not a speedscope file"));
        let mut earlier = doc(By::Prefix);
        earlier["x-dask-pyspy"].as_object_mut().unwrap().remove("threads");
        assert!(err(&earlier).contains("earlier dask-pyspy"));
        let mut d = doc(By::Task);
        let last = d["profiles"].as_array().unwrap().len() - 1;
        d["profiles"][last]["samples"][0] = json!([1000]);
        assert!(err(&d).contains("frame 1000, which does not exist"));
        let mut d = doc(By::Task);
        d["profiles"][last]["weights"][0] = json!(-1.0);
        assert!(err(&d).contains("weight of -1 seconds"));
        let mut d = doc(By::Task);
        d["x-dask-pyspy"]["threads"][0]["process"] = json!(5);
        assert!(err(&d).contains("a thread names a process that does not exist"));
        let mut d = doc(By::Task);
        d["x-dask-pyspy"]["threads"][0]["profile"] = json!(99);
        assert!(err(&d).contains("thread profile 99 does not exist"));
        let mut d = doc(By::Thread);
        d["x-dask-pyspy"]["by"] = json!("task");
        d["profiles"][0]["samples"][0] = json!([0, 1]);
        d["shared"]["frames"][1]["file"] = json!(TASK_FILE);
        assert!(err(&d).contains("below the root"));
    }

    /// A file whose one thread profile holds `n` samples of `seconds` each, named by `threads` threads.
    fn weighted(n: usize, seconds: f64, threads: u64) -> Vec<u8> {
        let mut d = doc(By::Thread);
        let one = d["x-dask-pyspy"]["threads"][0].clone();
        let named = |i| {
            let mut t = one.clone();
            (t["profile"], t["ident"]) = (json!(0), json!(i));
            t
        };
        d["x-dask-pyspy"]["threads"] = (0..threads).map(named).collect();
        d["profiles"] =
            json!([{"type": "sampled", "unit": "seconds", "samples": vec![[0]; n], "weights": vec![seconds; n]}]);
        serde_json::to_vec(&d).unwrap()
    }

    #[test]
    fn weights_never_expand_past_the_memory_limit() {
        let limits = Limits { json: 1 << 30, memory: 1 << 20 };
        let (back, _) = super::parse(&weighted(1000, 1.0, 1), limits).unwrap();
        assert_eq!(back.samples.len(), 1000);
        // 4e6 s is 932 samples of the most a sample holds: 932,000 samples, 37 MB.
        let e = super::parse(&weighted(1000, 4e6, 1), limits).unwrap_err();
        assert!(
            e.starts_with("its sample weights expand into 932000 samples") && e.contains("pyspy.max-result (1 MiB)"),
            "{e}"
        );
        assert_eq!(
            super::parse(&weighted(10, 1.0, 2), limits).unwrap_err(),
            "profile 0 is named by more than one thread"
        );
        let e = super::parse(&weighted(1000, 1.0, 1), Limits { json: 1 << 10, memory: 1 << 20 }).unwrap_err();
        assert!(e.starts_with("more than 0 MiB of JSON"), "{e}");
    }
}
