//! The wire format between the processes of a cluster: a JSON head the scheduler
//! reads without touching the samples, then the tables and sample columns as gzip'd
//! protobuf (packed varints: a sample is a few bytes before compression). The head is
//! gzip'd too: its stats hold memory per task's stacks, ~170 KB of JSON a process.
//!
//! Layout: `MAGIC`, the head's length as sent and as read (u32s, little-endian), the
//! head, the body.

use crate::error::Error;
use crate::formats::compress;
use crate::formats::wire_columns::{self as columns, Columns};
use crate::profile::build::Merger;
use crate::profile::model::{Frame, Metadata, Process, ProfileData, Span, Tag, Thread};
use flate2::Compression;
use prost::Message;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

/// The name and version of the format: a part from another version is refused.
const MAGIC: &[u8; 8] = b"DPSPY\0w4";
/// The version before, whose head was not gzip'd: files saved with it still load.
const MAGIC_W3: &[u8; 8] = b"DPSPY\0w3";
/// The most a head may say it decompresses to.
const MAX_HEAD: usize = 256 << 20;

/// What a part holds, readable without decompressing it.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Head {
    pub processes: Vec<Process>,
    pub metadata: Metadata,
    /// Names of spans, as far as the sender knew them.
    pub spans: BTreeMap<String, Span>,
    /// Every span id the tags name, named or not.
    pub span_ids: Vec<String>,
    /// Samples taken (an aggregated sample counts as the samples it stands for).
    pub samples: u64,
    /// Sample rows the body holds.
    pub entries: u64,
    /// Approximate memory the decoded profile takes.
    pub memory_bytes: u64,
    /// The body's size before compression: decompression stops there.
    pub body_bytes: u64,
}

/// Tables and sample columns; strings are indices into `strings`, optional ones + 1.
#[derive(Clone, PartialEq, prost::Message)]
struct Body {
    #[prost(string, repeated, tag = "1")]
    strings: Vec<String>,
    #[prost(uint32, repeated, tag = "2")]
    frame_name: Vec<u32>,
    #[prost(uint32, repeated, tag = "3")]
    frame_file: Vec<u32>,
    #[prost(sint32, repeated, tag = "4")]
    frame_line: Vec<i32>,
    #[prost(uint32, repeated, tag = "5")]
    stack_len: Vec<u32>,
    #[prost(uint32, repeated, tag = "6")]
    stack_frames: Vec<u32>,
    #[prost(uint32, repeated, tag = "7")]
    tag_key: Vec<u32>,
    #[prost(uint32, repeated, tag = "8")]
    tag_prefix: Vec<u32>,
    #[prost(uint32, repeated, tag = "9")]
    tag_span: Vec<u32>,
    #[prost(uint32, repeated, tag = "10")]
    thread_process: Vec<u32>,
    #[prost(uint64, repeated, tag = "11")]
    thread_ident: Vec<u64>,
    #[prost(uint32, repeated, tag = "12")]
    thread_name: Vec<u32>,
    #[prost(message, optional, tag = "13")]
    samples: Option<Columns>,
    /// An aggregated profile's timeline cells (`ProfileData::timeline`).
    #[prost(message, optional, tag = "14")]
    timeline: Option<Columns>,
    /// Strings, as `activities` in the model.
    #[prost(uint32, repeated, tag = "21")]
    activity_name: Vec<u32>,
    /// Each activity's calls + 1 (0: not counted); empty: none counted.
    #[prost(uint64, repeated, tag = "23")]
    activity_calls: Vec<u64>,
    /// Indices of the native frames (older parts have none).
    #[prost(uint32, repeated, tag = "24")]
    frame_native: Vec<u32>,
}

#[derive(Default)]
struct Strings<'a> {
    index: FxHashMap<&'a str, u32>,
    table: Vec<String>,
}

impl<'a> Strings<'a> {
    fn id(&mut self, s: &'a str) -> u32 {
        *self.index.entry(s).or_insert_with(|| {
            self.table.push(s.to_owned());
            self.table.len() as u32 - 1
        })
    }

    fn optional(&mut self, s: Option<&'a str>) -> u32 {
        s.map_or(0, |s| self.id(s) + 1)
    }
}

fn body(data: &ProfileData) -> Body {
    let mut st = Strings::default();
    let mut b = Body::default();
    for (i, f) in data.frames.iter().enumerate() {
        if f.native {
            b.frame_native.push(i as u32);
        }
        b.frame_name.push(st.id(&f.name));
        b.frame_file.push(st.id(&f.file));
        b.frame_line.push(f.line);
    }
    for s in &data.stacks {
        b.stack_len.push(s.len() as u32);
        b.stack_frames.extend_from_slice(s);
    }
    for t in &data.tags {
        b.tag_key.push(st.id(&t.key));
        b.tag_prefix.push(st.id(&t.prefix));
        b.tag_span.push(st.optional(t.span.as_deref()));
    }
    for a in &data.activities {
        b.activity_name.push(st.id(a));
    }
    b.activity_calls = data.activity_calls.iter().map(|c| c.map_or(0, |c| c.saturating_add(1))).collect();
    for t in &data.threads {
        b.thread_process.push(t.process);
        b.thread_ident.push(t.ident);
        b.thread_name.push(st.optional(t.name.as_deref()));
    }
    b.samples = Some(Columns::of(&data.samples));
    if !data.timeline.is_empty() {
        b.timeline = Some(Columns::of(&data.timeline));
    }
    b.strings = st.table;
    b
}

fn head(data: &ProfileData, body_bytes: usize) -> Head {
    let mut span_ids: Vec<String> = data.tags.iter().filter_map(|t| t.span.clone()).collect();
    span_ids.sort_unstable();
    span_ids.dedup();
    Head {
        processes: data.processes.clone(),
        metadata: data.metadata.clone(),
        spans: data.spans.clone(),
        span_ids,
        samples: data.n_samples(),
        entries: data.samples.len() as u64,
        memory_bytes: data.memory_bytes() as u64,
        body_bytes: body_bytes as u64,
    }
}

pub fn encode(data: &ProfileData) -> Vec<u8> {
    let body = body(data).encode_to_vec();
    let head = serde_json::to_vec(&head(data, body.len())).expect("heads serialise");
    let packed = compress::gzip(&head, Compression::fast());
    let mut out = Vec::with_capacity(MAGIC.len() + 8 + packed.len() + body.len() / 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(packed.len() as u32).to_le_bytes());
    out.extend_from_slice(&(head.len() as u32).to_le_bytes());
    out.extend_from_slice(&packed);
    out.extend_from_slice(&compress::gzip(&body, Compression::fast()));
    out
}

/// The head, read, and the compressed body.
fn open(bytes: &[u8]) -> Result<(Head, &[u8]), String> {
    if let Some(rest) = bytes.strip_prefix(MAGIC_W3) {
        let (len, rest) = length(rest)?;
        let (head, body) = rest.split_at_checked(len).ok_or("cut short in its header")?;
        return Ok((parse_head(head)?, body));
    }
    let rest = bytes.strip_prefix(MAGIC).ok_or("not a dask-pyspy profile of this version (no wire header)")?;
    let (sent, rest) = length(rest)?;
    let (read, rest) = length(rest)?;
    if read > MAX_HEAD {
        return Err(format!("a header of {read} bytes, more than the {MAX_HEAD} allowed"));
    }
    let (packed, body) = rest.split_at_checked(sent).ok_or("cut short in its header")?;
    let head = compress::gunzip_at_most(packed, read)
        .map_err(|e| format!("a damaged header ({e})"))?
        .ok_or_else(|| format!("a header that decompresses to more than the {read} bytes it says"))?;
    Ok((parse_head(&head)?, body))
}

/// A length of the header (u32, little-endian), and what follows it.
fn length(bytes: &[u8]) -> Result<(usize, &[u8]), String> {
    let (len, rest) = bytes.split_first_chunk::<4>().ok_or("cut short in its header")?;
    Ok((u32::from_le_bytes(*len) as usize, rest))
}

fn parse_head(json: &[u8]) -> Result<Head, String> {
    serde_json::from_slice(json).map_err(|e| format!("a damaged header ({e})"))
}

pub fn read_head(bytes: &[u8]) -> Result<Head, Error> {
    open(bytes).map(|(head, _)| head).map_err(Error::NotAProfile)
}

/// One profile of the named parts, with `metadata` and `spans`. A part that does not
/// decode is left out and named, with why, under the metadata's `missing`.
pub fn merge(parts: &[(String, &[u8])], mut metadata: Metadata, spans: BTreeMap<String, Span>) -> ProfileData {
    let mut merger = Merger::default();
    let mut missing = match std::mem::take(&mut metadata.missing) {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    for (name, e) in merge_parts(parts, &mut merger) {
        missing.insert(name, Value::String(format!("an unreadable profile: {e}")));
    }
    metadata.missing = Value::Object(missing);
    let mut merged = merger.finish(metadata);
    merged.spans.extend(spans);
    merged
}

/// Named parts merged as they are decoded, the decoding spread over a few threads
/// and kept in the parts' order; a part that does not decode is returned with why.
fn merge_parts(parts: &[(String, &[u8])], merger: &mut Merger) -> Vec<(String, String)> {
    let rows: u64 = parts.iter().filter_map(|(_, b)| open(b).ok()).map(|(head, _)| head.entries).sum();
    merger.reserve(rows as usize);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().clamp(2, 5) - 1);
    let next = AtomicUsize::new(0);
    let mut failed = Vec::new();
    std::thread::scope(|scope| {
        // Bounded: at most a few decoded parts wait for the merge at a time.
        let (send, receive) = mpsc::sync_channel(threads);
        for _ in 0..threads {
            let (send, next) = (send.clone(), &next);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= parts.len() || send.send((i, unpack(parts[i].1))).is_err() {
                    break;
                }
            });
        }
        drop(send);
        let mut waiting = BTreeMap::new();
        let mut due = 0;
        for (i, decoded) in receive {
            waiting.insert(i, decoded);
            while let Some(decoded) = waiting.remove(&due) {
                match decoded {
                    Ok(part) => merger.add(&part),
                    Err(e) => failed.push((parts[due].0.clone(), e)),
                }
                due += 1;
            }
        }
    });
    failed
}

pub fn decode(bytes: &[u8]) -> Result<ProfileData, Error> {
    unpack(bytes).map_err(Error::NotAProfile)
}

fn unpack(bytes: &[u8]) -> Result<ProfileData, String> {
    let (head, body) = open(bytes)?;
    decode_body(body, head).map_err(|e| format!("a damaged body ({e})"))
}

fn decode_body(body: &[u8], head: Head) -> Result<ProfileData, String> {
    let raw = compress::gunzip_at_most(body, head.body_bytes as usize)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("decompresses to more than the {} bytes its header says", head.body_bytes))?;
    let body = Body::decode(raw.as_slice()).map_err(|e| e.to_string())?;
    let data = tables(body, head)?;
    data.validate()?;
    Ok(data)
}

fn tables(b: Body, head: Head) -> Result<ProfileData, String> {
    columns::same_lengths(&[b.frame_name.len(), b.frame_file.len(), b.frame_line.len()])?;
    columns::same_lengths(&[b.tag_key.len(), b.tag_prefix.len(), b.tag_span.len()])?;
    columns::same_lengths(&[b.thread_process.len(), b.thread_ident.len(), b.thread_name.len()])?;
    let strings = &b.strings;
    let string = |i: u32| strings.get(i as usize).cloned().ok_or("a string index out of range");
    let optional = |i: u32| if i == 0 { Ok(None) } else { string(i - 1).map(Some) };
    let mut frames = Vec::with_capacity(b.frame_name.len());
    for i in 0..b.frame_name.len() {
        frames.push(Frame::python(string(b.frame_name[i])?, string(b.frame_file[i])?, b.frame_line[i]));
    }
    for &i in &b.frame_native {
        frames.get_mut(i as usize).ok_or("a native frame index out of range")?.native = true;
    }
    let mut stacks = Vec::with_capacity(b.stack_len.len());
    let mut rest = b.stack_frames.as_slice();
    for &len in &b.stack_len {
        let (stack, tail) = rest.split_at_checked(len as usize).ok_or("stacks longer than their frames")?;
        stacks.push(stack.to_vec());
        rest = tail;
    }
    let mut tags = Vec::with_capacity(b.tag_key.len());
    for i in 0..b.tag_key.len() {
        tags.push(Tag { key: string(b.tag_key[i])?, prefix: string(b.tag_prefix[i])?, span: optional(b.tag_span[i])? });
    }
    let activities = b.activity_name.iter().map(|&i| string(i)).collect::<Result<Vec<_>, _>>()?;
    if !b.activity_calls.is_empty() && b.activity_calls.len() != activities.len() {
        return Err("columns differ in length".into());
    }
    let activity_calls = b.activity_calls.iter().map(|c| c.checked_sub(1)).collect();
    let mut threads = Vec::with_capacity(b.thread_ident.len());
    for i in 0..b.thread_ident.len() {
        threads.push(Thread {
            process: b.thread_process[i],
            ident: b.thread_ident[i],
            name: optional(b.thread_name[i])?,
        });
    }
    let samples = b.samples.unwrap_or_default().samples()?;
    let timeline = b.timeline.unwrap_or_default().samples()?;
    let Head { processes, metadata, spans, .. } = head;
    Ok(ProfileData {
        frames,
        stacks,
        tags,
        activities,
        activity_calls,
        threads,
        processes,
        samples,
        timeline,
        metadata,
        spans,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::files::tests::rich;
    use crate::profile::build::Builder;
    use proptest::prelude::*;

    #[test]
    fn round_trip_keeps_everything() {
        let data = rich();
        let bytes = encode(&data);
        assert_eq!(decode(&bytes).unwrap(), data);
        let head = read_head(&bytes).unwrap();
        assert_eq!((head.samples, head.processes.len()), (data.n_samples(), data.processes.len()));
        assert_eq!(head.span_ids, ["s1"]);
    }

    #[test]
    fn activity_calls_travel_where_known() {
        let mut data = rich();
        data.activities.push("scheduler: reading rpc".into());
        data.activity_calls = vec![Some(12), None];
        assert_eq!(decode(&encode(&data)).unwrap(), data);
        data.activity_calls = vec![Some(0), Some(u64::MAX - 1)];
        assert_eq!(decode(&encode(&data)).unwrap(), data);
        let mut uneven = body(&data);
        uneven.activity_calls.pop();
        assert!(tables(uneven, head(&data, 0)).unwrap_err().contains("differ in length"));
    }

    #[test]
    fn a_body_without_calls_decodes_as_none_known() {
        let data = rich();
        let old = Body { activity_calls: Vec::new(), ..body(&data) };
        assert!(tables(old, head(&data, 0)).unwrap().activity_calls.is_empty());
    }

    #[test]
    fn aggregated_counts_travel() {
        let mut data = rich();
        data.samples[0].count = 7;
        let back = decode(&encode(&data)).unwrap();
        assert_eq!(back.samples[0].count, 7);
        assert_eq!(back.n_samples(), data.n_samples());
        let aggregated = data.aggregated(false);
        assert!(!aggregated.timeline.is_empty());
        assert_eq!(decode(&encode(&aggregated)).unwrap(), aggregated, "with its timeline cells");
    }

    #[test]
    fn foreign_and_cut_bytes_are_refused() {
        let bytes = encode(&rich());
        assert!(unpack(b"{\"frames\": []}").unwrap_err().contains("no wire header"));
        assert!(unpack(&bytes[..10]).unwrap_err().contains("cut short"));
        assert!(unpack(&bytes[..bytes.len() - 5]).unwrap_err().contains("damaged body"));
        let empty = Builder::default().finish(Vec::new(), Metadata::default());
        assert_eq!(decode(&encode(&empty)).unwrap(), empty);
    }

    #[test]
    fn a_body_larger_than_its_head_says_is_refused() {
        let data = rich();
        let mut h = head(&data, 0);
        h.body_bytes = 3;
        let body = body(&data).encode_to_vec();
        let head = serde_json::to_vec(&h).unwrap();
        let packed = compress::gzip(&head, Compression::fast());
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&(packed.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(head.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&packed);
        bytes.extend_from_slice(&compress::gzip(&body, Compression::fast()));
        assert!(unpack(&bytes).unwrap_err().contains("more than the 3 bytes"));
    }

    #[test]
    fn a_part_of_the_version_before_still_reads() {
        let data = rich();
        let body = body(&data).encode_to_vec();
        let head = serde_json::to_vec(&head(&data, body.len())).unwrap();
        let mut bytes = MAGIC_W3.to_vec();
        bytes.extend_from_slice(&(head.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&head);
        bytes.extend_from_slice(&compress::gzip(&body, Compression::fast()));
        assert_eq!(decode(&bytes).unwrap(), data);
        assert!(encode(&data).len() < bytes.len(), "the head is gzip'd now");
    }

    proptest! {
        #[test]
        fn damaged_parts_never_panic(cut in 0usize..4000, flip in 0usize..4000, bit in 0u8..8) {
            let mut bytes = encode(&rich());
            let i = flip % bytes.len();
            bytes[i] ^= 1 << bit;
            bytes.truncate(cut.max(1));
            if let Ok(data) = decode(&bytes) {
                prop_assert!(data.validate().is_ok());
            }
        }
    }
}
