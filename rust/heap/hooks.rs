//! Python's allocators, wrapped (`PyMem_SetAllocator`, the RAW, MEM and OBJ domains).
//! Installed while Python runs, so each wraps the allocator it found (CPython's rule);
//! blocks allocated before reach our `free` and `realloc` too, and are not ours to count.
//!
//! Each domain has functions of its own and ignores `ctx` (set to the wrapped one's):
//! another thread may read the new functions with the old `ctx`, or the old functions
//! with the new, while they are set (cpython#128679). The allocators
//! wrapped are published before ours are installed and never freed: a call that began
//! before an uninstall still finds them.
//!
//! On a GIL build pymalloc passes requests over 512 bytes to the RAW domain: a RAW call
//! made inside a MEM or OBJ call is that call's own block and is not counted again. There
//! MEM and OBJ calls are made under the GIL, and count on the GIL's count (`countdown`).

use super::live;
use nix::libc::{c_int, c_void};
use std::cell::Cell;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

pub type Malloc = unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void;
pub type Calloc = unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void;
pub type Realloc = unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> *mut c_void;
type Free = unsafe extern "C" fn(*mut c_void, *mut c_void);

/// CPython's `PyMemAllocatorEx` (stable since 3.5); with numpy's `free`, which gets
/// the size too, numpy's `PyDataMemAllocator`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Allocator<F = Free> {
    pub ctx: *mut c_void,
    pub malloc: Option<Malloc>,
    pub calloc: Option<Calloc>,
    pub realloc: Option<Realloc>,
    pub free: Option<F>,
}

extern "C" {
    fn PyMem_GetAllocator(domain: c_int, allocator: *mut Allocator);
    fn PyMem_SetAllocator(domain: c_int, allocator: *mut Allocator);
}

/// `PyMemAllocatorDomain`.
const RAW: usize = 0;
/// pymalloc's threshold: larger requests it passes to RAW.
const SMALL_REQUEST: usize = 512;
const DOMAINS: usize = 3;

static WRAPPED: [AtomicPtr<Allocator>; DOMAINS] = [const { AtomicPtr::new(std::ptr::null_mut()) }; DOMAINS];
/// Our `malloc` in the domain's chain of allocators (0: none).
static INSTALLED: [AtomicUsize; DOMAINS] = [const { AtomicUsize::new(0) }; DOMAINS];

thread_local! {
    /// Inside a MEM or OBJ call: a RAW call now is part of it.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// The allocator domain `D` wraps. Only called by our functions, installed after it was set.
fn wrapped<const D: usize>() -> &'static Allocator {
    // SAFETY: set before our functions were installed, and never freed.
    unsafe { &*WRAPPED[D].load(Ordering::Acquire) }
}

/// Runs `f`, an allocator call whose block is counted by its caller: a RAW call inside
/// it is not counted again.
pub fn inside<T>(f: impl FnOnce() -> T) -> T {
    let outer = INSIDE.try_with(|i| i.replace(true)).unwrap_or(true);
    let out = f();
    if !outer {
        _ = INSIDE.try_with(|i| i.set(false));
    }
    out
}

/// Runs the wrapped allocator's call for `size` bytes; true if it is to be counted (not a
/// RAW call made inside a MEM or OBJ one). pymalloc serves requests up to 512 bytes
/// itself, and most are: those skip the thread-local flag (a realloc never does, as a
/// large block shrinking goes to RAW too).
fn call<const D: usize, T>(size: usize, f: impl FnOnce() -> T) -> (T, bool) {
    if D == RAW {
        return (f(), !INSIDE.try_with(Cell::get).unwrap_or(false));
    }
    (if size > SMALL_REQUEST { inside(f) } else { f() }, true)
}

unsafe extern "C" fn malloc<const D: usize, const UNDER_GIL: bool>(_: *mut c_void, size: usize) -> *mut c_void {
    let a = wrapped::<D>();
    let (p, counts) = call::<D, _>(size, || unsafe { a.malloc.unwrap()(a.ctx, size) });
    if counts && !p.is_null() {
        live::allocated::<UNDER_GIL>(p as usize, size);
    }
    p
}

unsafe extern "C" fn calloc<const D: usize, const UNDER_GIL: bool>(
    _: *mut c_void,
    n: usize,
    size: usize,
) -> *mut c_void {
    let a = wrapped::<D>();
    let (p, counts) = call::<D, _>(n.saturating_mul(size), || unsafe { a.calloc.unwrap()(a.ctx, n, size) });
    if counts && !p.is_null() {
        live::allocated::<UNDER_GIL>(p as usize, n.saturating_mul(size));
    }
    p
}

unsafe extern "C" fn realloc<const D: usize>(_: *mut c_void, ptr: *mut c_void, size: usize) -> *mut c_void {
    let a = wrapped::<D>();
    live::reallocated(ptr, size, || call::<D, _>(usize::MAX, || unsafe { a.realloc.unwrap()(a.ctx, ptr, size) }))
}

unsafe extern "C" fn free<const D: usize>(_: *mut c_void, ptr: *mut c_void) {
    let a = wrapped::<D>();
    if !ptr.is_null() {
        live::freeing(ptr as usize); // before the free: no other thread has `ptr` yet
    }
    unsafe { a.free.unwrap()(a.ctx, ptr) }
}

/// Ours for domain `D`, with the `ctx` of the allocator it wraps: a thread that reads
/// the new functions with the old `ctx`, or the old with the new, calls them as it should.
fn ours<const D: usize, const UNDER_GIL: bool>(wrapping: &Allocator) -> Allocator {
    Allocator {
        ctx: wrapping.ctx,
        malloc: Some(malloc::<D, UNDER_GIL>),
        calloc: Some(calloc::<D, UNDER_GIL>),
        realloc: Some(realloc::<D>),
        free: Some(free::<D>),
    }
}

fn current(domain: usize) -> Allocator {
    let mut now = Allocator { ctx: std::ptr::null_mut(), malloc: None, calloc: None, realloc: None, free: None };
    // SAFETY: fills the struct it is given.
    unsafe { PyMem_GetAllocator(domain as c_int, &mut now) };
    now
}

/// Whether ours is the allocator installed on top for domain `D`.
fn on_top<const D: usize>() -> bool {
    current(D).malloc.map(|f| f as usize) == Some(INSTALLED[D].load(Ordering::Acquire))
}

/// Wraps every domain's allocator, unless ours is already in its chain; `gil`: whether
/// MEM and OBJ calls are made under a GIL (not on a free-threaded build). With the GIL.
pub fn install(gil: bool) {
    install_one::<0, false>();
    if gil {
        install_one::<1, true>();
        install_one::<2, true>();
    } else {
        install_one::<1, false>();
        install_one::<2, false>();
    }
}

fn install_one<const D: usize, const UNDER_GIL: bool>() {
    if INSTALLED[D].load(Ordering::Acquire) != 0 {
        return; // on top, or below one wrapped since: it counts again as tracking starts
    }
    let wrapping = Box::leak(Box::new(current(D)));
    WRAPPED[D].store(wrapping, Ordering::Release);
    let mut mine = ours::<D, UNDER_GIL>(wrapping);
    // SAFETY: `mine` is a complete allocator wrapping the one installed.
    unsafe { PyMem_SetAllocator(D as c_int, &mut mine) };
    INSTALLED[D].store(malloc::<D, UNDER_GIL> as *const () as usize, Ordering::Release);
}

/// Puts back each domain's allocator where ours is still on top; one wrapped since
/// (tracemalloc started after us) keeps ours below it, counting nothing while tracking
/// is off. With the GIL.
pub fn uninstall() {
    uninstall_one::<0>();
    uninstall_one::<1>();
    uninstall_one::<2>();
}

fn uninstall_one<const D: usize>() {
    if INSTALLED[D].load(Ordering::Acquire) == 0 || !on_top::<D>() {
        return;
    }
    let mut before = *wrapped::<D>();
    // SAFETY: the allocator ours wrapped, never freed.
    unsafe { PyMem_SetAllocator(D as c_int, &mut before) };
    INSTALLED[D].store(0, Ordering::Release);
}
