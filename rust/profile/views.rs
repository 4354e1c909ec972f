//! How stacks are shown: grouped under their task, task prefix or dask span, cut to
//! the task's own code, weighted by wall or CPU time, and with repeated call cycles
//! folded so one deep recursion cannot set a flame graph's height. The samples
//! themselves are never changed.

use crate::error::Error;
use crate::names::choose;
use crate::profile::model::{Frame, ProfileData};
use crate::profile::sample::Sample;
use std::collections::HashMap;
use std::str::FromStr;

/// What the synthetic root frames of each sample are, so views group by them:
/// none, the task key, the task prefix, the span path and then the prefix, or the
/// kind of work (tasks, a scheduler's or a worker's event loop) and then the prefix
/// or activity. Outside tasks every view but `Thread` roots at the activity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum By {
    Thread,
    Task,
    Prefix,
    Span,
    Activity,
}

const BY_NAMES: [(&str, By); 5] = [
    ("thread", By::Thread),
    ("task", By::Task),
    ("prefix", By::Prefix),
    ("span", By::Span),
    ("activity", By::Activity),
];

impl FromStr for By {
    type Err = Error;
    fn from_str(s: &str) -> Result<By, Error> {
        choose("by", s, &BY_NAMES)
    }
}

impl By {
    /// The name `from_str` reads, for files that record their grouping.
    pub fn as_str(self) -> &'static str {
        BY_NAMES.iter().find(|(_, by)| *by == self).map(|(name, _)| *name).expect("every By is named")
    }
}

/// What a sample weighs in a view: the wall time it stands for, or the CPU time
/// its thread used in that time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weight {
    Wall,
    Cpu,
}

impl FromStr for Weight {
    type Err = Error;
    fn from_str(s: &str) -> Result<Weight, Error> {
        choose("weight", s, &[("wall", Weight::Wall), ("cpu", Weight::Cpu)])
    }
}

impl Weight {
    /// Microseconds.
    pub fn of(self, s: &Sample) -> u32 {
        match self {
            Weight::Wall => s.weight_us,
            // A thread's CPU since the last tick can exceed a late tick's share of it.
            Weight::Cpu => s.cpu_us.min(s.weight_us),
        }
    }
}

/// What a view shows: how stacks are grouped, and what a sample weighs.
#[derive(Clone, Copy, Debug)]
pub struct Shown {
    pub by: By,
    pub weight: Weight,
}

/// The root of samples in no task and no activity in task views.
pub const NO_TASK: &str = "(no task)";
/// The first root of task samples by activity.
pub const TASKS: &str = "tasks";
/// The span root of task samples that no span names (local schedulers).
pub const NO_SPAN: &str = "(no span)";

/// Code that runs tasks rather than being them: thread pools, event loops, and
/// dask's and distributed's executors (matched as parts of a file's path).
const MACHINERY: &[&str] = &[
    "/threading.py", "/concurrent/futures/", "/multiprocessing/", "/asyncio/", "/tornado/", "/distributed/",
    "/dask/_task_spec.py", "/dask/core.py", "/dask/local.py", "/dask/threaded.py", "/dask/utils.py", "/dask_pyspy/",
];

/// Whether `frame` is in the machinery that runs tasks.
pub fn is_machinery(frame: &Frame) -> bool {
    MACHINERY.iter().any(|m| frame.file.contains(m))
}

/// An activity's kind of process and its own name: "scheduler: task-finished" is
/// ("scheduler", "task-finished"); a name without a kind has kind "".
pub fn split_activity(activity: &str) -> (&str, &str) {
    activity.split_once(": ").unwrap_or(("", activity))
}

/// The longest call cycle folded: recursion through up to this many functions.
const MAX_CYCLE: usize = 8;

pub struct View<'a> {
    data: &'a ProfileData,
    machinery: Vec<bool>,
    /// Per frame: its function (name and file, any line), for spotting recursion.
    function: Vec<u32>,
}

impl<'a> View<'a> {
    pub fn new(data: &'a ProfileData) -> View<'a> {
        let mut functions: HashMap<(&str, &str), u32> = HashMap::new();
        let function = data
            .frames
            .iter()
            .map(|f| {
                let next = functions.len() as u32;
                *functions.entry((&f.name, &f.file)).or_insert(next)
            })
            .collect();
        let machinery = data.frames.iter().map(is_machinery).collect();
        View { data, machinery, function }
    }

    /// The roots a sample of `tag` or else `activity` is grouped under, outermost
    /// first (none by thread).
    pub fn roots(&self, tag: Option<u32>, activity: Option<u32>, by: By) -> Vec<&'a str> {
        let data = self.data;
        let tag = tag.map(|t| &data.tags[t as usize]);
        let activity = activity.map(|a| data.activities[a as usize].as_str());
        match (by, tag, activity) {
            (By::Thread, _, _) => Vec::new(),
            (By::Activity, None, Some(a)) => match split_activity(a) {
                ("", name) => vec![name],
                (kind, name) => vec![kind, name],
            },
            (_, None, Some(a)) => vec![a],
            (_, None, None) => vec![NO_TASK],
            (By::Task, Some(t), _) => vec![&t.key],
            (By::Prefix, Some(t), _) => vec![&t.prefix],
            (By::Activity, Some(t), _) => vec![TASKS, &t.prefix],
            (By::Span, Some(t), _) => {
                let mut roots = data.span_names(t);
                if roots.is_empty() {
                    roots.push(NO_SPAN);
                }
                roots.push(&t.prefix);
                roots
            }
        }
    }

    /// Frames of `stack` root first, below the first frame of the task's own code
    /// cut when `cut` (the leaf stays when the thread was inside the machinery).
    pub fn frames(&self, stack: u32, cut: bool) -> &'a [u32] {
        let frames = &self.data.stacks[stack as usize][..];
        if !cut {
            return frames;
        }
        let first_own = frames.iter().position(|&f| !self.machinery[f as usize]);
        &frames[first_own.unwrap_or(frames.len().saturating_sub(1))..]
    }

    /// `frames` with every directly repeated call cycle kept once (its innermost
    /// copy, which holds the lines being run).
    pub fn folded(&self, frames: &[u32]) -> Vec<u32> {
        let mut out: Vec<u32> = Vec::with_capacity(frames.len());
        for &f in frames {
            out.push(f);
            while let Some(len) = self.repeated_cycle(&out) {
                let n = out.len();
                out.drain(n - 2 * len..n - len);
            }
        }
        out
    }

    /// The length of a cycle that `out` ends with twice in a row.
    fn repeated_cycle(&self, out: &[u32]) -> Option<usize> {
        let n = out.len();
        (1..=MAX_CYCLE.min(n / 2)).find(|&len| {
            let (a, b) = (&out[n - 2 * len..n - len], &out[n - len..]);
            a.iter().zip(b).all(|(&x, &y)| self.function[x as usize] == self.function[y as usize])
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::model::tests::profile;

    fn names(data: &ProfileData, frames: &[u32]) -> Vec<String> {
        frames.iter().map(|&f| data.frames[f as usize].name.clone()).collect()
    }

    #[test]
    fn by_parses_and_rejects() {
        assert_eq!("prefix".parse::<By>().unwrap(), By::Prefix);
        assert!("stack".parse::<By>().unwrap_err().to_string().contains("'thread', 'task', 'prefix', 'span'"));
        assert!("gpu".parse::<Weight>().unwrap_err().to_string().contains("'wall', 'cpu'"));
    }

    #[test]
    fn task_stacks_start_at_the_tasks_own_code() {
        let mut data = profile(
            "w",
            &[
                (1, &["boot", "pool", "run_task", "user", "helper"], Some("user-1")),
                (1, &["boot", "pool"], Some("user-1")),
            ],
        );
        for (i, file) in ["/py/threading.py", "/site/distributed/threadpoolexecutor.py", "/site/dask/_task_spec.py"]
            .iter()
            .enumerate()
        {
            data.frames[i].file = file.to_string();
        }
        let view = View::new(&data);
        let stack = data.samples[0].stack;
        assert_eq!(names(&data, view.frames(stack, true)), ["user", "helper"]);
        assert_eq!(view.frames(stack, false).len(), 5, "raw stacks stay available");
        assert_eq!(
            names(&data, view.frames(data.samples[1].stack, true)),
            ["pool"],
            "inside the machinery: its leaf stays"
        );
        assert_eq!(view.roots(data.samples[0].tag, None, By::Prefix), ["user"]);
        assert!(view.roots(data.samples[0].tag, None, By::Thread).is_empty());
        assert_eq!(view.roots(data.samples[0].tag, None, By::Span), [NO_SPAN, "user"]);
        assert_eq!(view.roots(None, None, By::Span), [NO_TASK]);
        data.activities.push("scheduler: task-finished".into());
        let view = View::new(&data);
        assert_eq!(view.roots(None, Some(0), By::Prefix), ["scheduler: task-finished"]);
        assert_eq!(view.roots(None, Some(0), By::Activity), ["scheduler", "task-finished"]);
        assert_eq!(view.roots(data.samples[0].tag, Some(0), By::Activity), [TASKS, "user"], "a task wins");
    }

    #[test]
    fn recursion_folds_but_repeated_wrappers_do_not() {
        let deep: Vec<&str> =
            ["main"].into_iter().chain(std::iter::repeat_n(["visit", "walk"], 80).flatten()).chain(["leaf"]).collect();
        let data = profile(
            "w",
            &[
                (1, &deep, None),
                (1, &["main", "f", "f", "f", "g"], None),
                (1, &["main", "wrapper", "a", "wrapper", "b"], None),
            ],
        );
        let view = View::new(&data);
        let fold = |i: usize| names(&data, &view.folded(view.frames(data.samples[i].stack, false)));
        assert_eq!(fold(0), ["main", "visit", "walk", "leaf"]);
        assert_eq!(fold(1), ["main", "f", "g"]);
        assert_eq!(fold(2), ["main", "wrapper", "a", "wrapper", "b"]);
    }
}
