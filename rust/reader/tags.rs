//! Which task each Python thread runs, and what the thread is called.
//!
//! Set from Python in the executing thread; read by the sampler at capture time.
//! Every change bumps the thread's version so the sampler can tell that a task
//! started or ended while it was reading that thread's stack.

use crate::profile::model::Tag;
use crate::sync::Mutex;
use rustc_hash::FxHashSet;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Clone, Debug, Default)]
pub struct ThreadTag {
    pub version: u64,
    pub tag: Option<Arc<Tag>>,
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
        self.update(ident, Some(Arc::new(tag)));
    }

    pub fn clear_tag(&self, ident: u64) {
        self.update(ident, None);
    }

    fn update(&self, ident: u64, tag: Option<Arc<Tag>>) {
        let mut tags = self.tags.lock();
        let entry = tags.entry(ident).or_default();
        entry.version += 1;
        entry.tag = tag;
    }

    /// A consistent copy of every thread's tag, taken before a stack read.
    pub fn snapshot(&self) -> HashMap<u64, ThreadTag> {
        self.tags.lock().clone()
    }

    /// Threads running a task now.
    pub fn tagged(&self) -> FxHashSet<u64> {
        self.tags.lock().iter().filter(|(_, t)| t.tag.is_some()).map(|(&ident, _)| ident).collect()
    }

    /// The tags of `idents`, taken right before their stacks are read.
    pub fn versions(&self, idents: &[u64]) -> Vec<Option<ThreadTag>> {
        let tags = self.tags.lock();
        idents.iter().map(|i| tags.get(i).cloned()).collect()
    }

    /// The thread's tag if it did not change since `before` was taken; `Err(())` if it did.
    pub fn stable_tag(&self, before: Option<&ThreadTag>, ident: u64) -> Result<Option<Arc<Tag>>, ()> {
        unchanged(before, self.tags.lock().get(&ident))
    }

    /// `stable_tag` for each of `idents`, under one lock.
    pub fn stable_tags(&self, before: &[Option<ThreadTag>], idents: &[u64]) -> Vec<Result<Option<Arc<Tag>>, ()>> {
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
        self.names.lock().get(&ident).map(|n| n.to_string())
    }
}

fn unchanged(before: Option<&ThreadTag>, now: Option<&ThreadTag>) -> Result<Option<Arc<Tag>>, ()> {
    match (before, now) {
        (None, None) => Ok(None),
        (Some(a), Some(b)) if a.version == b.version => Ok(a.tag.clone()),
        _ => Err(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_set_clear_and_versions() {
        let t = ThreadTags::default();
        let before = t.versions(&[7]);
        assert_eq!(t.stable_tags(&before, &[7]), [Ok(None)]);
        t.set_tag(7, Tag { key: "('f', 1)".into(), prefix: "f".into(), span: None });
        assert!(t.stable_tags(&before, &[7])[0].is_err(), "a tag set during the read is not trusted");
        let during = t.snapshot();
        assert_eq!(t.stable_tag(during.get(&7), 7).unwrap().unwrap().prefix, "f");
        t.clear_tag(7);
        assert!(t.stable_tag(during.get(&7), 7).is_err());
        assert_eq!(t.stable_tag(t.snapshot().get(&7), 7), Ok(None));
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
