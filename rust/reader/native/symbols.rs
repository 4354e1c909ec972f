//! Function names of one module, from its ELF symbol tables (`.symtab`, else
//! `.dynsym`), indexed once. The index keeps an address, a size and a name offset per
//! function; the names stay in the file, read (and demangled) when looked up: a large
//! library's string table is megabytes, of which a profile names a few hundred.

use super::elf::{u32_at, u64_at, Elf, Reader, SHT_DYNSYM, SHT_SYMTAB};

const STT_FUNC: u8 = 2;
const STT_GNU_IFUNC: u8 = 10;
const SYMBOL_SIZE: u64 = 24;
/// Symbols read at a time.
const SYMBOLS_PER_READ: u64 = 2048;
/// Bytes of a name read first, and at most (C++ names run to kilobytes).
const NAME_FIRST: u64 = 256;
const NAME_MAX: u64 = 64 << 10;
/// Bytes of the string table scanned at a time for `defines`.
const SCAN_CHUNK: u64 = 256 << 10;

/// One function: where it starts, how long it is (0: unknown) and where its name is
/// in the string table.
#[derive(Clone, Copy)]
struct Entry {
    addr: u64,
    size: u32,
    name: u32,
}

pub struct Symbols {
    /// Sorted by address.
    entries: Vec<Entry>,
    /// The string table's place in the file.
    names: (u64, u64),
}

impl Symbols {
    /// The functions of the file `elf` read from `reader`; an empty index past `budget` entries.
    pub fn read(elf: &Elf, reader: &Reader<'_>, budget: usize) -> Symbols {
        for kind in [SHT_SYMTAB, SHT_DYNSYM] {
            let Some((table, names)) = elf.of_kind(kind).and_then(|t| Some((t, elf.at(t.link)?))) else {
                continue;
            };
            let mut entries = Vec::new();
            for first in (0..table.size / SYMBOL_SIZE).step_by(SYMBOLS_PER_READ as usize) {
                let count = SYMBOLS_PER_READ.min(table.size / SYMBOL_SIZE - first);
                let Some(chunk) = reader.read(table.offset + first * SYMBOL_SIZE, count * SYMBOL_SIZE) else {
                    break;
                };
                entries.extend(chunk.chunks_exact(SYMBOL_SIZE as usize).filter_map(|s| function(s, names.size)));
                if entries.len() > budget {
                    return Symbols::empty();
                }
            }
            if !entries.is_empty() {
                // .symtab holds .dynsym's functions too
                entries.sort_unstable_by_key(|e| (e.addr, std::cmp::Reverse(e.size)));
                entries.dedup_by_key(|e| e.addr);
                entries.shrink_to_fit();
                return Symbols { entries, names: (names.offset, names.size) };
            }
        }
        Symbols::empty()
    }

    pub const fn empty() -> Symbols {
        Symbols { entries: Vec::new(), names: (0, 0) }
    }

    /// Whether a function is named exactly `name`: the string table is scanned for
    /// the places that read `name` (a name may end a longer one: linkers share tails),
    /// which a function's name must start at.
    pub fn defines(&self, name: &[u8], reader: &Reader<'_>) -> bool {
        let wanted: Vec<u8> = [name, b"\0"].concat();
        let (mut at, mut found) = (0, Vec::new());
        while let Some(chunk) = reader.read(self.names.0 + at, SCAN_CHUNK.min(self.names.1 - at)) {
            found.extend(memchr::memmem::find_iter(&chunk, &wanted).map(|i| (at + i as u64) as u32));
            if at + chunk.len() as u64 >= self.names.1 || chunk.len() < wanted.len() {
                break;
            }
            // Chunks overlap by a name less a byte: one read across two is found once.
            at += (chunk.len() - (wanted.len() - 1)) as u64;
        }
        !found.is_empty() && self.entries.iter().any(|e| found.contains(&e.name))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
    }

    /// Where the name of the function holding `addr` (a stated address) is.
    pub fn lookup(&self, addr: u64) -> Option<u32> {
        let i = self.entries.partition_point(|e| e.addr <= addr).checked_sub(1)?;
        let e = self.entries[i];
        (e.size == 0 || addr < e.addr + e.size as u64).then_some(e.name)
    }

    /// The raw name at `name` (from `lookup`), read from the module's file.
    pub fn name(&self, name: u32, reader: &Reader<'_>) -> Option<Vec<u8>> {
        let left = self.names.1.checked_sub(name as u64)?;
        let mut len = NAME_FIRST;
        loop {
            let mut bytes = reader.read(self.names.0 + name as u64, len.min(left))?;
            if let Some(end) = bytes.iter().position(|&b| b == 0) {
                bytes.truncate(end);
                return Some(bytes);
            }
            if len >= left || len >= NAME_MAX {
                return None;
            }
            len *= 16;
        }
    }
}

/// The index entry of the symbol `s` (its table entry) if it is a named function
/// (of a string table `names` bytes long).
fn function(s: &[u8], names: u64) -> Option<Entry> {
    let (name, kind, addr, size) = (u32_at(s, 0), s[4] & 0xf, u64_at(s, 8), u64_at(s, 16));
    let named = name != 0 && (name as u64) < names;
    (named && addr != 0 && (kind == STT_FUNC || kind == STT_GNU_IFUNC)).then(|| Entry {
        addr,
        size: size.min(u32::MAX as u64) as u32,
        name,
    })
}

/// A symbol as people read it: C++ and Rust demangled (without parameters), Cython's
/// generated names as the Python names they implement.
pub fn readable(raw: &[u8]) -> String {
    let text = String::from_utf8_lossy(raw);
    if let Some(name) = cython(&text) {
        return name;
    }
    if let Ok(r) = rustc_demangle::try_demangle(&text) {
        return format!("{r:#}");
    }
    if text.starts_with("_Z") {
        let options = cpp_demangle::DemangleOptions::new().no_params().no_return_type();
        if let Some(d) = cpp_demangle::Symbol::new(raw).ok().and_then(|s| s.demangle_with_options(&options).ok()) {
            return d;
        }
    }
    text.into_owned()
}

/// `__pyx_pw_6pandas_5_libs_9hashtable_..._5get_labels` -> `pandas._libs.hashtable....get_labels`:
/// Cython writes a name as length-prefixed parts after a prefix that says what it is.
fn cython(name: &str) -> Option<String> {
    let rest = name.strip_prefix("__pyx_")?;
    let (_, mut rest) = rest.split_once('_')?; // pw, pf, f, pymod, ...
                                               // Fused specialisations put `fuse_N` first.
    if let Some(fused) = rest.strip_prefix("fuse_") {
        rest = fused.trim_start_matches(|c: char| c.is_ascii_digit()).trim_start_matches('_');
        rest = rest.strip_prefix("__pyx_pw_").or_else(|| rest.strip_prefix("__pyx_pf_")).unwrap_or(rest);
    }
    let mut parts = Vec::new();
    // Parts are `<length><name>`, joined by `_`; the last may be `<counter><name>`.
    loop {
        let digits = rest.chars().take_while(|c| c.is_ascii_digit()).count();
        let len: usize = rest[..digits].parse().unwrap_or(0);
        let part = rest.get(digits..digits + len).filter(|_| len > 0);
        let after = part.map(|p| &rest[digits + p.len()..]);
        match (part, after) {
            (Some(part), Some(after)) if after.is_empty() || after.starts_with('_') => {
                parts.push(part);
                rest = after.strip_prefix('_').unwrap_or(after);
                if rest.is_empty() {
                    break;
                }
            }
            _ => {
                parts.push(&rest[digits..]);
                break;
            }
        }
    }
    parts.retain(|p| !p.is_empty());
    (!parts.is_empty()).then(|| parts.join("."))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_found_across_chunks_and_only_where_a_function_starts() {
        // One long name that ends in the eval loop's, as a linker shares tails, across
        // the first chunk's end.
        let mut names = vec![b'x'; SCAN_CHUNK as usize - 5];
        names.extend_from_slice(b"_PyEval_EvalFrameDefault\0");
        let at = SCAN_CHUNK as u32 - 5;
        let reader = Reader::Copy(&names);
        let with = |name| Symbols { entries: vec![Entry { addr: 16, size: 8, name }], names: (0, names.len() as u64) };
        assert!(with(at).defines(b"_PyEval_EvalFrameDefault", &reader));
        assert!(!with(at + 1).defines(b"_PyEval_EvalFrameDefault", &reader), "named by its tail");
        assert!(!with(0).defines(b"_PyEval_EvalFrameDefault", &reader), "the long name");
        assert_eq!(with(at).name(with(at).lookup(20).unwrap(), &reader).unwrap(), b"_PyEval_EvalFrameDefault");
        assert_eq!(with(at).lookup(24), None, "past the function's end");
        assert_eq!(with(0).name(0, &reader), None, "longer than a name can be");
    }

    #[test]
    fn names_read_as_written() {
        assert_eq!(readable(b"_ZN5arrow7compute8internal4TakeEv"), "arrow::compute::internal::Take");
        assert_eq!(readable(b"_ZN4core3ptr13drop_in_place17h0123456789abcdefE"), "core::ptr::drop_in_place");
        assert_eq!(readable(b"cblas_dgemm"), "cblas_dgemm");
        assert_eq!(
            readable(b"__pyx_pw_6pandas_5_libs_9hashtable_17PyObjectHashTable_7get_item"),
            "pandas._libs.hashtable.PyObjectHashTable.get_item"
        );
        assert_eq!(readable(b"__pyx_f_5numpy_6random_7_common_check"), "numpy.random._common.check");
    }
}
