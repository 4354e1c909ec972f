//! Native frames lent to the Python frames the tick read. A capture is taken at the
//! kernel's scheduler tick (a CPU timer fires only there), the tick's read at a random
//! moment of its slot: samples keep the read's Python frames, so code whose phases
//! repeat in step with the kernel's tick is not sampled at a few of its phases only.
//! Under each of those frames go the native frames its line ran in when last captured:
//! toward the Python frame it calls (a C library calling back into Python), and, for
//! the innermost, its C callees. A thread's fresh capture teaches its own first, so
//! where its Python frames are the read's the sample is that capture whole. Elsewhere
//! each line's native frames are a draw from its captures, and the lines are the
//! read's.
//!
//! Lines are known by the frame they show (function, file, line), not by their frame
//! id: a function dask ships by value is a new code object in each task.

use super::merge::NATIVE;
use crate::profile::model::Frame;
use rustc_hash::FxHashMap;
use std::hash::{BuildHasher, RandomState};

/// Python lines remembered at most; forgotten all at once past it.
const MAX_LINES: usize = 1 << 14;

/// Per Python line, the native frames (innermost first) inside it in its last capture:
/// toward its Python callee, and as the innermost.
#[derive(Default)]
pub struct NativeCalls {
    /// Frame ids (of the resolver's and reader's `epochs`) and the lines they show.
    lines: FxHashMap<u64, u64>,
    toward_python: FxHashMap<u64, Vec<u64>>,
    innermost: FxHashMap<u64, Vec<u64>>,
    epochs: (u64, u64),
    hasher: RandomState,
}

impl NativeCalls {
    /// Learns from a capture's `merged` stack (innermost first), its Python frame ids
    /// named by `frame`. Not `exact` (merged with the frames the tick read, not those
    /// the signal copied), its innermost frame's line may have moved since the capture
    /// (the frame is the same); the frames outside it may not.
    pub fn learn(&mut self, merged: &[u64], exact: bool, epochs: (u64, u64), frame: impl Fn(u64) -> Frame) {
        if epochs != self.epochs {
            self.forget();
            self.epochs = epochs;
        }
        let mut start = 0;
        for (i, &id) in merged.iter().enumerate() {
            if id & NATIVE != 0 {
                continue;
            }
            let line = self.line(id, &frame);
            let table = match start {
                0 if !exact => None,
                0 => Some(&mut self.innermost),
                _ => Some(&mut self.toward_python),
            };
            if let Some(natives) = table.map(|t| t.entry(line).or_default()) {
                natives.clear();
                natives.extend_from_slice(&merged[start..i]);
            }
            start = i + 1;
        }
    }

    /// The Python frames the tick `read` (innermost first), each with the native frames
    /// inside it learned for its line; how many native frames that lent.
    pub fn lend(
        &mut self,
        read: &[u64],
        epochs: (u64, u64),
        frame: impl Fn(u64) -> Frame,
        out: &mut Vec<u64>,
    ) -> usize {
        out.clear();
        if epochs != self.epochs {
            out.extend_from_slice(read);
            return 0;
        }
        let mut lent = 0;
        for (i, &id) in read.iter().enumerate() {
            let line = self.line(id, &frame);
            let table = if i == 0 { &self.innermost } else { &self.toward_python };
            let natives = table.get(&line).map_or(&[][..], Vec::as_slice);
            out.extend_from_slice(natives);
            out.push(id);
            lent += natives.len();
        }
        lent
    }

    /// The line frame id `id` shows. Reads name ids as well as captures: the bound is
    /// kept here, where both add them.
    fn line(&mut self, id: u64, frame: impl Fn(u64) -> Frame) -> u64 {
        if self.lines.len() >= MAX_LINES && !self.lines.contains_key(&id) {
            self.forget();
        }
        *self.lines.entry(id).or_insert_with(|| self.hasher.hash_one(frame(id)))
    }

    fn forget(&mut self) {
        self.lines.clear();
        self.toward_python.clear();
        self.innermost.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const E: (u64, u64) = (0, 0);

    /// Ids 100 and up show the frames of ids 0 and up (the same function, made anew).
    fn frame(id: u64) -> Frame {
        Frame::python(format!("f{}", id % 100), "m.py".into(), 1)
    }

    #[test]
    fn a_python_frame_is_lent_the_native_frames_its_line_last_ran_in() {
        // Captured: main (12) -> caller (11) -> qsort (2, 3) -> comparator at line 20 -> C leaf (1).
        let merged = [NATIVE | 1, 20, NATIVE | 2, NATIVE | 3, 11, 12];
        let mut calls = NativeCalls::default();
        calls.learn(&merged, true, E, frame);
        let mut out = Vec::new();
        assert_eq!(calls.lend(&[20, 11, 12], E, frame, &mut out), 3);
        assert_eq!(out, merged, "the same lines: the capture whole");
        assert_eq!(calls.lend(&[21, 11, 12], E, frame, &mut out), 2);
        assert_eq!(out, vec![21, NATIVE | 2, NATIVE | 3, 11, 12], "the comparator at another line: under qsort still");
        assert_eq!(calls.lend(&[30, 13, 12], E, frame, &mut out), 0, "another call from main");
        assert_eq!(out, vec![30, 13, 12]);
        assert_eq!(calls.lend(&[11, 12], E, frame, &mut out), 0, "the caller never seen innermost");
        assert_eq!(calls.lend(&[120, 111, 112], E, frame, &mut out), 3, "the same functions, made anew");
        assert_eq!(out, vec![NATIVE | 1, 120, NATIVE | 2, NATIVE | 3, 111, 112]);
        assert_eq!(calls.lend(&[21, 11, 12], (1, 0), frame, &mut out), 0, "ids of another epoch may mean other frames");
        assert_eq!(out, vec![21, 11, 12]);
        assert_eq!(calls.lend(&[], E, frame, &mut out), 0);
        assert!(out.is_empty());
    }

    #[test]
    fn a_lines_last_capture_is_what_it_lends() {
        let mut calls = NativeCalls::default();
        calls.learn(&[NATIVE | 1, 20, NATIVE | 2, 11, 12], true, E, frame);
        // The caller captured in qsort itself, then calling the comparator directly.
        calls.learn(&[NATIVE | 4, NATIVE | 2, 11, 12], true, E, frame);
        calls.learn(&[20, 11, 12], true, E, frame);
        let mut out = Vec::new();
        assert_eq!(calls.lend(&[11, 12], E, frame, &mut out), 2);
        assert_eq!(out, vec![NATIVE | 4, NATIVE | 2, 11, 12]);
        assert_eq!(calls.lend(&[20, 11, 12], E, frame, &mut out), 0);
        // Learning another epoch forgets the last one's.
        calls.learn(&[NATIVE | 5, 30, 12], true, (0, 1), frame);
        assert_eq!(calls.lend(&[11, 12], (0, 1), frame, &mut out), 0);
        assert_eq!(calls.lend(&[30, 12], (0, 1), frame, &mut out), 1);
    }

    #[test]
    fn reads_alone_never_hold_more_than_the_bound() {
        let mut calls = NativeCalls::default();
        calls.learn(&[NATIVE | 1, 20], true, E, frame);
        let mut out = Vec::new();
        for id in 1000..1000 + MAX_LINES as u64 {
            calls.lend(&[id], E, frame, &mut out);
        }
        assert!(calls.lines.len() <= MAX_LINES);
        assert_eq!(calls.lend(&[20], E, frame, &mut out), 0, "forgotten all at once past the bound");
    }

    #[test]
    fn a_capture_merged_with_the_ticks_frames_teaches_no_innermost_line() {
        // Merged with the frames the tick read: the comparator may have been at another
        // line of the same frame when captured.
        let mut calls = NativeCalls::default();
        calls.learn(&[NATIVE | 1, 20, NATIVE | 2, 11, 12], false, E, frame);
        let mut out = Vec::new();
        assert_eq!(calls.lend(&[20, 11, 12], E, frame, &mut out), 1);
        assert_eq!(out, vec![20, NATIVE | 2, 11, 12]);
    }
}
