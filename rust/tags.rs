//! Which task each Python thread runs, and what the thread is called.
//!
//! Set from Python in the executing thread; read by the sampler at capture time.
//! Every change bumps the thread's version so the sampler can tell that a task
//! started or ended while it was reading that thread's stack.

use crate::model::Tag;
use parking_lot::Mutex;
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
}

impl ThreadTags {
    pub fn set_tag(&self, ident: u64, key: String, prefix: String) {
        self.update(ident, Some(Arc::new(Tag { key, prefix })));
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

    /// The thread's tag if it did not change since `before` was taken; `Err(())` if it did.
    pub fn stable_tag(&self, before: &HashMap<u64, ThreadTag>, ident: u64) -> Result<Option<Arc<Tag>>, ()> {
        let old = before.get(&ident);
        let tags = self.tags.lock();
        match (old, tags.get(&ident)) {
            (None, None) => Ok(None),
            (Some(a), Some(b)) if a.version == b.version => Ok(a.tag.clone()),
            _ => Err(()),
        }
    }

    pub fn set_name(&self, ident: u64, name: String) {
        self.names.lock().insert(ident, name.into());
    }

    pub fn name(&self, ident: u64) -> Option<String> {
        self.names.lock().get(&ident).map(|n| n.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_set_clear_and_versions() {
        let t = ThreadTags::default();
        let before = t.snapshot();
        assert_eq!(t.stable_tag(&before, 7), Ok(None));
        t.set_tag(7, "('f', 1)".into(), "f".into());
        assert!(t.stable_tag(&before, 7).is_err(), "a tag set during the read is not trusted");
        let during = t.snapshot();
        assert_eq!(t.stable_tag(&during, 7).unwrap().unwrap().prefix, "f");
        t.clear_tag(7);
        assert!(t.stable_tag(&during, 7).is_err());
        assert_eq!(t.stable_tag(&t.snapshot(), 7), Ok(None));
    }

    #[test]
    fn names() {
        let t = ThreadTags::default();
        assert_eq!(t.name(1), None);
        t.set_name(1, "MainThread".into());
        assert_eq!(t.name(1).as_deref(), Some("MainThread"));
    }
}
