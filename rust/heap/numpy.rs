//! numpy's array buffers, counted through its allocator handler API (NEP 49): before
//! numpy 2.5 they come from libc's `malloc`, which Python's allocators never see.
//!
//! numpy keeps its handler in a `ContextVar`, unseen by other threads, and distributed
//! runs each task in a copy of its event loop's context: ours is set as each task starts,
//! in the task's own context, where the handler found there is the one ours wraps (an
//! application's own handler is left alone). An array is freed by the handler that
//! allocated it, so ours and what it wraps are never freed.

use super::hooks;
use super::live;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

/// numpy's `free` gets the block's size too.
type Free = unsafe extern "C" fn(*mut c_void, *mut c_void, usize);

/// numpy's `PyDataMemAllocator`: Python's, but for `free`.
type Allocator = hooks::Allocator<Free>;

// SAFETY: numpy's allocator functions are thread-safe, and their `ctx` is theirs.
unsafe impl Send for Allocator {}
unsafe impl Sync for Allocator {}

/// numpy's `PyDataMem_Handler`, version 1.
#[repr(C)]
struct Handler {
    name: [u8; 127],
    version: u8,
    allocator: Allocator,
}

const CAPSULE: &CStr = c"mem_handler";
/// Slots of numpy's C API table, the same from 1.22 to 2.x.
const SET_HANDLER: usize = 304;
const GET_HANDLER: usize = 305;

type HandlerFn = unsafe extern "C" fn(*mut ffi::PyObject) -> *mut ffi::PyObject;
type GetFn = unsafe extern "C" fn() -> *mut ffi::PyObject;

struct Numpy {
    set: HandlerFn,
    get: GetFn,
    /// The handler ours wraps, and ours: capsules kept for the life of the process.
    wrapped: usize,
    ours: usize,
}

// SAFETY: plain addresses of objects never freed, used with the GIL.
unsafe impl Send for Numpy {}
unsafe impl Sync for Numpy {}

/// Found once numpy is imported (None: it has no handler API).
static NUMPY: OnceLock<Option<Numpy>> = OnceLock::new();
/// The allocator of the handler ours wraps.
static WRAPPED: OnceLock<Allocator> = OnceLock::new();

// SAFETY (all four): called by numpy with an allocator ours wraps, set before ours exists.
unsafe extern "C" fn malloc(_: *mut c_void, size: usize) -> *mut c_void {
    let a = WRAPPED.get().unwrap();
    let p = hooks::inside(|| unsafe { a.malloc.unwrap()(a.ctx, size) });
    if !p.is_null() {
        live::allocated::<false>(p as usize, size);
    }
    p
}

unsafe extern "C" fn calloc(_: *mut c_void, n: usize, size: usize) -> *mut c_void {
    let a = WRAPPED.get().unwrap();
    let p = hooks::inside(|| unsafe { a.calloc.unwrap()(a.ctx, n, size) });
    if !p.is_null() {
        live::allocated::<false>(p as usize, n.saturating_mul(size));
    }
    p
}

unsafe extern "C" fn realloc(_: *mut c_void, ptr: *mut c_void, size: usize) -> *mut c_void {
    let a = WRAPPED.get().unwrap();
    live::reallocated(ptr, size, || (hooks::inside(|| unsafe { a.realloc.unwrap()(a.ctx, ptr, size) }), true))
}

unsafe extern "C" fn free(_: *mut c_void, ptr: *mut c_void, size: usize) {
    let a = WRAPPED.get().unwrap();
    if !ptr.is_null() {
        live::freeing(ptr as usize);
    }
    hooks::inside(|| unsafe { a.free.unwrap()(a.ctx, ptr, size) })
}

/// Sets our handler in the calling thread's current context, where numpy is imported
/// and the handler there is the one ours wraps. With the GIL.
pub fn set_in_context(py: Python<'_>) -> PyResult<()> {
    if NUMPY.get().is_none() {
        let Some(numpy) = super::imported(py, "numpy") else { return Ok(()) }; // perhaps by a later task
        _ = NUMPY.set(find(py, &numpy).ok().flatten());
    }
    let Some(numpy) = NUMPY.get().and_then(Option::as_ref) else { return Ok(()) };
    // SAFETY: numpy's own functions, with the GIL; each returns a new reference.
    unsafe {
        let now = (numpy.get)();
        if now.is_null() {
            return Err(PyErr::fetch(py));
        }
        let wrapped = now as usize == numpy.wrapped;
        ffi::Py_DecRef(now);
        if wrapped {
            let previous = (numpy.set)(numpy.ours as *mut ffi::PyObject);
            if previous.is_null() {
                return Err(PyErr::fetch(py));
            }
            ffi::Py_DecRef(previous);
        }
    }
    Ok(())
}

/// numpy's handler functions, and our handler wrapping the one current now; None where
/// numpy has no handler API (< 1.22).
fn find(py: Python<'_>, numpy: &Bound<'_, PyAny>) -> PyResult<Option<Numpy>> {
    let version: String = numpy.getattr("__version__")?.extract()?;
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    if (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) < (1, 22) {
        return Ok(None); // before the handler API: its slots are other functions
    }
    let core =
        ["numpy._core._multiarray_umath", "numpy.core._multiarray_umath"].iter().find_map(|m| py.import(*m).ok());
    let Some(api) = core.and_then(|m| m.getattr("_ARRAY_API").ok()) else { return Ok(None) };
    // SAFETY: numpy's API table, an unnamed capsule of function pointers; from 1.22 on,
    // it has the handler slots.
    unsafe {
        let table = ffi::PyCapsule_GetPointer(api.as_ptr(), std::ptr::null()) as *const *const c_void;
        if table.is_null() {
            return Err(PyErr::fetch(py));
        }
        let get: GetFn = std::mem::transmute(*table.add(GET_HANDLER));
        let set: HandlerFn = std::mem::transmute(*table.add(SET_HANDLER));
        let current = get();
        if current.is_null() {
            return Err(PyErr::fetch(py));
        }
        let handler = ffi::PyCapsule_GetPointer(current, CAPSULE.as_ptr()) as *const Handler;
        if handler.is_null() {
            return Err(PyErr::fetch(py));
        }
        _ = WRAPPED.set((*handler).allocator);
        let ours = Box::leak(Box::new(Handler {
            name: name(b"dask_pyspy"),
            version: 1,
            allocator: Allocator {
                ctx: std::ptr::null_mut(),
                malloc: Some(malloc),
                calloc: Some(calloc),
                realloc: Some(realloc),
                free: Some(free),
            },
        }));
        let capsule = ffi::PyCapsule_New((ours as *mut Handler).cast(), CAPSULE.as_ptr(), None);
        if capsule.is_null() {
            return Err(PyErr::fetch(py));
        }
        // Both references are kept: the capsules live as long as the process.
        Ok(Some(Numpy { set, get, wrapped: current as usize, ours: capsule as usize }))
    }
}

fn name(text: &[u8]) -> [u8; 127] {
    let mut out = [0u8; 127];
    out[..text.len()].copy_from_slice(text);
    out
}
