//! Function names of one module, from its ELF symbol tables (`.symtab`, else
//! `.dynsym`), read once. The index keeps an address, a size and an offset per
//! function; the names stay in the file's mapping and are demangled when looked up.

use object::{Object, ObjectSymbol, SymbolKind};

/// One function: where it starts, how long it is (0: unknown) and where its name is.
#[derive(Clone, Copy)]
struct Entry {
    addr: u64,
    size: u32,
    name: u32,
}

pub struct Symbols {
    /// Sorted by address.
    entries: Vec<Entry>,
}

impl Symbols {
    /// The functions of `file`, whose bytes are `data`; an empty index past `budget` entries.
    pub fn read(file: &object::File<'_>, data: &[u8], budget: usize) -> Symbols {
        let base = data.as_ptr() as usize;
        let mut entries = Vec::new();
        for table in [file.symbols(), file.dynamic_symbols()] {
            for sym in table {
                if sym.kind() != SymbolKind::Text || sym.address() == 0 {
                    continue;
                }
                let Ok(name) = sym.name_bytes() else { continue };
                let offset = (name.as_ptr() as usize).wrapping_sub(base);
                if name.is_empty() || offset >= data.len() || offset > u32::MAX as usize {
                    continue;
                }
                let size = sym.size().min(u32::MAX as u64) as u32;
                entries.push(Entry { addr: sym.address(), size, name: offset as u32 });
            }
            if !entries.is_empty() {
                break; // .symtab holds .dynsym's functions too
            }
        }
        if entries.len() > budget {
            entries = Vec::new();
        }
        entries.sort_unstable_by_key(|e| (e.addr, std::cmp::Reverse(e.size)));
        entries.dedup_by_key(|e| e.addr);
        entries.shrink_to_fit();
        Symbols { entries }
    }

    pub fn empty() -> Symbols {
        Symbols { entries: Vec::new() }
    }

    /// Whether a function is named exactly `name`.
    pub fn defines(&self, name: &[u8], data: &[u8]) -> bool {
        self.entries
            .iter()
            .any(|e| data.get(e.name as usize..).is_some_and(|r| r.starts_with(name) && r.get(name.len()) == Some(&0)))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
    }

    /// The raw name of the function holding `addr` (a stated address), from `data`.
    pub fn lookup<'a>(&self, addr: u64, data: &'a [u8]) -> Option<&'a [u8]> {
        let i = self.entries.partition_point(|e| e.addr <= addr).checked_sub(1)?;
        let e = self.entries[i];
        if e.size != 0 && addr >= e.addr + e.size as u64 {
            return None;
        }
        let rest = data.get(e.name as usize..)?;
        Some(&rest[..rest.iter().position(|&b| b == 0)?])
    }
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
