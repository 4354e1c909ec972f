//! One stack from a thread's Python and native halves: each eval loop in the native
//! stack is replaced by the Python frames that run of the loop holds, so a stack
//! reads Python caller -> C -> Python callback -> C. The interpreter's own plumbing
//! is dropped, and so are the native frames outside the outermost eval loop (thread
//! start-up).
//!
//! Which native frame is the eval loop of a run: on 3.12+ the one whose stack holds
//! the run's entry frame (a shim the loop keeps on the C stack), which needs no
//! symbol (Debian's interpreters are stripped, and PGO splits the loop); before, the
//! frames named `_PyEval_EvalFrameDefault`, one per run.

use super::resolve::Kind;
use super::unwind::{End, NativeFrame};
use crate::reader::Run;

/// Native frame ids carry this bit, beside the Python reader's.
pub const NATIVE: u64 = 1 << 63;

/// A native frame named: its frame id, what the merge does with it, where it lies.
#[derive(Clone, Copy, Debug)]
pub struct Named {
    pub id: u32,
    pub kind: Kind,
    pub at: NativeFrame,
}

/// Why the halves were not merged: the thread moved between the two reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// The native stack ran more (or, whole, fewer) eval loops than the Python stack holds.
    Evals,
    /// Not one eval loop in a native stack of a thread running Python.
    NoEval,
}

/// `python` (frame ids, innermost first) held by `runs` (innermost first; None where
/// the reader cannot tell) with `native` (innermost first), ended by `end`, unwound
/// from a copy of the stack up to `copy_end`, as one stack of ids, innermost first.
pub fn merge(
    python: &[u64],
    runs: Option<&[Run]>,
    native: &[Named],
    end: End,
    copy_end: u64,
    out: &mut Vec<u64>,
) -> Result<(), Mismatch> {
    out.clear();
    let Some(runs) = runs else {
        // Without the runs: the native frames inside the innermost eval loop only.
        let inner = native.iter().position(|f| f.kind == Kind::Eval).ok_or(Mismatch::NoEval)?;
        out.extend(native[..inner].iter().filter(|f| f.kind == Kind::Shown).map(|f| NATIVE | f.id as u64));
        out.extend_from_slice(python);
        return Ok(());
    };
    let by_entry = !runs.is_empty() && runs.iter().all(|r| r.entry != 0);
    let is_eval = eval_loops(native);
    // An entry frame in the copy but past the frames unwound is on the stack: the
    // unwind stopped short of its eval loop.
    let span =
        native.first().zip(native.last()).map_or(0..0, |(inner, outer)| inner.at.sp..outer.at.caller_sp.max(copy_end));
    let (mut next, mut rest, mut outermost, mut off_stack) = (0, python, None, false);
    for (i, f) in native.iter().enumerate() {
        let eval = match runs.get(next) {
            // 3.15 keeps a thread's first entry frame off the C stack: its C callees
            // up to the interpreter, then its frames as read. Only the outermost run
            // can be that one; an inner run's entry off the stack was left behind.
            Some(run) if by_entry && !span.contains(&run.entry) && next + 1 == runs.len() => {
                off_stack = true;
                c_callees(&native[i..], next == 0, out);
                outermost = Some(out.len());
                break;
            }
            Some(run) if by_entry => holds_entry(f, run)?,
            Some(_) => is_eval(f),
            None if is_eval(f) => return Err(Mismatch::Evals),
            None => false,
        };
        if eval {
            let (run, more) = rest.split_at((runs[next].frames as usize).min(rest.len()));
            out.extend_from_slice(run);
            (rest, next, outermost) = (more, next + 1, Some(out.len()));
        } else if f.kind == Kind::Shown {
            out.push(NATIVE | f.id as u64);
        }
    }
    let outermost = outermost.ok_or(Mismatch::NoEval)?;
    if end == End::Root && next < runs.len() && !off_stack {
        return Err(Mismatch::Evals);
    }
    out.truncate(outermost);
    out.extend_from_slice(rest); // the runs past a copy that ended early
    Ok(())
}

/// Which frames are eval loops where they are found by name: those named so, and the
/// interpreter's unnamed frames as large as one of those. A stripped PGO build (Debian's)
/// moves the loop's rarely run paths out of its symbol's extent, yet they run in the
/// loop's own frame, and no other function's frame is as large.
fn eval_loops(native: &[Named]) -> impl Fn(&Named) -> bool {
    let size = |f: &Named| f.at.caller_sp.saturating_sub(f.at.sp);
    let sizes: Vec<u64> = native.iter().filter(|f| f.kind == Kind::Eval).map(size).collect();
    move |f: &Named| f.kind == Kind::Eval || f.kind == Kind::Unnamed && sizes.contains(&size(f))
}

/// The C code a run whose eval loop cannot be placed called: after the interpreter's
/// frames that called back into Python (none for the innermost run), the C frames up
/// to the next interpreter frame, which is that run's call into C. C frames with no
/// interpreter frame outside them are the thread's start-up: left out.
fn c_callees(native: &[Named], innermost: bool, out: &mut Vec<u64>) {
    let (mut in_c, start) = (innermost, out.len());
    for f in native {
        match (f.kind == Kind::Shown, in_c) {
            (true, _) => {
                in_c = true;
                out.push(NATIVE | f.id as u64);
            }
            (false, true) => return,
            (false, false) => {}
        }
    }
    out.truncate(start);
}

/// Whether `f` is the eval loop of `run`: its stack holds the run's entry frame. A
/// frame named as something else holding it, an eval loop not holding it, or an
/// entry left behind means the thread moved between the reads.
fn holds_entry(f: &Named, run: &Run) -> Result<bool, Mismatch> {
    if run.entry < f.at.sp {
        return Err(Mismatch::Evals);
    }
    let holds = run.entry < f.at.caller_sp;
    match f.kind {
        Kind::Unnamed => Ok(holds),
        Kind::Eval if holds => Ok(true),
        Kind::Internal | Kind::Shown if !holds => Ok(false),
        Kind::Eval | Kind::Internal | Kind::Shown => Err(Mismatch::Evals),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Kind::*;

    fn frames(kinds: &[(u32, Kind)]) -> Vec<Named> {
        // 0x100 bytes of stack each, from 0x1000 up.
        let at = |i: u64| NativeFrame { pc: i, sp: 0x1000 + i * 0x100, caller_sp: 0x1100 + i * 0x100 };
        kinds.iter().enumerate().map(|(i, &(id, kind))| Named { id, kind, at: at(i as u64) }).collect()
    }

    fn runs(frames: &[u32], entries: &[u64]) -> Vec<Run> {
        frames.iter().zip(entries).map(|(&frames, &entry)| Run { frames, entry }).collect()
    }

    #[test]
    fn eval_loops_become_their_python_runs() {
        // caller (py) -> ctypes -> qsort -> callback -> comparator (py) -> C leaf; thread start-up (9) dropped.
        let python = [10, 11, 12]; // comparator, caller, main
        let kinds = [
            (1, Shown),
            (2, Internal),
            (3, Eval),
            (4, Shown),
            (5, Shown),
            (6, Internal),
            (7, Eval),
            (8, Eval),
            (9, Shown),
        ];
        let native = frames(&kinds);
        let mut out = Vec::new();
        merge(&python, Some(&runs(&[1, 1, 1], &[0, 0, 0])), &native, End::Root, 0, &mut out).unwrap();
        assert_eq!(out, vec![NATIVE | 1, 10, NATIVE | 4, NATIVE | 5, 11, 12]);
        // By entry frames: unnamed frames 3, 7 and 8 hold them.
        let unnamed = frames(&kinds.map(|(id, k)| (id, if k == Eval { Unnamed } else { k })));
        merge(&python, Some(&runs(&[1, 1, 1], &[0x1210, 0x1620, 0x17f0])), &unnamed, End::Root, 0, &mut out).unwrap();
        assert_eq!(out, vec![NATIVE | 1, 10, NATIVE | 4, NATIVE | 5, 11, 12]);
    }

    #[test]
    fn disagreeing_halves_are_refused() {
        let mut out = Vec::new();
        let native = frames(&[(1, Shown), (3, Eval)]);
        let two = runs(&[1, 1], &[0, 0]);
        assert_eq!(merge(&[10, 11], Some(&two), &native, End::Root, 0, &mut out), Err(Mismatch::Evals));
        assert_eq!(
            merge(&[10], Some(&two[..1]), &frames(&[(1, Shown)]), End::Root, 0, &mut out),
            Err(Mismatch::NoEval)
        );
        let evals = frames(&[(3, Eval), (3, Eval)]);
        assert_eq!(merge(&[10], Some(&two[..1]), &evals, End::Root, 0, &mut out), Err(Mismatch::Evals));
        // A copy that ended early keeps the outer runs as they are.
        merge(&[10, 11], Some(&two), &native, End::Cut, 0, &mut out).unwrap();
        assert_eq!(out, vec![NATIVE | 1, 10, 11]);
        // An entry frame inside a named C function, or below the frame that should hold it.
        let named = frames(&[(1, Shown), (3, Unnamed)]);
        assert_eq!(merge(&[10], Some(&runs(&[1], &[0x1010])), &named, End::Root, 0, &mut out), Err(Mismatch::Evals));
        let unnamed = frames(&[(3, Unnamed), (4, Unnamed)]);
        assert_eq!(
            merge(&[10], Some(&runs(&[1, 1], &[0x1050, 0x1020])), &unnamed, End::Root, 0, &mut out),
            Err(Mismatch::Evals)
        );
    }

    #[test]
    fn only_the_outermost_run_may_have_its_entry_off_the_stack() {
        // The thread left the callback's run (its entry now below the stack) for C code.
        let mut out = Vec::new();
        let native = frames(&[(1, Shown), (2, Shown), (3, Unnamed), (4, Shown)]);
        let stale = runs(&[1, 2], &[0x0f00, 0x40]);
        assert_eq!(merge(&[10, 11, 12], Some(&stale), &native, End::Root, 0, &mut out), Err(Mismatch::Evals));
    }

    #[test]
    fn an_unwind_stopped_short_of_an_entry_in_the_copy_is_refused() {
        // A BLAS kernel without unwind information: its caller reads as the root. The
        // entry frame lies in the copy above it, so it is not off the stack.
        let mut out = Vec::new();
        let kernel = frames(&[(1, Shown)]);
        let one = runs(&[2], &[0x3000]);
        assert_eq!(merge(&[10, 11], Some(&one), &kernel, End::Root, 0x8000, &mut out), Err(Mismatch::NoEval));
        // An entry outside the stack copied (3.15's first, in the thread state) is off it.
        merge(&[10, 11], Some(&runs(&[2], &[0x40])), &kernel, End::Root, 0x8000, &mut out).unwrap();
    }

    #[test]
    fn runs_whose_entry_is_off_the_stack_are_kept_as_read() {
        // 3.15: the first run's entry frame is in the thread state, not on the C stack.
        let mut out = Vec::new();
        let native = frames(&[(1, Shown), (2, Unnamed), (3, Unnamed), (4, Shown)]);
        merge(&[10, 11, 12], Some(&runs(&[1, 2], &[0x1150, 0x40])), &native, End::Root, 0, &mut out).unwrap();
        assert_eq!(out, vec![NATIVE | 1, 10, 11, 12], "thread start-up (4) left out");
        // The only run (module code in the main thread): the leaf C code, then its frames.
        let main = frames(&[(1, Shown), (5, Shown), (2, Unnamed), (3, Unnamed), (4, Shown)]);
        merge(&[10, 11], Some(&runs(&[2], &[0x40])), &main, End::Root, 0, &mut out).unwrap();
        assert_eq!(out, vec![NATIVE | 1, NATIVE | 5, 10, 11]);
        // After a callback's run: the C between the two runs, not thread start-up.
        let back = frames(&[(2, Unnamed), (6, Internal), (7, Shown), (8, Unnamed), (9, Unnamed), (4, Shown)]);
        merge(&[10, 11], Some(&runs(&[1, 1], &[0x1050, 0x40])), &back, End::Root, 0, &mut out).unwrap();
        assert_eq!(out, vec![10, NATIVE | 7, 11]);
    }

    #[test]
    fn an_unnamed_frame_as_large_as_the_eval_loop_is_one() {
        // Python `f` -> C -> the loop's split-off part (unnamed, the loop's frame size)
        // -> a C helper (unnamed, smaller) -> C leaf; then `main`'s loop, named.
        let at = |sp: u64, size: u64| NativeFrame { pc: sp, sp, caller_sp: sp + size };
        let named = |id, kind, sp, size| Named { id, kind, at: at(sp, size) };
        let native = [
            named(1, Shown, 0x1000, 0x40),
            named(2, Unnamed, 0x1040, 0x1a0),
            named(3, Unnamed, 0x11e0, 0x30),
            named(4, Eval, 0x1210, 0x1a0),
        ];
        let mut out = Vec::new();
        merge(&[10, 11], Some(&runs(&[1, 1], &[0, 0])), &native, End::Root, 0, &mut out).unwrap();
        assert_eq!(out, vec![NATIVE | 1, 10, 11]);
        let smaller = [native[0], named(2, Unnamed, 0x1040, 0x100), native[2], native[3]];
        assert_eq!(
            merge(&[10, 11], Some(&runs(&[1, 1], &[0, 0])), &smaller, End::Root, 0, &mut out),
            Err(Mismatch::Evals)
        );
    }

    #[test]
    fn without_runs_only_the_leaf_is_merged() {
        let mut out = Vec::new();
        let native = frames(&[(1, Shown), (2, Eval), (4, Shown), (3, Eval)]);
        merge(&[10, 11], None, &native, End::Root, 0, &mut out).unwrap();
        assert_eq!(out, vec![NATIVE | 1, 10, 11]);
    }
}
