//! What each Python thread does for dask (the task it runs, or its event loop's
//! activity), and what the thread is called.
//!
//! Set from Python in the executing thread; read by the sampler at capture time.
//! Every change bumps the thread's version so the sampler can tell that a task or
//! an activity started or ended while it was reading that thread's stack.

use crate::profile::model::Tag;
use crate::reader::clock_ns;
use crate::sync::Mutex;
use nix::libc;
use rustc_hash::FxHashSet;
use std::collections::HashMap;
use std::sync::Arc;

/// How an activity nests in the one a thread is already in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// A connection's reads and writes: they name time only outside dispatched work and
    /// state machine steps, so any activity those run names its own time.
    Connection,
    /// A dispatched piece of work (an RPC or stream op, a periodic callback, a transfer):
    /// the innermost one names the time.
    Dispatch,
    /// A state machine step: names time only outside any dispatched work, since inside
    /// it the step is the work's own (the scheduler's `task-finished` runs its stimulus).
    StateMachine,
}

/// An event-loop activity: "scheduler: task-finished", "worker: gather_dep".
#[derive(Debug, PartialEq, Eq)]
pub struct Activity {
    pub name: Arc<str>,
    pub level: Level,
}

impl Activity {
    /// Whether entering `self` while in `current` names the time `self`'s.
    fn replaces(&self, current: Option<&Activity>) -> bool {
        match (self.level, current.map(|c| c.level)) {
            (Level::Dispatch, _) | (_, None | Some(Level::Connection)) => true,
            (Level::Connection | Level::StateMachine, Some(Level::Dispatch | Level::StateMachine)) => false,
        }
    }
}

/// What a thread does: the task it runs, else the activity its event loop is in.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Marks {
    pub task: Option<Arc<Tag>>,
    pub activity: Option<Arc<Activity>>,
    /// When they last changed, on the monotonic clock: a native capture taken
    /// before then belongs to other marks.
    pub since_ns: u64,
}

/// A thread's marks during a read; Err if they changed meanwhile.
pub type ReadMarks = Result<Marks, ()>;

#[derive(Clone, Debug, Default)]
pub struct ThreadTag {
    pub version: u64,
    pub marks: Marks,
}

impl ThreadTag {
    /// Marks the thread's marks as changing now.
    fn bump(&mut self) {
        self.version += 1;
        self.marks.since_ns = clock_ns(libc::CLOCK_MONOTONIC).unwrap_or(0);
    }
}

#[derive(Default)]
pub struct ThreadTags {
    tags: Mutex<HashMap<u64, ThreadTag>>,
    names: Mutex<HashMap<u64, Arc<str>>>,
    /// The kernel's id of each thread, where Python told it (py-spy's reader reads
    /// none on 3.9 and 3.10).
    native_ids: Mutex<HashMap<u64, u64>>,
}

impl ThreadTags {
    pub fn set_tag(&self, ident: u64, tag: Tag) {
        self.update(ident, |m| m.task = Some(Arc::new(tag)));
    }

    pub fn clear_tag(&self, ident: u64) {
        self.update(ident, |m| m.task = None);
    }

    fn update(&self, ident: u64, change: impl FnOnce(&mut Marks)) {
        let mut tags = self.tags.lock();
        let entry = tags.entry(ident).or_default();
        entry.bump();
        change(&mut entry.marks);
    }

    /// Puts thread `ident` in `activity` where it names the time (see `Level`); returns
    /// the activity to go back to with `leave`.
    pub fn enter(&self, ident: u64, activity: &Arc<Activity>) -> Option<Arc<Activity>> {
        let mut tags = self.tags.lock();
        let entry = tags.entry(ident).or_default();
        let current = entry.marks.activity.clone();
        if activity.replaces(current.as_deref()) && !same(current.as_ref(), Some(activity)) {
            entry.bump();
            entry.marks.activity = Some(activity.clone());
        }
        current
    }

    /// Puts thread `ident` back in the activity `enter` returned.
    pub fn leave(&self, ident: u64, previous: Option<Arc<Activity>>) {
        let mut tags = self.tags.lock();
        let entry = tags.entry(ident).or_default();
        if !same(entry.marks.activity.as_ref(), previous.as_ref()) {
            entry.bump();
            entry.marks.activity = previous;
        }
    }

    /// The activity thread `ident` is in.
    pub fn activity(&self, ident: u64) -> Option<Arc<Activity>> {
        self.tags.lock().get(&ident).and_then(|t| t.marks.activity.clone())
    }

    /// A consistent copy of every thread's marks, taken before a stack read.
    pub fn snapshot(&self) -> HashMap<u64, ThreadTag> {
        self.tags.lock().clone()
    }

    /// Threads running a task now.
    pub fn tagged(&self) -> FxHashSet<u64> {
        self.tags.lock().iter().filter(|(_, t)| t.marks.task.is_some()).map(|(&ident, _)| ident).collect()
    }

    /// The marks of `idents`, taken right before their stacks are read.
    pub fn versions(&self, idents: &[u64]) -> Vec<Option<ThreadTag>> {
        let tags = self.tags.lock();
        idents.iter().map(|i| tags.get(i).cloned()).collect()
    }

    /// The thread's marks if they did not change since `before` was taken; `Err(())` if they did.
    pub fn stable_tag(&self, before: Option<&ThreadTag>, ident: u64) -> ReadMarks {
        unchanged(before, self.tags.lock().get(&ident))
    }

    /// `stable_tag` for each of `idents`, under one lock.
    pub fn stable_tags(&self, before: &[Option<ThreadTag>], idents: &[u64]) -> Vec<ReadMarks> {
        let tags = self.tags.lock();
        before.iter().zip(idents).map(|(b, i)| unchanged(b.as_ref(), tags.get(i))).collect()
    }

    pub fn set_name(&self, ident: u64, name: String, native_id: Option<u64>) {
        self.names.lock().insert(ident, name.into());
        self.set_native_id(ident, native_id);
    }

    /// Names a thread unless something named it already (a worker plugin, say).
    pub fn set_name_if_unnamed(&self, ident: u64, name: String, native_id: Option<u64>) {
        self.names.lock().entry(ident).or_insert_with(|| name.into());
        self.set_native_id(ident, native_id);
    }

    fn set_native_id(&self, ident: u64, native_id: Option<u64>) {
        if let Some(id) = native_id {
            self.native_ids.lock().insert(ident, id);
        }
    }

    /// Forgets an ended thread's name: its ident may be reused by a new thread.
    pub fn clear_name(&self, ident: u64) {
        self.names.lock().remove(&ident);
        self.native_ids.lock().remove(&ident);
    }

    pub fn native_id(&self, ident: u64) -> Option<u64> {
        self.native_ids.lock().get(&ident).copied()
    }

    pub fn name(&self, ident: u64) -> Option<String> {
        self.names.lock().get(&ident).map(|n| String::from(&**n))
    }
}

fn unchanged(before: Option<&ThreadTag>, now: Option<&ThreadTag>) -> ReadMarks {
    match (before, now) {
        (None, None) => Ok(Marks::default()),
        (Some(a), Some(b)) if a.version == b.version => Ok(a.marks.clone()),
        _ => Err(()),
    }
}

fn same(a: Option<&Arc<Activity>>, b: Option<&Arc<Activity>>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        (a, b) => a.is_none() && b.is_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_set_clear_and_versions() {
        let t = ThreadTags::default();
        let before = t.versions(&[7]);
        assert_eq!(t.stable_tags(&before, &[7]), [Ok(Marks::default())]);
        t.set_tag(7, Tag { key: "('f', 1)".into(), prefix: "f".into(), span: None });
        assert!(t.stable_tags(&before, &[7])[0].is_err(), "a tag set during the read is not trusted");
        let during = t.snapshot();
        assert_eq!(t.stable_tag(during.get(&7), 7).unwrap().task.unwrap().prefix, "f");
        let set = t.stable_tag(during.get(&7), 7).unwrap().since_ns;
        t.clear_tag(7);
        assert!(t.stable_tag(during.get(&7), 7).is_err());
        let cleared = t.stable_tag(t.snapshot().get(&7), 7).unwrap();
        assert_eq!((cleared.task, cleared.activity), (None, None));
        assert!(cleared.since_ns >= set && set > 0, "each change is timed");
    }

    fn activity(name: &str, level: Level) -> Arc<Activity> {
        Arc::new(Activity { name: name.into(), level })
    }

    fn now(t: &ThreadTags) -> Option<Arc<str>> {
        t.stable_tag(t.snapshot().get(&1), 1).unwrap().activity.map(|a| a.name.clone())
    }

    #[test]
    fn activities_nest_by_level() {
        let t = ThreadTags::default();
        let stream = activity("stream", Level::Connection);
        let op = activity("task-finished", Level::Dispatch);
        let stimulus = activity("stimulus", Level::StateMachine);
        let outer = t.enter(1, &stream);
        let in_stream = t.enter(1, &op);
        assert_eq!(now(&t).as_deref(), Some("task-finished"), "dispatched work names its time");
        let in_op = t.enter(1, &stimulus);
        assert_eq!(now(&t).as_deref(), Some("task-finished"), "a state machine inside an op is the op's");
        t.leave(1, in_op);
        t.leave(1, in_stream);
        assert_eq!(now(&t).as_deref(), Some("stream"));
        let in_connection = t.enter(1, &stimulus);
        assert_eq!(now(&t).as_deref(), Some("stimulus"), "outside any op the state machine names it");
        let write = activity("comm write", Level::Connection);
        let in_stimulus = t.enter(1, &write);
        assert_eq!(now(&t).as_deref(), Some("stimulus"), "a write inside a step is the step's");
        t.leave(1, in_stimulus);
        t.leave(1, in_connection);
        let in_stream = t.enter(1, &write);
        assert_eq!(now(&t).as_deref(), Some("comm write"), "inside a connection's loop a write is named");
        t.leave(1, in_stream);
        t.leave(1, outer);
        assert_eq!(now(&t), None);
    }

    #[test]
    fn staying_in_an_activity_tears_no_read() {
        let t = ThreadTags::default();
        let op = activity("gather", Level::Dispatch);
        let first = t.enter(1, &op);
        let before = t.versions(&[1]);
        let again = t.enter(1, &op);
        t.leave(1, again);
        assert!(t.stable_tags(&before, &[1])[0].is_ok());
        t.leave(1, first);
        assert!(t.stable_tags(&before, &[1])[0].is_err());
    }

    #[test]
    fn names() {
        let t = ThreadTags::default();
        assert_eq!(t.name(1), None);
        t.set_name(1, "MainThread".into(), Some(42));
        assert_eq!((t.name(1).as_deref(), t.native_id(1)), (Some("MainThread"), Some(42)));
        t.clear_name(1);
        assert_eq!((t.name(1), t.native_id(1)), (None, None));
    }
}
