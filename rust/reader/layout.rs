//! Where the reader finds things in CPython's structures, per interpreter version.
//!
//! 3.13 and later publish their offsets at run time in `_Py_DebugOffsets`, at the
//! start of `_PyRuntime`; that struct itself grows between minor versions, so it is
//! parsed with one field list per version. 3.11 and 3.12 publish nothing: their
//! offsets come from tables, measured by compiling against each version's headers.
//! Free-threaded builds (3.13t) are read from the same published offsets: their
//! bigger object header and their GIL's `enabled` flag are said there.

use super::memory::{u64_at, Batch, Memory};

/// How a thread state leads to its innermost frame.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CurrentFrame {
    /// A field of the thread state (3.13+).
    Direct(u64),
    /// Through `tstate->cframe`, a struct on the thread's C stack (3.11, 3.12).
    ViaCFrame { cframe: u64, current_frame: u64 },
}

/// Where the GIL's `locked` flag and its holder live.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GilAt {
    /// Offsets inside `_PyRuntime` (3.11).
    Runtime { locked: u64, holder: u64 },
    /// `interp->ceval.gil` points at the GIL state; offsets inside it (3.12+), and of
    /// its `enabled` flag on free-threaded builds (which can turn it on at run time, e.g.
    /// on importing a module not declared free-threading safe).
    Interp { pointer: u64, locked: u64, holder: u64, enabled: Option<u64> },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    pub version: (u8, u8),
    /// A free-threaded build (`Py_GIL_DISABLED`).
    pub free_threaded: bool,
    /// `ob_type`, and a variable-size object's `ob_size`: further in on free-threaded
    /// builds, whose header also holds the owning thread and two reference counts.
    pub ob_type: u64,
    pub ob_size: u64,
    pub interp_threads_head: u64,
    pub gil: GilAt,
    pub tstate_next: u64,
    pub current_frame: CurrentFrame,
    pub tstate_thread_id: u64,
    /// Free-threaded builds: the thread state's `state`, attached to the interpreter
    /// (running Python) or not. 3.13 does not publish it: it is the int after
    /// `_whence`, itself after the published `_status`; the self-check confirms it.
    pub tstate_state: Option<u64>,
    pub tstate_native_thread_id: u64,
    pub tstate_datastack_chunk: u64,
    /// `datastack_top`: published in our tables; on 3.13+ the word after
    /// `datastack_chunk`, trusted only once checked against a live thread.
    pub tstate_datastack_top: u64,
    pub datastack_top_published: bool,
    /// 3.15+: the frame embedded in the thread state that ends every chain.
    pub tstate_base_frame: Option<u64>,
    pub frame_size: u64,
    pub frame_previous: u64,
    pub frame_code: u64,
    pub frame_instr: u64,
    pub frame_owner: u64,
    /// Owner value of frames that are not Python calls (C-stack shims, entry frames).
    pub owner_not_python: Option<u8>,
    /// 3.11's `is_entry` byte (later versions mark an eval loop's entry by a shim frame).
    pub frame_is_entry: Option<u64>,
    pub code_filename: u64,
    pub code_name: u64,
    pub code_qualname: u64,
    pub code_linetable: u64,
    pub code_firstlineno: u64,
    pub code_bytecode: u64,
    pub unicode_state: u64,
    pub unicode_length: u64,
    pub unicode_ascii_data: u64,
    pub unicode_compact_data: u64,
    pub bytes_size: u64,
    pub bytes_data: u64,
}

/// `tstate->state` of a thread running Python.
pub const THREAD_ATTACHED: u32 = 1;
/// `ob_type` and `ob_size` of builds with the GIL.
const OB_TYPE: u64 = 8;
const OB_SIZE: u64 = 16;
/// `_PyStackChunk`: previous, size, top, then the frames.
pub const CHUNK_PREVIOUS: u64 = 0;
pub const CHUNK_SIZE: u64 = 8;
pub const CHUNK_HEADER: u64 = 24;

impl Layout {
    /// Offsets for `version`, or why this interpreter cannot be read.
    pub fn find(version: (u8, u8), debug_build: bool, runtime: u64, mem: &mut Memory) -> Result<Layout, String> {
        let v = format!("CPython {}.{}", version.0, version.1);
        match version {
            (3, 11) | (3, 12) if debug_build => {
                Err(format!("{v} debug builds have other layouts than the reader's tables"))
            }
            (3, 11) => Ok(py311()),
            (3, 12) => Ok(py312()),
            (3, 13..=15) => published(version, runtime, mem).map_err(|e| format!("{v}: {e}")),
            _ => Err(format!("{v} is not a version the fast reader knows (3.11-3.15)")),
        }
    }

    /// The span of code-object fields that change if its address is reused.
    pub fn code_identity_span(&self) -> (u64, u64) {
        let fields = [self.code_filename, self.code_name, self.code_qualname, self.code_linetable];
        let lo = *fields.iter().min().unwrap();
        (lo, fields.iter().max().unwrap() + 8 - lo)
    }

    /// Bytes of a code object to copy to have every field the reader uses.
    pub fn code_header_len(&self) -> u64 {
        [
            self.ob_size, self.code_filename, self.code_name, self.code_qualname, self.code_linetable,
            self.code_firstlineno,
        ]
        .into_iter()
        .max()
        .unwrap()
            + 8
    }

    /// Bytes of a thread state to copy to have every field the reader uses.
    pub fn tstate_len(&self) -> u64 {
        let cf = match self.current_frame {
            CurrentFrame::Direct(o) => o,
            CurrentFrame::ViaCFrame { cframe, .. } => cframe,
        };
        [
            self.tstate_next,
            cf,
            self.tstate_thread_id,
            self.tstate_native_thread_id,
            self.tstate_datastack_chunk,
            self.tstate_datastack_top,
            self.tstate_state.unwrap_or(0),
        ]
        .into_iter()
        .max()
        .unwrap()
            + 8
    }
}

/// CPython 3.11 (x86-64, release build), from its own headers.
fn py311() -> Layout {
    Layout {
        version: (3, 11),
        free_threaded: false,
        ob_type: OB_TYPE,
        ob_size: OB_SIZE,
        interp_threads_head: 16,
        gil: GilAt::Runtime { locked: 376, holder: 368 },
        tstate_next: 8,
        current_frame: CurrentFrame::ViaCFrame { cframe: 56, current_frame: 8 },
        tstate_thread_id: 152,
        tstate_state: None,
        tstate_native_thread_id: 160,
        tstate_datastack_chunk: 296,
        tstate_datastack_top: 304,
        datastack_top_published: true,
        tstate_base_frame: None,
        frame_size: 80,
        frame_previous: 48,
        frame_code: 32,
        frame_instr: 56,
        frame_owner: 69,
        owner_not_python: None,
        frame_is_entry: Some(68),
        code_filename: 112,
        code_name: 120,
        code_qualname: 128,
        code_linetable: 136,
        code_firstlineno: 72,
        code_bytecode: 184,
        unicode_state: 32,
        unicode_length: 16,
        unicode_ascii_data: 48,
        unicode_compact_data: 72,
        bytes_size: OB_SIZE,
        bytes_data: 32,
    }
}

/// CPython 3.12 (x86-64, release build), from its headers (3.12.0-3.12.6 agree).
/// ci/matrix.sh runs the reader's tests on pyenv's 3.12.1 only; the self-check at
/// start guards this table on the others.
fn py312() -> Layout {
    Layout {
        version: (3, 12),
        free_threaded: false,
        ob_type: OB_TYPE,
        ob_size: OB_SIZE,
        interp_threads_head: 72,
        gil: GilAt::Interp { pointer: 384, locked: 16, holder: 8, enabled: None },
        tstate_next: 8,
        current_frame: CurrentFrame::ViaCFrame { cframe: 56, current_frame: 0 },
        tstate_thread_id: 136,
        tstate_state: None,
        tstate_native_thread_id: 144,
        tstate_datastack_chunk: 232,
        tstate_datastack_top: 240,
        datastack_top_published: true,
        tstate_base_frame: None,
        frame_size: 80,
        frame_previous: 8,
        frame_code: 0,
        frame_instr: 56,
        frame_owner: 70,
        owner_not_python: Some(3),
        frame_is_entry: None,
        code_filename: 112,
        code_name: 120,
        code_qualname: 128,
        code_linetable: 136,
        code_firstlineno: 68,
        code_bytecode: 192,
        unicode_state: 32,
        unicode_length: 16,
        unicode_ascii_data: 40,
        unicode_compact_data: 56,
        bytes_size: OB_SIZE,
        bytes_data: 32,
    }
}

/// `_Py_DebugOffsets` field lists, section by section, up to the unicode section
/// (all the reader needs); every field is a u64 after a 24-byte header.
type Sections = &'static [(&'static str, &'static [&'static str])];

const INTERP_313: &[&str] = &[
    "size", "id", "next", "threads_head", "gc", "imports_modules", "sysdict", "builtins", "ceval_gil",
    "gil_runtime_state", "gil_runtime_state_enabled", "gil_runtime_state_locked", "gil_runtime_state_holder",
];
const INTERP_314: &[&str] = &[
    "size", "id", "next", "threads_head", "threads_main", "gc", "imports_modules", "sysdict", "builtins", "ceval_gil",
    "gil_runtime_state", "gil_runtime_state_enabled", "gil_runtime_state_locked", "gil_runtime_state_holder",
    "code_object_generation", "tlbc_generation",
];
const THREAD_313: &[&str] =
    &["size", "prev", "next", "interp", "current_frame", "thread_id", "native_thread_id", "datastack_chunk", "status"];
const THREAD_315: &[&str] = &[
    "size", "prev", "next", "interp", "current_frame", "base_frame", "last_profiled_frame", "last_profiled_frame_seq",
    "thread_id", "native_thread_id", "datastack_chunk", "status", "holds_gil", "gil_requested", "current_exception",
    "exc_state",
];
const FRAME_313: &[&str] = &["size", "previous", "executable", "instr_ptr", "localsplus", "owner"];
const FRAME_314: &[&str] =
    &["size", "previous", "executable", "instr_ptr", "localsplus", "owner", "stackpointer", "tlbc_index"];
const CODE_313: &[&str] = &[
    "size", "filename", "name", "qualname", "linetable", "firstlineno", "argcount", "localsplusnames",
    "localspluskinds", "co_code_adaptive",
];
const CODE_314: &[&str] = &[
    "size", "filename", "name", "qualname", "linetable", "firstlineno", "argcount", "localsplusnames",
    "localspluskinds", "co_code_adaptive", "co_tlbc",
];
const RUNTIME: &[&str] = &["size", "finalizing", "interpreters_head"];
const PYOBJECT: &[&str] = &["size", "ob_type"];
const TYPE_313: &[&str] = &["size", "tp_name", "tp_repr", "tp_flags"];
const TYPE_315: &[&str] = &["size", "tp_name", "tp_repr", "tp_flags", "tp_basicsize", "tp_dictoffset"];
const THREE: &[&str] = &["size", "a", "b"];
const TUPLE: &[&str] = &["size", "ob_item", "ob_size"];
const SET: &[&str] = &["size", "used", "table", "mask"];
const FLOAT: &[&str] = &["size", "ob_fval"];
const BYTES: &[&str] = &["size", "ob_size", "ob_sval"];
const UNICODE_313: &[&str] = &["size", "state", "length", "asciiobject_size"];
const UNICODE_315: &[&str] = &["size", "state", "length", "asciiobject_size", "compactunicodeobject_size"];

const V313: Sections = &[
    ("runtime_state", RUNTIME),
    ("interpreter_state", INTERP_313),
    ("thread_state", THREAD_313),
    ("interpreter_frame", FRAME_313),
    ("code_object", CODE_313),
    ("pyobject", PYOBJECT),
    ("type_object", TYPE_313),
    ("tuple_object", TUPLE),
    ("list_object", THREE),
    ("dict_object", THREE),
    ("float_object", FLOAT),
    ("long_object", THREE),
    ("bytes_object", BYTES),
    ("unicode_object", UNICODE_313),
];
const V314: Sections = &[
    ("runtime_state", RUNTIME),
    ("interpreter_state", INTERP_314),
    ("thread_state", THREAD_313),
    ("interpreter_frame", FRAME_314),
    ("code_object", CODE_314),
    ("pyobject", PYOBJECT),
    ("type_object", TYPE_313),
    ("tuple_object", TUPLE),
    ("list_object", THREE),
    ("set_object", SET),
    ("dict_object", THREE),
    ("float_object", FLOAT),
    ("long_object", THREE),
    ("bytes_object", BYTES),
    ("unicode_object", UNICODE_313),
];
const V315: Sections = &[
    ("runtime_state", RUNTIME),
    ("interpreter_state", INTERP_314),
    ("thread_state", THREAD_315),
    ("err_stackitem", &["exc_value"]),
    ("interpreter_frame", FRAME_314),
    ("code_object", CODE_314),
    ("pyobject", PYOBJECT),
    ("type_object", TYPE_315),
    ("heap_type_object", &["size", "ht_cached_keys"]),
    ("tuple_object", TUPLE),
    ("list_object", THREE),
    ("set_object", SET),
    ("dict_object", THREE),
    ("float_object", FLOAT),
    ("long_object", THREE),
    ("bytes_object", BYTES),
    ("unicode_object", UNICODE_315),
];

const COOKIE: &[u8; 8] = b"xdebugpy";
const HEADER: u64 = 24;

/// The published offsets, parsed with `sections`.
struct Published<'a> {
    sections: Sections,
    bytes: &'a [u8],
}

impl Published<'_> {
    fn get(&self, section: &str, field: &str) -> Result<u64, String> {
        let mut index = 0;
        for (name, fields) in self.sections {
            if let Some(i) = fields.iter().position(|f| *f == field).filter(|_| *name == section) {
                return Ok(u64_at(self.bytes, HEADER + 8 * (index + i) as u64));
            }
            index += fields.len();
        }
        Err(format!("no field {section}.{field} in this version's _Py_DebugOffsets"))
    }

    fn len(sections: Sections) -> u64 {
        HEADER + 8 * sections.iter().map(|(_, f)| f.len() as u64).sum::<u64>()
    }
}

fn published(version: (u8, u8), runtime: u64, mem: &mut Memory) -> Result<Layout, String> {
    let sections = match version.1 {
        13 => V313,
        14 => V314,
        _ => V315,
    };
    let mut batch = Batch::default();
    batch.push(runtime, Published::len(sections) as usize);
    mem.read(&mut batch)?;
    let bytes = batch.get(0).ok_or("_PyRuntime cannot be read")?;
    if &bytes[..8] != COOKIE {
        return Err("_PyRuntime does not start with the _Py_DebugOffsets cookie".into());
    }
    let hex = u64_at(bytes, 8);
    if (hex >> 24, (hex >> 16) & 0xff) != (version.0 as u64, version.1 as u64) {
        return Err(format!("_Py_DebugOffsets says version {hex:#x}"));
    }
    let free_threaded = u64_at(bytes, 16) != 0;
    if free_threaded && version.1 >= 14 {
        // Each thread may run its own copy of a code object's bytecode there
        // (`co_tlbc`), which instruction pointers point into, and a string's `interned`
        // takes a whole byte of its state: neither is followed yet.
        return Err("free-threaded 3.14+ runs thread-local bytecode, which the fast reader does not follow yet".into());
    }
    let p = Published { sections, bytes };
    let ascii = p.get("unicode_object", "asciiobject_size")?;
    let gil_base = p.get("interpreter_state", "gil_runtime_state")?;
    let datastack_chunk = p.get("thread_state", "datastack_chunk")?;
    Ok(Layout {
        version,
        free_threaded,
        ob_type: p.get("pyobject", "ob_type")?,
        ob_size: p.get("tuple_object", "ob_size")?,
        interp_threads_head: p.get("interpreter_state", "threads_head")?,
        gil: GilAt::Interp {
            pointer: p.get("interpreter_state", "ceval_gil")?,
            locked: p.get("interpreter_state", "gil_runtime_state_locked")? - gil_base,
            holder: p.get("interpreter_state", "gil_runtime_state_holder")? - gil_base,
            // Only free-threaded builds have the field: others publish 0 for it.
            enabled: match free_threaded {
                true => Some(p.get("interpreter_state", "gil_runtime_state_enabled")? - gil_base),
                false => None,
            },
        },
        tstate_next: p.get("thread_state", "next")?,
        current_frame: CurrentFrame::Direct(p.get("thread_state", "current_frame")?),
        tstate_thread_id: p.get("thread_state", "thread_id")?,
        tstate_state: if free_threaded { Some(p.get("thread_state", "status")? + 8) } else { None },
        tstate_native_thread_id: p.get("thread_state", "native_thread_id")?,
        tstate_datastack_chunk: datastack_chunk,
        tstate_datastack_top: datastack_chunk + 8,
        datastack_top_published: false,
        tstate_base_frame: if version.1 >= 15 { Some(p.get("thread_state", "base_frame")?) } else { None },
        frame_size: p.get("interpreter_frame", "size")?,
        frame_previous: p.get("interpreter_frame", "previous")?,
        frame_code: p.get("interpreter_frame", "executable")?,
        frame_instr: p.get("interpreter_frame", "instr_ptr")?,
        frame_owner: p.get("interpreter_frame", "owner")?,
        owner_not_python: Some(3),
        frame_is_entry: None,
        code_filename: p.get("code_object", "filename")?,
        code_name: p.get("code_object", "name")?,
        code_qualname: p.get("code_object", "qualname")?,
        code_linetable: p.get("code_object", "linetable")?,
        code_firstlineno: p.get("code_object", "firstlineno")?,
        code_bytecode: p.get("code_object", "co_code_adaptive")?,
        unicode_state: p.get("unicode_object", "state")?,
        unicode_length: p.get("unicode_object", "length")?,
        unicode_ascii_data: ascii,
        unicode_compact_data: if version.1 >= 15 {
            p.get("unicode_object", "compactunicodeobject_size")?
        } else {
            ascii + 16
        },
        bytes_size: p.get("bytes_object", "ob_size")?,
        bytes_data: p.get("bytes_object", "ob_sval")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_offsets_sizes_match_each_version() {
        // Whole-struct sizes are 584 / 760 / 888; these lists stop at the unicode section.
        assert_eq!(Published::len(V313) + 8 * 2, 584);
        assert_eq!(Published::len(V314) + 8 * (2 + 4 + 2 + 6), 760);
        assert_eq!(Published::len(V315) + 8 * (5 + 4 + 2 + 6), 888);
    }

    #[test]
    fn fields_are_found_by_section() {
        let mut bytes = vec![0u8; Published::len(V313) as usize];
        // thread_state.native_thread_id is field 3 + 13 + 6 = 22.
        bytes[(HEADER + 8 * 22) as usize] = 160;
        let p = Published { sections: V313, bytes: &bytes };
        assert_eq!(p.get("thread_state", "native_thread_id"), Ok(160));
        assert!(p.get("thread_state", "holds_gil").is_err());
    }

    /// A free-threaded 3.13 `_Py_DebugOffsets` in this process's memory, each field of
    /// `fields` set; every other field reads as its index, so all differ.
    fn debug_offsets(version: u8, free_threaded: bool, fields: &[(&str, &str, u64)]) -> Vec<u8> {
        let sections = if version == 13 { V313 } else { V314 };
        let mut bytes = vec![0u8; Published::len(sections) as usize];
        bytes[..8].copy_from_slice(COOKIE);
        bytes[8..16].copy_from_slice(&(0x0300_00f0u64 | (version as u64) << 16).to_le_bytes());
        bytes[16] = free_threaded as u8;
        let mut index = 0;
        for (section, names) in sections {
            for name in names.iter() {
                let value = fields.iter().find(|f| (f.0, f.1) == (*section, *name)).map_or(1000 + index, |f| f.2);
                let at = (HEADER + 8 * index) as usize;
                bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
                index += 1;
            }
        }
        bytes
    }

    #[test]
    fn a_free_threaded_build_is_read_from_its_published_header_and_thread_state() {
        let set = [("pyobject", "ob_type", 24), ("tuple_object", "ob_size", 32), ("thread_state", "status", 40)];
        let bytes = debug_offsets(13, true, &set);
        let layout = published((3, 13), bytes.as_ptr() as u64, &mut Memory::new()).unwrap();
        assert!(layout.free_threaded);
        assert_eq!((layout.ob_type, layout.ob_size), (24, 32));
        assert_eq!(layout.tstate_state, Some(48), "the int after _whence, after _status");
        assert!(layout.tstate_len() > 48);
        let GilAt::Interp { enabled, .. } = layout.gil else { panic!("3.13 keeps its GIL state in the interpreter") };
        assert!(enabled.is_some());

        let with_gil = published((3, 13), debug_offsets(13, false, &set).as_ptr() as u64, &mut Memory::new()).unwrap();
        assert_eq!((with_gil.free_threaded, with_gil.tstate_state), (false, None));
        let GilAt::Interp { enabled, .. } = with_gil.gil else { panic!("3.13 keeps its GIL state in the interpreter") };
        assert_eq!(enabled, None, "a build with the GIL has no enabled flag (it publishes 0)");
        let later = published((3, 14), debug_offsets(14, true, &[]).as_ptr() as u64, &mut Memory::new());
        assert!(later.is_err_and(|e| e.contains("thread-local bytecode")));
    }
}
