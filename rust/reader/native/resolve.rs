//! Code addresses to frames: each address is looked up once (module, symbol,
//! demangled name) and kept, with what the merge does with it.

use super::modules::{Modules, EVAL};
use crate::profile::model::Frame;
use rustc_hash::FxHashMap;

/// Addresses kept at most before the cache starts over.
const MAX_ADDRESSES: usize = 65_536;
/// Distinct frames kept at most before the table starts over (ids change: `epoch`).
const MAX_FRAMES: usize = 100_000;

/// The interpreter's own functions shown although internal: garbage collection,
/// imports, allocation, the GIL and locks.
pub const SHOWN_INTERNALS: &[&str] = &[
    "gc_", "_PyGC_", "PyGC_", "_PyObject_GC_", "PyImport_", "_PyImport_", "import_", "PyObject_Malloc",
    "PyObject_Calloc", "PyObject_Realloc", "_PyObject_Malloc", "PyMem_", "_PyMem_", "pymalloc_", "take_gil",
    "drop_gil", "PyEval_RestoreThread", "PyEval_SaveThread", "PyEval_AcquireThread", "PyGILState_", "PyThread_",
    "PyMutex_", "_PyMutex_", "_PySemaphore_", "_PyParkingLot_", "lock_PyThread_acquire_lock", "acquire_timed",
];

/// What the merge does with a native frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An eval loop: replaced by the Python frames it ran.
    Eval,
    /// The interpreter's plumbing between C and Python: dropped.
    Internal,
    /// The interpreter's, with no name (a stripped build's static function): dropped,
    /// and the eval loop if it holds a run's entry frame (see `merge.rs`).
    Unnamed,
    Shown,
}

pub struct Resolver {
    by_address: FxHashMap<u64, (u32, Kind)>,
    /// The module listing `by_address` was made under: a module unloaded since may
    /// have left its addresses to another.
    listing: u64,
    frames: Vec<Frame>,
    ids: FxHashMap<Frame, u32>,
    pub epoch: u64,
    /// Addresses found in no module (module lists are refreshed for them).
    pub unknown: u64,
}

impl Resolver {
    pub fn new() -> Resolver {
        Resolver {
            by_address: FxHashMap::default(),
            listing: 0,
            frames: Vec::new(),
            ids: FxHashMap::default(),
            epoch: 0,
            unknown: 0,
        }
    }

    /// The frame id and kind of the code at `addr`.
    pub fn resolve(&mut self, addr: u64, modules: &mut Modules) -> (u32, Kind) {
        if self.listing != modules.listings() {
            self.by_address.clear();
            self.listing = modules.listings();
        }
        if let Some(&found) = self.by_address.get(&addr) {
            return found;
        }
        if modules.find(addr).is_none() {
            modules.refresh(); // a module loaded since the last listing
        }
        let (frame, kind) = describe(addr, modules);
        self.unknown += (frame.file == "?") as u64;
        if self.by_address.len() >= MAX_ADDRESSES {
            self.by_address.clear();
        }
        if self.frames.len() >= MAX_FRAMES {
            self.frames.clear();
            self.ids.clear();
            self.by_address.clear();
            self.epoch += 1;
        }
        let next = self.frames.len() as u32;
        let id = *self.ids.entry(frame.clone()).or_insert(next);
        if id == next {
            self.frames.push(frame);
        }
        self.by_address.insert(addr, (id, kind));
        (id, kind)
    }

    pub fn frame(&self, id: u32) -> Option<&Frame> {
        self.frames.get(id as usize)
    }
}

fn describe(addr: u64, modules: &mut Modules) -> (Frame, Kind) {
    let Some((module, name)) = modules.function(addr) else {
        return (Frame::native(format!("0x{addr:x}"), "?".into()), Kind::Shown);
    };
    let Some(name) = name else {
        let name = format!("{}+0x{:x}", module.name, addr - module.bias);
        let kind = if module.interpreter { Kind::Unnamed } else { Kind::Shown };
        return (Frame::native(name, module.name.clone()), kind);
    };
    let kind = match module.interpreter {
        true if name.starts_with(EVAL) => Kind::Eval,
        true if !SHOWN_INTERNALS.iter().any(|p| name.starts_with(p)) => Kind::Internal,
        _ => Kind::Shown,
    };
    (Frame::native(name, module.name.clone()), kind)
}
