//! One stack from a thread's Python and native halves: each eval loop in the native
//! stack is replaced by the Python frames that run of the loop holds, so a stack
//! reads Python caller -> C -> Python callback -> C. The interpreter's own plumbing
//! is dropped, and so are the native frames outside the outermost eval loop (thread
//! start-up).

use super::resolve::Kind;
use super::unwind::End;

/// Native frame ids carry this bit, beside the Python reader's.
pub const NATIVE: u64 = 1 << 63;

/// Why the halves were not merged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// The native stack ran more (or, whole, fewer) eval loops than the Python stack holds.
    Evals,
    /// Not one eval loop in a native stack of a thread running Python.
    NoEval,
}

/// `python` (frame ids, innermost first) with `evals` (frames per eval run, innermost
/// first; None where the reader cannot tell) and `native` (innermost first), ended by
/// `end`, as one stack of ids, innermost first.
pub fn merge(
    python: &[u64],
    evals: Option<&[u32]>,
    native: &[(u32, Kind)],
    end: End,
    out: &mut Vec<u64>,
) -> Result<(), Mismatch> {
    out.clear();
    let Some(evals) = evals else {
        // Without the runs: the native frames inside the innermost eval loop only.
        let inner = native.iter().position(|(_, k)| *k == Kind::Eval).ok_or(Mismatch::NoEval)?;
        out.extend(shown(&native[..inner]));
        out.extend_from_slice(python);
        return Ok(());
    };
    let (mut runs, mut rest) = (evals.iter(), python);
    let mut outermost = None;
    for &(id, kind) in native {
        match kind {
            Kind::Eval => {
                let n = *runs.next().ok_or(Mismatch::Evals)? as usize;
                let (run, more) = rest.split_at(n.min(rest.len()));
                out.extend_from_slice(run);
                rest = more;
                outermost = Some(out.len());
            }
            Kind::Internal => {}
            Kind::Shown => out.push(NATIVE | id as u64),
        }
    }
    let Some(outermost) = outermost else {
        return Err(Mismatch::NoEval);
    };
    if end == End::Root && runs.next().is_some() {
        return Err(Mismatch::Evals);
    }
    out.truncate(outermost);
    out.extend_from_slice(rest); // the runs past a copy that ended early
    Ok(())
}

fn shown(native: &[(u32, Kind)]) -> impl Iterator<Item = u64> + '_ {
    native.iter().filter(|(_, k)| *k == Kind::Shown).map(|(id, _)| NATIVE | *id as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Kind::*;

    #[test]
    fn eval_loops_become_their_python_runs() {
        // caller (py) -> ctypes -> qsort -> callback -> comparator (py) -> C leaf
        let python = [10, 11, 12]; // comparator, caller, main
        let native = [
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
        let mut out = Vec::new();
        merge(&python, Some(&[1, 1, 1]), &native, End::Root, &mut out).unwrap();
        assert_eq!(out, vec![NATIVE | 1, 10, NATIVE | 4, NATIVE | 5, 11, 12], "thread start-up (9) dropped");
    }

    #[test]
    fn disagreeing_halves_are_refused() {
        let mut out = Vec::new();
        let native = [(1, Shown), (3, Eval)];
        assert_eq!(merge(&[10, 11], Some(&[1, 1]), &native, End::Root, &mut out), Err(Mismatch::Evals));
        assert_eq!(merge(&[10], Some(&[1]), &[(1, Shown)], End::Root, &mut out), Err(Mismatch::NoEval));
        let two = [(3, Eval), (3, Eval)];
        assert_eq!(merge(&[10], Some(&[1]), &two, End::Root, &mut out), Err(Mismatch::Evals));
        // A copy that ended early keeps the outer runs as they are.
        merge(&[10, 11], Some(&[1, 1]), &native, End::Cut, &mut out).unwrap();
        assert_eq!(out, vec![NATIVE | 1, 10, 11]);
    }

    #[test]
    fn without_runs_only_the_leaf_is_merged() {
        let mut out = Vec::new();
        let native = [(1, Shown), (2, Eval), (4, Shown), (3, Eval)];
        merge(&[10, 11], None, &native, End::Root, &mut out).unwrap();
        assert_eq!(out, vec![NATIVE | 1, 10, 11]);
    }
}
