//! Code addresses to frames: each address is looked up once (module, symbol) and
//! kept, with what the merge does with it; each function is named (read from its
//! file, demangled) once, however many of its addresses samples meet.

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
    /// By function (`Modules::function_key`): a hot loop's leaf is a new address at
    /// most captures.
    by_function: FxHashMap<(u64, u32), (u32, Kind)>,
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
            by_function: FxHashMap::default(),
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
            self.forget_addresses();
            self.listing = modules.listings();
        }
        if let Some(&found) = self.by_address.get(&addr) {
            return found;
        }
        if modules.find(addr).is_none() {
            modules.refresh(); // a module loaded since the last listing
        }
        if self.by_address.len() >= MAX_ADDRESSES {
            self.by_address.clear(); // a scan past assembly meets many
        }
        let function = modules.function_key(addr);
        let found = match function.and_then(|f| self.by_function.get(&f)) {
            Some(&found) => found,
            None => {
                let found = self.intern(describe(addr, modules));
                if let Some(f) = function {
                    self.by_function.insert(f, found);
                }
                found
            }
        };
        self.by_address.insert(addr, found);
        found
    }

    /// The id of `frame` (a new one if it is new), with its kind.
    fn intern(&mut self, (frame, kind): (Frame, Kind)) -> (u32, Kind) {
        self.unknown += (frame.file == "?") as u64;
        if self.frames.len() >= MAX_FRAMES {
            self.frames.clear();
            self.ids.clear();
            self.forget_addresses();
            self.epoch += 1;
        }
        let next = self.frames.len() as u32;
        let id = *self.ids.entry(frame.clone()).or_insert(next);
        if id == next {
            self.frames.push(frame);
        }
        (id, kind)
    }

    fn forget_addresses(&mut self) {
        self.by_address.clear();
        self.by_function.clear();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_function_is_named_once_for_all_its_addresses() {
        let getpid = nix::libc::getpid as *const () as usize as u64;
        let (mut modules, mut resolver) = (Modules::new(), Resolver::new());
        let first = resolver.resolve(getpid, &mut modules);
        let named = resolver.by_function.clone();
        let second = resolver.resolve(getpid + 1, &mut modules);
        assert_eq!(first, second);
        assert!(resolver.frame(first.0).is_some_and(|f| f.name.ends_with("getpid")));
        assert_eq!((named.len(), resolver.by_function), (1, named), "named once, from the first address");
        assert_eq!(resolver.by_address.len(), 2);
    }
}
