//! A stall explained from the samples inside it: what the loop's thread did (its
//! activity, stack and time by state, the system call it was blocked in) and, while
//! it waited for the GIL, who held it (thread, task, activity, innermost function).

use crate::profile::build::Tables;
use crate::profile::model::Frame;
use crate::profile::sample::{Sample, State, FLAG_BLOCKS_LOOP};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::collections::BTreeMap;

/// A stall as the sampler finished it, and as a window gives it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stall {
    pub start_ns: u64,
    pub end_ns: u64,
    /// The thread of its loop.
    pub ident: u64,
    /// The system call the loop was blocked in for most of it.
    pub call: Option<u16>,
}

impl Stall {
    pub fn duration_ns(&self) -> u64 {
        self.end_ns - self.start_ns
    }
}

/// Frames of the loop's stack an explanation keeps, innermost first.
const STACK_FRAMES: usize = 8;
/// GIL holders an explanation names at most.
const HOLDERS: usize = 5;

#[derive(Clone, Debug, Serialize)]
pub struct Holder {
    pub thread: String,
    pub task_key: Option<String>,
    pub prefix: Option<String>,
    pub activity: Option<String>,
    pub function: String,
    pub seconds: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Explained {
    pub thread: String,
    pub start: f64,
    pub duration: f64,
    /// What the loop ran for most of it.
    pub activity: Option<String>,
    /// Seconds of the loop's thread by state, as sampled.
    pub states: BTreeMap<&'static str, f64>,
    /// The loop's stack it was sampled in most, innermost frame first.
    pub stack: Vec<String>,
    /// The system call it was blocked in most.
    pub call: Option<String>,
    pub gil_holders: Vec<Holder>,
}

/// A GIL holder's thread, tag, activity and innermost frame.
type HolderKey = (u32, Option<u32>, Option<u32>, Option<u32>);

/// `stall` explained by `samples`, those of its process inside it (ids into `src`).
pub fn explain(src: &impl Tables, stall: &Stall, samples: impl Iterator<Item = Sample>) -> Explained {
    let seconds = |us: u64| us as f64 / 1e6;
    let mut states: BTreeMap<&'static str, u64> = BTreeMap::new();
    let (mut activities, mut stacks) = (FxHashMap::default(), FxHashMap::default());
    let mut holders: FxHashMap<HolderKey, u64> = FxHashMap::default();
    let mut thread = None;
    for s in samples {
        let weight = u64::from(s.weight_us);
        let ident = src.thread(s.thread).ident;
        if ident == stall.ident {
            thread.get_or_insert(s.thread);
            *states.entry(State::of(s.flags).name()).or_default() += weight;
            *activities.entry(s.activity).or_insert(0u64) += weight;
            *stacks.entry(s.stack).or_insert(0u64) += weight;
        } else if s.flags & FLAG_BLOCKS_LOOP != 0 {
            let leaf = src.stack(s.stack).last().copied();
            *holders.entry((s.thread, s.tag, s.activity, leaf)).or_default() += weight;
        }
    }
    let heaviest = |m: FxHashMap<Option<u32>, u64>| m.into_iter().max_by_key(|&(k, w)| (w, k)).and_then(|(k, _)| k);
    let stack = stacks.into_iter().max_by_key(|&(k, w)| (w, k)).map(|(k, _)| k);
    let mut held: Vec<_> = holders.into_iter().collect();
    held.sort_by_key(|&(k, w)| (std::cmp::Reverse(w), k));
    Explained {
        thread: thread.map_or_else(|| format!("{:#x}", stall.ident), |t| thread_name(src, t)),
        start: stall.start_ns as f64 / 1e9,
        duration: stall.duration_ns() as f64 / 1e9,
        activity: heaviest(activities).map(|a| src.activity(a).clone()),
        states: states.into_iter().map(|(k, us)| (k, seconds(us))).collect(),
        stack: stack.map_or_else(Vec::new, |s| {
            src.stack(s).iter().rev().take(STACK_FRAMES).map(|&f| function(src.frame(f))).collect()
        }),
        call: stall.call.map(call_name),
        gil_holders: held
            .into_iter()
            .take(HOLDERS)
            .map(|((thread, tag, activity, leaf), weight)| {
                let tag = tag.map(|t| src.tag(t));
                Holder {
                    thread: thread_name(src, thread),
                    task_key: tag.map(|t| t.key.clone()),
                    prefix: tag.map(|t| t.prefix.clone()),
                    activity: activity.map(|a| src.activity(a).clone()),
                    function: leaf.map_or_else(|| "?".into(), |f| function(src.frame(f))),
                    seconds: seconds(weight),
                }
            })
            .collect(),
    }
}

fn thread_name(src: &impl Tables, id: u32) -> String {
    let t = src.thread(id);
    match &t.name {
        Some(name) => format!("{name} ({:#x})", t.ident),
        None => format!("{:#x}", t.ident),
    }
}

/// `name (file:line)`, the file by its last part; a native frame's `name (library)`.
pub fn function(f: &Frame) -> String {
    let file = f.file.rsplit('/').next().unwrap_or(&f.file);
    if f.native || f.line <= 0 {
        format!("{} ({file})", f.name)
    } else {
        format!("{} ({file}:{})", f.name, f.line)
    }
}

/// A system call's name, for the calls a loop blocks in; others by number.
pub fn call_name(nr: u16) -> String {
    use nix::libc::*;
    let named: &[(c_long, &str)] = &[
        (SYS_read, "read"),
        (SYS_write, "write"),
        (SYS_pread64, "pread64"),
        (SYS_pwrite64, "pwrite64"),
        (SYS_readv, "readv"),
        (SYS_writev, "writev"),
        (SYS_openat, "openat"),
        (SYS_close, "close"),
        (SYS_fsync, "fsync"),
        (SYS_fdatasync, "fdatasync"),
        (SYS_flock, "flock"),
        (SYS_fcntl, "fcntl"),
        (SYS_ppoll, "ppoll"),
        (SYS_pselect6, "pselect6"),
        (SYS_epoll_pwait, "epoll_pwait"),
        (SYS_nanosleep, "nanosleep"),
        (SYS_clock_nanosleep, "clock_nanosleep"),
        (SYS_futex, "futex"),
        (SYS_connect, "connect"),
        (SYS_accept4, "accept4"),
        (SYS_recvfrom, "recvfrom"),
        (SYS_sendto, "sendto"),
        (SYS_recvmsg, "recvmsg"),
        (SYS_sendmsg, "sendmsg"),
        (SYS_wait4, "wait4"),
        (SYS_waitid, "waitid"),
        (SYS_sched_yield, "sched_yield"),
        #[cfg(target_arch = "x86_64")]
        (SYS_poll, "poll"),
        #[cfg(target_arch = "x86_64")]
        (SYS_select, "select"),
        #[cfg(target_arch = "x86_64")]
        (SYS_epoll_wait, "epoll_wait"),
        #[cfg(target_arch = "x86_64")]
        (SYS_accept, "accept"),
        #[cfg(target_arch = "x86_64")]
        (SYS_open, "open"),
    ];
    named
        .iter()
        .find(|(n, _)| *n == c_long::from(nr))
        .map_or_else(|| format!("syscall {nr}"), |(_, name)| (*name).into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::model::tests::profile;
    use crate::profile::sample::{FLAG_ACTIVE, FLAG_GIL, FLAG_GIL_WAIT};

    #[test]
    fn the_loop_waits_for_the_gil_a_task_held() {
        let data = profile("t", &[(1, &["loop", "select"], None), (2, &["task", "sum"], Some("('slow-1', 3)"))]);
        let (loop_, task) = (data.samples[0], data.samples[1]);
        let mut samples = Vec::new();
        for i in 0..10 {
            samples.push(Sample { time_ns: i, flags: FLAG_GIL_WAIT, ..loop_ });
            samples.push(Sample { time_ns: i, flags: FLAG_ACTIVE | FLAG_GIL | FLAG_BLOCKS_LOOP, ..task });
        }
        samples.push(Sample { time_ns: 10, flags: FLAG_ACTIVE | FLAG_GIL, ..loop_ });
        let stall = Stall { start_ns: 0, end_ns: 2_000_000_000, ident: 1, call: None };
        let e = explain(&data, &stall, samples.into_iter());
        assert_eq!(e.duration, 2.0);
        let each = f64::from(loop_.weight_us) / 1e6;
        assert_eq!(e.states["gil-wait"], 10.0 * each);
        assert_eq!(e.states["cpu-gil"], each);
        assert_eq!(e.stack[0], "select (select.py:1)");
        let holder = &e.gil_holders[0];
        assert_eq!((holder.task_key.as_deref(), holder.function.as_str()), (Some("('slow-1', 3)"), "sum (sum.py:1)"));
        assert_eq!(holder.seconds, 10.0 * each);
    }

    #[test]
    fn calls_have_names() {
        assert_eq!(call_name(nix::libc::SYS_clock_nanosleep as u16), "clock_nanosleep");
        assert_eq!(call_name(999), "syscall 999");
    }
}
