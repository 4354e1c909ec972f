//! Opening the fast reader: find the interpreter's structures, then read the
//! calling thread's own stack (the GIL is held, so it cannot change) and compare it
//! with what Python says. Any difference, and the reader is not used: never guess.

use super::code::LineMode;
use super::fast::FastReader;
use super::frees::FreeLog;
use super::layout::{Layout, CHUNK_HEADER, CHUNK_SIZE};
use super::memory::{read_u64, Memory};
use crate::profile::model::Frame;
use crate::reader::tags::ThreadTags;
use nix::libc;
use pyo3::prelude::*;
use std::ffi::CStr;

/// Test switch (`DASK_PYSPY_TESTING=break-self-check`): makes the self-check see a
/// wrong line, to exercise the fallback.
const TESTING: &str = "DASK_PYSPY_TESTING";
const BREAK_SELF_CHECK: &str = "break-self-check";

extern "C" {
    // Not in the limited API, but exported by every CPython since 3.8.
    fn PyInterpreterState_Main() -> *mut libc::c_void;
}

fn symbol(name: &CStr) -> Result<u64, String> {
    // SAFETY: dlsym with RTLD_DEFAULT only looks a name up.
    let addr = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) } as u64;
    if addr == 0 {
        return Err(format!("the interpreter does not export {}", name.to_string_lossy()));
    }
    Ok(addr)
}

/// The fast reader for this interpreter, checked against Python's own view.
pub fn open_fast(py: Python<'_>, mode: LineMode) -> Result<FastReader, String> {
    let v = py.version_info();
    let version = (v.major, v.minor);
    let sys = py.import("sys").map_err(|e| e.to_string())?;
    let debug_build = sys.hasattr("gettotalrefcount").unwrap_or(false);
    let runtime = symbol(c"_PyRuntime")?;
    let code_type = symbol(c"PyCode_Type")?;
    // SAFETY: called with the GIL held, after the interpreter started.
    let interp = unsafe { PyInterpreterState_Main() } as u64;
    let mut mem = Memory::new();
    let layout = Layout::find(version, debug_build, runtime, &mut mem)?;
    // SAFETY: the GIL is held.
    let frees = FreeLog::new(unsafe { super::frees::watch(version) });
    let mut reader = FastReader::new(layout, mem, runtime, interp, code_type, frees, mode)?;
    self_check(py, &mut reader, mode)
        .map_err(|e| format!("self-check failed on CPython {}.{}: {e}", v.major, v.minor))?;
    Ok(reader)
}

fn self_check(py: Python<'_>, reader: &mut FastReader, mode: LineMode) -> Result<(), String> {
    let mut expected = python_stack(py, mode).map_err(|e| format!("Python's own stack: {e}"))?;
    if std::env::var_os(TESTING).is_some_and(|v| v == BREAK_SELF_CHECK) {
        expected[0].line += 1000;
    }
    let ident: u64 =
        py.import("threading").and_then(|t| t.call_method0("get_ident")?.extract()).map_err(|e| e.to_string())?;
    let mut found = reader.read_where(|t| t.ident == ident, &ThreadTags::default())?;
    let this = found.pop().ok_or("this thread is not in the interpreter's thread list")?;
    if reader.gil_enabled() && !this.state.holds_gil {
        return Err("the GIL state does not name this thread, which holds the GIL".into());
    }
    if reader.layout().tstate_state.is_some() && !this.state.attached {
        return Err("this thread, running Python, does not read as attached".into());
    }
    check_datastack(reader, this.state.chunk, this.state.top)?;
    let ids = this.frames.map_err(|()| "this thread's frames do not hold together".to_string())?;
    let got: Vec<Frame> = ids.frames.iter().map(|&id| super::StackReader::frame(reader, id)).collect();
    if got.len() != expected.len() {
        return Err(format!("read {} frames, Python has {}", got.len(), expected.len()));
    }
    match got.iter().zip(&expected).position(|(a, b)| a != b) {
        Some(i) => Err(format!("frame {i} reads as {:?}, Python has {:?}", got[i], expected[i])),
        None => Ok(()),
    }
}

/// The thread's `datastack_top` lies inside its current chunk; on 3.13+ it is not
/// published, so this is what lets the reader trust it.
fn check_datastack(reader: &mut FastReader, chunk: u64, top: u64) -> Result<(), String> {
    let size = read_u64(reader.memory(), chunk + CHUNK_SIZE).ok_or("the datastack chunk cannot be read")?;
    if !(chunk + CHUNK_HEADER < top && top <= chunk + size) {
        let published = if reader.layout().datastack_top_published { "" } else { " (unpublished field)" };
        return Err(format!("datastack_top{published} {top:#x} is outside its chunk {chunk:#x}+{size}"));
    }
    Ok(())
}

/// This thread's frames as Python reports them, innermost first.
fn python_stack(py: Python<'_>, mode: LineMode) -> PyResult<Vec<Frame>> {
    let mut frames = Vec::new();
    let mut frame = py.import("sys")?.call_method1("_getframe", (0,))?;
    while !frame.is_none() {
        let code = frame.getattr("f_code")?;
        let line = match mode {
            LineMode::Current => frame.getattr("f_lineno")?.extract::<Option<i32>>()?.unwrap_or(0),
            LineMode::First => code.getattr("co_firstlineno")?.extract()?,
            LineMode::None => 0,
        };
        frames.push(Frame::python(
            code.getattr("co_qualname")?.extract()?,
            code.getattr("co_filename")?.extract()?,
            line,
        ));
        frame = frame.getattr("f_back")?;
    }
    Ok(frames)
}
