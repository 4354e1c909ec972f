//! Samples a tick took while another thread held the store (an export building a
//! window): kept here and recorded at the next tick that gets the store, so the
//! sampling thread never waits for an export. Under load a nicer export thread that
//! holds the lock can be preempted for hundreds of milliseconds.

use crate::profile::model::Frame;
use crate::reader::tags::Marks;
use crate::sampling::store::{Recorded, Store};

/// Samples kept at most (100 s of 10 threads at 100 Hz); past it a tick waits for
/// the store rather than grow without bound.
pub const MOST: usize = 100_000;

/// One sample, its frames resolved (the reader's ids may mean other frames later).
pub struct Taken {
    pub time_ns: u64,
    pub ident: u64,
    pub name: Option<String>,
    /// Root first.
    pub frames: Vec<Frame>,
    pub marks: Marks,
    pub weight_us: u32,
    pub cpu_us: u32,
    pub flags: u8,
}

#[derive(Default)]
pub struct Backlog {
    taken: Vec<Taken>,
    /// Samples that were kept here, since the sampler started.
    pub deferred: u64,
}

impl Backlog {
    pub fn is_full(&self) -> bool {
        self.taken.len() >= MOST
    }

    pub fn is_empty(&self) -> bool {
        self.taken.is_empty()
    }

    pub fn push(&mut self, taken: Taken) {
        self.taken.push(taken);
        self.deferred += 1;
    }

    /// Records every sample kept, oldest first, into `store`.
    pub fn flush(&mut self, store: &mut Store) {
        let mut ids = Vec::new();
        for t in self.taken.drain(..) {
            ids.clear();
            ids.extend(t.frames.into_iter().map(|f| store.frame_id(f)));
            store.record_ids(Recorded {
                time_ns: t.time_ns,
                ident: t.ident,
                name: t.name,
                frames: &ids,
                tag: t.marks.task.as_deref(),
                activity: t.marks.activity.as_ref().map(|a| &*a.name),
                weight_us: t.weight_us,
                cpu_us: t.cpu_us,
                flags: t.flags,
            });
        }
    }
}
