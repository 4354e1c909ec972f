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

use super::merge::NATIVE;
use rustc_hash::FxHashMap;

/// Python lines remembered at most; forgotten all at once past it.
const MAX_LINES: usize = 1 << 14;

/// Per Python frame id (a code object's line), the native frames (innermost first)
/// inside it in its last capture: toward its Python callee, and as the innermost.
#[derive(Default)]
pub struct NativeCalls {
    toward_python: FxHashMap<u64, Vec<u64>>,
    innermost: FxHashMap<u64, Vec<u64>>,
    /// The resolver's epoch and the reader's the ids are of.
    epochs: (u64, u64),
}

impl NativeCalls {
    /// Learns from a capture's `merged` stack (innermost first).
    pub fn learn(&mut self, merged: &[u64], epochs: (u64, u64)) {
        if epochs != self.epochs || self.toward_python.len() + self.innermost.len() >= MAX_LINES {
            self.toward_python.clear();
            self.innermost.clear();
            self.epochs = epochs;
        }
        let mut start = 0;
        for (i, &id) in merged.iter().enumerate() {
            if id & NATIVE != 0 {
                continue;
            }
            let table = if start == 0 { &mut self.innermost } else { &mut self.toward_python };
            let natives = table.entry(id).or_default();
            natives.clear();
            natives.extend_from_slice(&merged[start..i]);
            start = i + 1;
        }
    }

    fn inside(&self, id: u64, innermost: bool, epochs: (u64, u64)) -> &[u64] {
        let table = if innermost { &self.innermost } else { &self.toward_python };
        match table.get(&id) {
            Some(natives) if epochs == self.epochs => natives,
            _ => &[],
        }
    }
}

/// The Python frames the tick `read` (innermost first), each with the native frames
/// inside it that `calls` learned; how many native frames that lent.
pub fn lend(read: &[u64], calls: &NativeCalls, epochs: (u64, u64), out: &mut Vec<u64>) -> usize {
    out.clear();
    let mut lent = 0;
    for (i, &id) in read.iter().enumerate() {
        let natives = calls.inside(id, i == 0, epochs);
        out.extend_from_slice(natives);
        out.push(id);
        lent += natives.len();
    }
    lent
}

#[cfg(test)]
mod tests {
    use super::*;

    const E: (u64, u64) = (0, 0);

    #[test]
    fn a_python_frame_is_lent_the_native_frames_its_line_last_ran_in() {
        // Captured: main (12) -> caller (11) -> qsort (2, 3) -> comparator at line 20 -> C leaf (1).
        let merged = [NATIVE | 1, 20, NATIVE | 2, NATIVE | 3, 11, 12];
        let mut calls = NativeCalls::default();
        calls.learn(&merged, E);
        let mut out = Vec::new();
        assert_eq!(lend(&[20, 11, 12], &calls, E, &mut out), 3);
        assert_eq!(out, merged, "the same lines: the capture whole");
        assert_eq!(lend(&[21, 11, 12], &calls, E, &mut out), 2);
        assert_eq!(out, vec![21, NATIVE | 2, NATIVE | 3, 11, 12], "the comparator at another line: under qsort still");
        assert_eq!(lend(&[30, 13, 12], &calls, E, &mut out), 0, "another call from main");
        assert_eq!(out, vec![30, 13, 12]);
        assert_eq!(lend(&[11, 12], &calls, E, &mut out), 0, "the caller never seen innermost");
        assert_eq!(lend(&[21, 11, 12], &calls, (1, 0), &mut out), 0, "ids of another epoch may mean other frames");
        assert_eq!(lend(&[], &calls, E, &mut out), 0);
        assert!(out.is_empty());
    }

    #[test]
    fn a_lines_last_capture_is_what_it_lends() {
        let mut calls = NativeCalls::default();
        calls.learn(&[NATIVE | 1, 20, NATIVE | 2, 11, 12], E);
        // The caller captured in qsort itself, then calling the comparator directly.
        calls.learn(&[NATIVE | 4, NATIVE | 2, 11, 12], E);
        calls.learn(&[20, 11, 12], E);
        let mut out = Vec::new();
        assert_eq!(lend(&[11, 12], &calls, E, &mut out), 2);
        assert_eq!(out, vec![NATIVE | 4, NATIVE | 2, 11, 12]);
        assert_eq!(lend(&[20, 11, 12], &calls, E, &mut out), 0);
        // Learning another epoch forgets the last one's.
        calls.learn(&[NATIVE | 5, 30, 12], (0, 1));
        assert_eq!(lend(&[11, 12], &calls, (0, 1), &mut out), 0);
        assert_eq!(lend(&[30, 12], &calls, (0, 1), &mut out), 1);
    }
}
