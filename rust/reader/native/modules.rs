//! The modules (executable and shared libraries) loaded in this process: their code's
//! addresses, their unwind tables for framehop and their symbols. A module is read the
//! first time one of its addresses is unwound or named (most loaded modules never are):
//! from its file with `pread` (see `elf`), and only if the file holds the program
//! headers and notes (the linker's build id) the loader mapped, so a file replaced on
//! disk since (`pip install`) never names the code loaded. The list is taken again with
//! `dl_iterate_phdr` (on the sampling thread only: it takes the loader's lock) when the
//! loader's counts of loads and unloads moved.

use super::elf::{segments, Elf, Reader, Source, SEGMENT_SIZE};
use super::realigned::Realigned;
use super::signal::{read_memory, read_word};
use super::symbols::{readable, Symbols};
use framehop::x86_64::UnwinderX86_64;
use framehop::{ExplicitModuleSectionInfo, Module as UnwindModule, Unwinder};
use nix::libc;
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::ffi::CStr;
use std::ops::Range;

/// Functions indexed across all modules at most (16 bytes each): past it, a module's
/// addresses read as `library+offset`.
const MAX_SYMBOLS: usize = 4 << 20;
/// Bytes of a note segment compared with the file, at most.
const MAX_NOTE: usize = 4096;
/// The eval loop's function: where Python frames are merged in.
pub const EVAL: &str = "_PyEval_EvalFrameDefault";

/// Bytes of a module's unwind tables, copied: framehop reads them at every unwind.
pub type Table = Vec<u8>;

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
    loaded: Loaded,
    state: State,
    /// Bytes of its unwind tables.
    tables: usize,
}

enum State {
    Unread,
    /// Named from its file, whose names are read as they are looked up.
    Named(Source, Symbols),
    /// Without names: no symbols, or a file that is not (or no longer) the one loaded.
    Nameless,
}

/// Why a module was not read.
enum Unread {
    Unreadable,
    Replaced,
}

impl Module {
    fn new(l: Listed) -> Module {
        let name = short_name(&l.path).to_string();
        Module {
            interpreter: name.starts_with("libpython"),
            name,
            path: l.path,
            code: l.code,
            bias: l.bias,
            loaded: l.loaded,
            state: State::Unread,
            tables: 0,
        }
    }

    /// Reads the module's symbols, and its unwind tables for framehop if it has some.
    fn read(&mut self, budget: usize) -> Result<Option<ExplicitModuleSectionInfo<Table>>, Unread> {
        self.state = State::Nameless; // read once, whatever comes of it
        let source = if self.path == VDSO { vdso().map(Source::Copy) } else { Source::file(&self.path) };
        let source = source.ok_or(Unread::Unreadable)?;
        let reader = source.open().ok_or(Unread::Unreadable)?;
        let elf = Elf::read(&reader).ok_or(Unread::Unreadable)?;
        if !self.loaded.matches(&elf, &reader) {
            return Err(Unread::Replaced);
        }
        let symbols = Symbols::read(&elf, &reader, budget);
        self.interpreter |= symbols.defines(EVAL.as_bytes(), &reader);
        let info = tables(&elf, &reader);
        self.tables = info.as_ref().map_or(0, table_bytes);
        drop(reader);
        if symbols.len() > 0 {
            self.state = State::Named(source, symbols);
        }
        Ok(info)
    }

    /// The readable name of the function at `addr` (in this process); a file changed
    /// since the module was read is counted in `replaced` and read no more.
    fn function(&mut self, addr: u64, counted: &mut ModuleStats) -> Option<String> {
        let State::Named(source, symbols) = &self.state else { return None };
        let name = symbols.lookup(addr.wrapping_sub(self.bias))?;
        let Some(reader) = source.open() else {
            counted.replaced += 1;
            self.state = State::Nameless;
            return None;
        };
        symbols.name(name, &reader).map(|raw| readable(&raw))
    }

    fn symbols(&self) -> &Symbols {
        match &self.state {
            State::Named(_, symbols) => symbols,
            _ => &NO_SYMBOLS,
        }
    }
}

static NO_SYMBOLS: Symbols = Symbols::empty();

/// framehop's view of a module: its `.eh_frame` and `.eh_frame_hdr` copied, and the
/// addresses of `.text` and `.got` its pointers may be relative to (framehop reads no
/// code of an ELF module: it takes no `.text`).
fn tables(elf: &Elf, reader: &Reader<'_>) -> Option<ExplicitModuleSectionInfo<Table>> {
    let eh_frame = elf.section(".eh_frame")?;
    let eh_frame_data = eh_frame.read(reader)?;
    let hdr = elf.section(".eh_frame_hdr").and_then(|h| Some((h.addresses(), h.read(reader)?)));
    let (eh_frame_hdr_svma, eh_frame_hdr) = hdr.unzip();
    Some(ExplicitModuleSectionInfo {
        base_svma: 0,
        text_svma: elf.section(".text").map(|t| t.addresses()),
        got_svma: elf.section(".got").map(|g| g.addresses()),
        eh_frame_svma: Some(eh_frame.addresses()),
        eh_frame: Some(eh_frame_data),
        eh_frame_hdr_svma,
        eh_frame_hdr,
        ..Default::default()
    })
}

fn table_bytes(info: &ExplicitModuleSectionInfo<Table>) -> usize {
    [&info.eh_frame, &info.eh_frame_hdr].into_iter().flatten().map(Vec::len).sum()
}

/// What the loader mapped of a module's file: its program headers, and its notes with
/// their offsets in the file.
struct Loaded {
    headers: Vec<u8>,
    notes: Vec<(u64, Vec<u8>)>,
}

impl Loaded {
    /// Whether the file read as `elf` holds the same.
    fn matches(&self, elf: &Elf, reader: &Reader<'_>) -> bool {
        let same = |offset: u64, bytes: &[u8]| reader.read(offset, bytes.len() as u64).as_deref() == Some(bytes);
        elf.headers.1 == self.headers.len() as u64
            && same(elf.headers.0, &self.headers)
            && self.notes.iter().all(|(offset, bytes)| same(*offset, bytes))
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct ModuleStats {
    /// Modules loaded, and those read (met in a stack).
    pub modules: usize,
    pub read: usize,
    pub symbols: usize,
    /// Memory the symbol indices take.
    pub symbol_bytes: usize,
    /// Memory the unwind tables copied take.
    pub table_bytes: usize,
    /// Spans of code whose frames framehop cannot step (see `realigned`).
    pub realigned: usize,
    pub listings: u64,
    /// Modules whose file could not be read (gone, or no ELF file).
    pub unreadable: u64,
    /// Modules whose file is not the one loaded: replaced before they were read, or
    /// changed (cut, rewritten, removed) since. Their addresses read `library+offset`.
    pub replaced: u64,
}

/// One module as the loader lists it.
struct Listed {
    path: String,
    bias: u64,
    code: Range<u64>,
    loaded: Loaded,
}

pub struct Modules {
    /// Sorted by code address.
    list: Vec<Module>,
    pub unwinder: UnwinderX86_64<Table>,
    /// The rows of their tables framehop cannot step.
    pub realigned: Realigned,
    counts: (u64, u64),
    /// The counters of `stats`.
    counted: ModuleStats,
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
            realigned: Realigned::default(),
            counts: (u64::MAX, u64::MAX),
            counted: ModuleStats::default(),
            calls: FxHashMap::default(),
        };
        m.refresh();
        m
    }

    fn index(&self, addr: u64) -> Option<usize> {
        // Most words a stack scan meets are no code address at all.
        if addr < self.list.first()?.code.start || addr >= self.list.last()?.code.end {
            return None;
        }
        let i = self.list.partition_point(|m| m.code.start <= addr).checked_sub(1)?;
        self.list[i].code.contains(&addr).then_some(i)
    }

    /// The module whose code holds `addr`.
    pub fn find(&self, addr: u64) -> Option<&Module> {
        self.index(addr).map(|i| &self.list[i])
    }

    /// The module whose code holds `addr` (read if it was not), and the readable name
    /// of the function there.
    pub fn function(&mut self, addr: u64) -> Option<(&Module, Option<String>)> {
        let i = self.index(addr)?;
        self.read(i);
        let name = self.list[i].function(addr, &mut self.counted);
        Some((&self.list[i], name))
    }

    /// The function holding `addr`, by its module's code and its name's place in that
    /// module's string table (reading the module if it was not); None where no symbol
    /// names it.
    pub fn function_key(&mut self, addr: u64) -> Option<(u64, u32)> {
        let i = self.index(addr)?;
        self.read(i);
        let m = &self.list[i];
        Some((m.code.start, m.symbols().lookup(addr.wrapping_sub(m.bias))?))
    }

    /// Reads the first module not read yet that holds one of `pcs` and has unwind
    /// tables; whether one did (an unwind over them may go further).
    pub fn read_tables(&mut self, pcs: impl IntoIterator<Item = u64>) -> bool {
        pcs.into_iter().any(|pc| self.index(pc).is_some_and(|i| self.read(i)))
    }

    /// Reads module `i` if it was not; whether its unwind tables were added now.
    fn read(&mut self, i: usize) -> bool {
        if !matches!(self.list[i].state, State::Unread) {
            return false;
        }
        let budget = MAX_SYMBOLS.saturating_sub(self.list.iter().map(|m| m.symbols().len()).sum());
        let module = &mut self.list[i];
        match module.read(budget) {
            Ok(Some(info)) => {
                self.realigned.add(&info, module.bias);
                let unwind = UnwindModule::new(module.name.clone(), module.code.clone(), module.bias, info);
                self.unwinder.add_module(unwind);
                true
            }
            Ok(None) => false,
            Err(Unread::Unreadable) => {
                self.counted.unreadable += 1;
                false
            }
            Err(Unread::Replaced) => {
                self.counted.replaced += 1;
                false
            }
        }
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
        let Some((listed, counts)) = list(self.counts) else {
            return;
        };
        self.counts = counts;
        self.counted.listings += 1;
        let same = |m: &Module, l: &Listed| m.path == l.path && m.bias == l.bias && m.code == l.code;
        let (kept, gone): (Vec<Module>, Vec<Module>) =
            std::mem::take(&mut self.list).into_iter().partition(|m| listed.iter().any(|l| same(m, l)));
        for m in gone {
            self.unwinder.remove_module(m.code.start);
            self.realigned.remove(&m.code);
        }
        self.list = kept;
        for l in listed {
            if !self.list.iter().any(|m| same(m, &l)) {
                self.list.push(Module::new(l));
            }
        }
        self.list.sort_by_key(|m| m.code.start);
        self.calls.clear();
    }

    /// Changes when a module was loaded or unloaded.
    pub fn listings(&self) -> u64 {
        self.counted.listings
    }

    pub fn stats(&self) -> ModuleStats {
        let read = self.list.iter().filter(|m| !matches!(m.state, State::Unread));
        ModuleStats {
            modules: self.list.len(),
            read: read.clone().count(),
            symbols: self.list.iter().map(|m| m.symbols().len()).sum(),
            symbol_bytes: self.list.iter().map(|m| m.symbols().bytes()).sum(),
            table_bytes: self.list.iter().map(|m| m.tables).sum(),
            realigned: self.realigned.len(),
            ..self.counted
        }
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

/// The loader's modules with a file (and the vDSO), and its counts of loads and
/// unloads; None if the counts are still `known`.
fn list(known: (u64, u64)) -> Option<(Vec<Listed>, (u64, u64))> {
    struct Out {
        listed: Vec<Listed>,
        counts: (u64, u64),
        known: (u64, u64),
    }
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut libc::c_void) -> libc::c_int {
        // SAFETY: the loader passes a valid info for the call; `data` is our `Out`.
        let (info, out) = unsafe { (&*info, &mut *(data as *mut Out)) };
        out.counts = (info.dlpi_adds, info.dlpi_subs);
        if out.counts == out.known {
            return 1; // stops the listing
        }
        out.listed.extend(listed(info));
        0
    }
    let mut out = Out { listed: Vec::new(), counts: known, known };
    // SAFETY: the callback only reads what the loader passes and writes `out`.
    unsafe { libc::dl_iterate_phdr(Some(each), &mut out as *mut Out as *mut libc::c_void) };
    (out.counts != known).then_some((out.listed, out.counts))
}

/// The module `info` describes, if it has a file (or is the vDSO) and code. Its program
/// headers and notes are read through the kernel: a file cut under the loader's
/// mapping of them reads as nothing rather than faulting.
fn listed(info: &libc::dl_phdr_info) -> Option<Listed> {
    let path = if info.dlpi_name.is_null() {
        String::new()
    } else {
        // SAFETY: a NUL-terminated name owned by the loader.
        unsafe { CStr::from_ptr(info.dlpi_name) }.to_string_lossy().into_owned()
    };
    let path =
        if path.is_empty() { std::fs::read_link("/proc/self/exe").ok()?.to_string_lossy().into_owned() } else { path };
    if !path.starts_with('/') && path != VDSO {
        return None;
    }
    let bias = info.dlpi_addr;
    let headers = read_memory(info.dlpi_phdr as u64, usize::from(info.dlpi_phnum) * SEGMENT_SIZE)?;
    let code = segments(&headers)
        .filter(|s| s.kind == libc::PT_LOAD && s.flags & libc::PF_X != 0)
        .map(|s| bias + s.vaddr..bias + s.vaddr + s.memsz)
        .reduce(|a, b| a.start.min(b.start)..a.end.max(b.end))?;
    let notes = segments(&headers)
        .filter(|s| s.kind == libc::PT_NOTE)
        .filter_map(|s| Some((s.offset, read_memory(bias + s.vaddr, (s.filesz as usize).min(MAX_NOTE))?)))
        .collect();
    Some(Listed { path, bias, code, loaded: Loaded { headers, notes } })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Modules holding libc alone, as listed, with the file at `path` in its place.
    fn libc_read_from(path: &std::path::Path) -> Modules {
        let (listed, _) = list((u64::MAX, u64::MAX)).expect("a listing");
        let mut libc = listed.into_iter().find(|l| short_name(&l.path).starts_with("libc.so")).expect("libc");
        libc.path = path.to_string_lossy().into_owned();
        let mut modules = Modules::new();
        modules.list = vec![Module::new(libc)];
        modules
    }

    #[test]
    fn only_the_file_loaded_names_its_code() {
        let getpid = libc::getpid as *const () as usize as u64;
        let loaded = Modules::new().find(getpid).expect("libc").path.clone();
        let dir = std::env::temp_dir().join(format!("dask-pyspy-modules-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let copy = dir.join("libc.so.6");
        // The same bytes at another inode (a wheel installed again): the loaded file.
        std::fs::copy(&loaded, &copy).unwrap();
        let mut modules = libc_read_from(&copy);
        let name = modules.function(getpid).and_then(|(_, name)| name);
        assert!(name.as_deref().is_some_and(|n| n.contains("getpid")), "{name:?}");
        // Cut since it was read: read no more (and never a fault).
        std::fs::File::options().write(true).open(&copy).unwrap().set_len(4096).unwrap();
        assert_eq!(modules.function(getpid).map(|(_, name)| name), Some(None));
        assert_eq!(modules.stats().replaced, 1);
        // Another file in its place (`pip install` of another version): not the one loaded.
        let mut modules = libc_read_from(&std::env::current_exe().unwrap());
        assert_eq!(modules.function(getpid).map(|(_, name)| name), Some(None));
        let stats = modules.stats();
        assert_eq!((stats.read, stats.replaced, stats.symbols), (1, 1, 0));
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
