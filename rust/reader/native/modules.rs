//! The modules (executable and shared libraries) loaded in this process: their code's
//! addresses, their unwind tables for framehop and their symbols. Each file is mapped
//! read-only once and parsed once; our own mapping keeps a module's tables valid even
//! after the program unloads it. The list is taken again with `dl_iterate_phdr` (on
//! the sampling thread only: it takes the loader's lock) when the loader's counts of
//! loads and unloads moved.

use super::signal::read_word;
use super::symbols::{readable, Symbols};
use framehop::x86_64::UnwinderX86_64;
use framehop::{ExplicitModuleSectionInfo, Module as UnwindModule, Unwinder};
use memmap2::Mmap;
use nix::libc;
use object::{Object, ObjectSection};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::ffi::CStr;
use std::ops::{Deref, Range};
use std::sync::Arc;

/// Functions indexed across all modules at most (16 bytes each): past it, a module's
/// addresses read as `library+offset`.
const MAX_SYMBOLS: usize = 4 << 20;
/// The eval loop's function: where Python frames are merged in.
pub const EVAL: &str = "_PyEval_EvalFrameDefault";

/// A module's bytes: its file mapped, or (the vDSO, which has no file) a copy.
pub enum Image {
    Mapped(Mmap),
    Copied(Vec<u8>),
}

impl Image {
    /// Gives back the pages read so far: reading a module's symbols touches all of its
    /// symbol and string tables, and a file's pages mapped here count in the process's
    /// RSS (which dask's memory limits watch). Later reads page in only what they use.
    fn release(&self) {
        if let Image::Mapped(m) = self {
            // SAFETY: a read-only private file mapping: dropped pages read back from the file.
            let _ = unsafe { m.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }
}

impl Deref for Image {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Image::Mapped(m) => m,
            Image::Copied(v) => v,
        }
    }
}

/// Bytes of a module's image, as framehop wants its sections.
#[derive(Clone)]
pub struct Section {
    map: Arc<Image>,
    range: Range<usize>,
}

impl Deref for Section {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[self.range.clone()]
    }
}

/// The kernel's vDSO (clock_gettime, gettimeofday), named as the loader names it.
const VDSO: &str = "linux-vdso.so.1";

pub struct Module {
    /// The file's name, without its directory.
    pub name: String,
    path: String,
    /// Its code, in this process.
    pub code: Range<u64>,
    /// Load bias: this process's address of the module's stated address 0.
    pub bias: u64,
    /// The interpreter itself (libpython, or an executable with the eval loop).
    pub interpreter: bool,
    map: Option<Arc<Image>>,
    symbols: Symbols,
}

impl Module {
    /// The readable name of the function at `addr` (in this process).
    pub fn function(&self, addr: u64) -> Option<String> {
        let map = self.map.as_ref()?;
        self.symbols.lookup(addr.wrapping_sub(self.bias), map).map(readable)
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct ModuleStats {
    pub modules: usize,
    pub symbols: usize,
    /// Memory the symbol indices take.
    pub symbol_bytes: usize,
    /// Bytes of files mapped (shared with the loader's own mapping, paged in as read).
    pub mapped_bytes: usize,
    pub listings: u64,
    pub unreadable: u64,
}

/// One module as the loader lists it.
struct Listed {
    path: String,
    bias: u64,
    code: Range<u64>,
}

pub struct Modules {
    /// Sorted by code address.
    list: Vec<Module>,
    pub unwinder: UnwinderX86_64<Section>,
    counts: (u64, u64),
    pub stats: ModuleStats,
    /// `after_call`'s answers: a stack holds the same return addresses tick after tick.
    calls: FxHashMap<u64, bool>,
}

/// `after_call`'s answers kept, at most.
const CALLS_KEPT: usize = 4096;

impl Modules {
    pub fn new() -> Modules {
        let mut m = Modules {
            list: Vec::new(),
            unwinder: UnwinderX86_64::new(),
            counts: (u64::MAX, u64::MAX),
            stats: ModuleStats::default(),
            calls: FxHashMap::default(),
        };
        m.refresh();
        m
    }

    /// The module whose code holds `addr`.
    pub fn find(&self, addr: u64) -> Option<&Module> {
        // Most words a stack scan meets are no code address at all.
        if addr < self.list.first()?.code.start || addr >= self.list.last()?.code.end {
            return None;
        }
        let i = self.list.partition_point(|m| m.code.start <= addr).checked_sub(1)?;
        Some(&self.list[i]).filter(|m| m.code.contains(&addr))
    }

    /// Whether `addr` can be a return address: in a module's code, just after bytes
    /// that decode as a call.
    pub fn after_call(&mut self, addr: u64) -> bool {
        if self.find(addr).is_none() {
            return false;
        }
        if self.calls.len() >= CALLS_KEPT {
            self.calls.clear();
        }
        *self.calls.entry(addr).or_insert_with(|| code_before(addr).is_some_and(|code| ends_in_call(&code)))
    }

    /// Lists the modules again if any were loaded or unloaded since the last listing.
    pub fn refresh(&mut self) {
        let (listed, counts) = list();
        if counts == self.counts {
            return;
        }
        self.counts = counts;
        self.stats.listings += 1;
        let same = |m: &Module, l: &Listed| m.path == l.path && m.bias == l.bias && m.code == l.code;
        let (kept, gone): (Vec<Module>, Vec<Module>) =
            std::mem::take(&mut self.list).into_iter().partition(|m| listed.iter().any(|l| same(m, l)));
        for m in gone {
            self.unwinder.remove_module(m.code.start);
        }
        self.list = kept;
        for l in listed {
            if !self.list.iter().any(|m| same(m, &l)) {
                let module = self.load(l);
                self.list.push(module);
            }
        }
        self.list.sort_by_key(|m| m.code.start);
        self.calls.clear();
        self.stats.modules = self.list.len();
        self.stats.symbols = self.list.iter().map(|m| m.symbols.len()).sum();
        self.stats.symbol_bytes = self.list.iter().map(|m| m.symbols.bytes()).sum();
        self.stats.mapped_bytes = self.list.iter().filter_map(|m| m.map.as_ref()).map(|m| m.len()).sum();
    }

    /// Gives back every module's pages read so far (see `Image::release`).
    pub fn release(&self) {
        self.list.iter().filter_map(|m| m.map.as_ref()).for_each(|m| m.release());
    }

    fn load(&mut self, l: Listed) -> Module {
        let name = short_name(&l.path).to_string();
        let mut module = Module {
            interpreter: name.starts_with("libpython"),
            name,
            path: l.path,
            code: l.code,
            bias: l.bias,
            map: None,
            symbols: Symbols::empty(),
        };
        let Some(map) = image(&module.path).map(Arc::new) else {
            self.stats.unreadable += 1;
            return module;
        };
        let Ok(file) = object::File::parse(&**map) else {
            self.stats.unreadable += 1;
            return module;
        };
        let budget = MAX_SYMBOLS.saturating_sub(self.list.iter().map(|m| m.symbols.len()).sum());
        module.symbols = Symbols::read(&file, &map, budget);
        module.interpreter |= module.symbols.defines(EVAL.as_bytes(), &map);
        map.release();
        let section = |name: &str| {
            let s = file.section_by_name(name)?;
            let (offset, size) = s.file_range()?;
            let range = offset as usize..(offset + size) as usize;
            Some((s.address()..s.address() + size, Section { map: map.clone(), range }))
        };
        let (text, eh_frame, eh_frame_hdr) = (section(".text"), section(".eh_frame"), section(".eh_frame_hdr"));
        let got = file.section_by_name(".got").map(|s| s.address()..s.address() + s.size());
        let info = ExplicitModuleSectionInfo {
            base_svma: 0,
            text_svma: text.as_ref().map(|t| t.0.clone()),
            text: text.map(|t| t.1),
            got_svma: got,
            eh_frame_svma: eh_frame.as_ref().map(|e| e.0.clone()),
            eh_frame: eh_frame.map(|e| e.1),
            eh_frame_hdr_svma: eh_frame_hdr.as_ref().map(|e| e.0.clone()),
            eh_frame_hdr: eh_frame_hdr.map(|e| e.1),
            stubs_svma: None,
            stub_helper_svma: None,
            unwind_info: None,
            debug_frame: None,
            text_segment_svma: None,
            text_segment: None,
        };
        self.unwinder.add_module(UnwindModule::new(module.name.clone(), module.code.clone(), module.bias, info));
        module.map = Some(map);
        module
    }
}

/// The 8 bytes of code before `addr`, read through the kernel: a module unloaded
/// since it was listed gives None rather than a fault.
fn code_before(addr: u64) -> Option<[u8; 8]> {
    read_word(addr.checked_sub(8)?).map(u64::to_le_bytes)
}

/// Whether `code` ends in an x86-64 call: `e8 rel32`, or `ff /2` (through a register
/// or memory, 2 to 7 bytes with a REX prefix, SIB byte or displacement).
fn ends_in_call(code: &[u8; 8]) -> bool {
    code[3] == 0xe8 || (2..=7).any(|len| code[8 - len] == 0xff && (code[9 - len] >> 3) & 7 == 2)
}

/// A module's name as shown: its path below `site-packages` (two packages can ship a
/// `lib.cpython-311-x86_64-linux-gnu.so`), else its file name.
fn short_name(path: &str) -> &str {
    let packages = ["/site-packages/", "/dist-packages/"];
    let below = packages.iter().find_map(|p| path.rfind(p).map(|i| &path[i + p.len()..]));
    below.unwrap_or_else(|| path.rsplit('/').next().unwrap_or(path))
}

/// The bytes of the module at `path`: its file mapped, or the vDSO copied.
fn image(path: &str) -> Option<Image> {
    if path == VDSO {
        return vdso().map(Image::Copied);
    }
    let file = std::fs::File::open(path).ok()?;
    // SAFETY: a read-only private mapping; a file truncated under it could fault, as
    // it would for the loader's own mapping of the same code.
    unsafe { Mmap::map(&file) }.ok().map(Image::Mapped)
}

/// A copy of the vDSO's ELF image: its header says how long it is.
fn vdso() -> Option<Vec<u8>> {
    // SAFETY: the kernel maps the vDSO at AT_SYSINFO_EHDR for the process's life, a
    // whole ELF image from its header to its section headers' end.
    unsafe {
        let base = libc::getauxval(libc::AT_SYSINFO_EHDR) as *const u8;
        if base.is_null() {
            return None;
        }
        let header = &*(base as *const libc::Elf64_Ehdr);
        let len = header.e_shoff as usize + header.e_shnum as usize * header.e_shentsize as usize;
        (len <= 1 << 20).then(|| std::slice::from_raw_parts(base, len).to_vec())
    }
}

/// The loader's modules with a file (and the vDSO), and its counts of loads and unloads.
fn list() -> (Vec<Listed>, (u64, u64)) {
    struct Out {
        listed: Vec<Listed>,
        counts: (u64, u64),
        exe: String,
    }
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut libc::c_void) -> libc::c_int {
        // SAFETY: the loader passes a valid info for the call; `data` is our `Out`.
        let (info, out) = unsafe { (&*info, &mut *(data as *mut Out)) };
        out.counts = (info.dlpi_adds, info.dlpi_subs);
        let name = if info.dlpi_name.is_null() {
            String::new()
        } else {
            // SAFETY: a NUL-terminated name owned by the loader.
            unsafe { CStr::from_ptr(info.dlpi_name) }.to_string_lossy().into_owned()
        };
        let path = if name.is_empty() { out.exe.clone() } else { name };
        // SAFETY: the loader's program headers, `dlpi_phnum` of them.
        let headers = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
        let code = headers
            .iter()
            .filter(|h| h.p_type == libc::PT_LOAD && h.p_flags & libc::PF_X != 0)
            .map(|h| info.dlpi_addr + h.p_vaddr..info.dlpi_addr + h.p_vaddr + h.p_memsz)
            .reduce(|a, b| a.start.min(b.start)..a.end.max(b.end));
        if let Some(code) = code.filter(|_| path.starts_with('/') || path == VDSO) {
            out.listed.push(Listed { path, bias: info.dlpi_addr, code });
        }
        0
    }
    let exe = std::fs::read_link("/proc/self/exe").map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    let mut out = Out { listed: Vec::new(), counts: (0, 0), exe };
    // SAFETY: the callback only reads what the loader passes and writes `out`.
    unsafe { libc::dl_iterate_phdr(Some(each), &mut out as *mut Out as *mut libc::c_void) };
    (out.listed, out.counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_are_named_below_site_packages() {
        let pandas = "/v/lib/python3.11/site-packages/pandas/_libs/lib.cpython-311-x86_64-linux-gnu.so";
        assert_eq!(short_name(pandas), "pandas/_libs/lib.cpython-311-x86_64-linux-gnu.so");
        assert_eq!(short_name("/usr/lib/x86_64-linux-gnu/libc.so.6"), "libc.so.6");
        assert_eq!(short_name(VDSO), VDSO);
    }

    #[test]
    fn calls_are_told_from_other_code() {
        let ending = |tail: &[u8]| {
            let mut code = [0x90u8; 8]; // nops before
            code[8 - tail.len()..].copy_from_slice(tail);
            ends_in_call(&code)
        };
        assert!(ending(&[0xe8, 1, 2, 3, 4]), "call rel32");
        assert!(ending(&[0xff, 0xd0]), "call rax");
        assert!(ending(&[0x41, 0xff, 0xd3]), "call r11");
        assert!(ending(&[0xff, 0x15, 1, 2, 3, 4]), "call [rip+disp32]");
        assert!(ending(&[0xff, 0x54, 0x24, 0x08]), "call [rsp+8]");
        assert!(!ending(&[0xff, 0xe0]), "jmp rax");
        assert!(!ending(&[0x48, 0x89, 0xc7]), "mov rdi, rax");
        assert!(!ending(&[]), "nops");
    }
}
