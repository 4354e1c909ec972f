//! The parts of a module's ELF file we need, read with `pread` into memory. A mapping
//! of the file would raise SIGBUS at any access past its end once the file is cut or
//! rewritten in place (`cp` over a `.so`, an NFS server's update); a read only comes
//! back short. ELF64, little-endian: native frames are read on x86-64 only.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};

pub const SHT_SYMTAB: u32 = 2;
pub const SHT_DYNSYM: u32 = 11;
const SHT_NOBITS: u32 = 8;

/// What tells a file changed: a file cut or rewritten in place keeps its inode but
/// not its size or modification time.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
}

impl FileId {
    fn of(meta: &std::fs::Metadata) -> FileId {
        FileId { dev: meta.dev(), ino: meta.ino(), size: meta.size(), mtime: (meta.mtime(), meta.mtime_nsec()) }
    }
}

/// Where a module's bytes are read from.
pub enum Source {
    /// Its file, reopened for each read and read only while it is the file it was
    /// when first opened: a file changed since reads as nothing.
    File { path: String, id: FileId },
    /// A copy (the vDSO, which has no file).
    Copy(Vec<u8>),
}

impl Source {
    pub fn file(path: &str) -> Option<Source> {
        let id = FileId::of(&std::fs::metadata(path).ok()?);
        Some(Source::File { path: path.to_string(), id })
    }

    /// The bytes, open for reading; None if the file is gone or changed.
    pub fn open(&self) -> Option<Reader<'_>> {
        match self {
            Source::File { path, id } => {
                let file = File::open(path).ok()?;
                (FileId::of(&file.metadata().ok()?) == *id).then_some(Reader::File(file, id.size))
            }
            Source::Copy(bytes) => Some(Reader::Copy(bytes)),
        }
    }
}

pub enum Reader<'a> {
    File(File, u64),
    Copy(&'a [u8]),
}

impl Reader<'_> {
    /// The `len` bytes at `offset`; None where there are fewer.
    pub fn read(&self, offset: u64, len: u64) -> Option<Vec<u8>> {
        let end = offset.checked_add(len)?;
        match self {
            Reader::File(file, size) => {
                if end > *size {
                    return None;
                }
                let mut buf = vec![0; usize::try_from(len).ok()?];
                file.read_exact_at(&mut buf, offset).ok().map(|_| buf)
            }
            Reader::Copy(bytes) => {
                bytes.get(usize::try_from(offset).ok()?..usize::try_from(end).ok()?).map(<[u8]>::to_vec)
            }
        }
    }
}

#[derive(Clone, Copy)]
pub struct Section {
    name: u32,
    pub kind: u32,
    pub addr: u64,
    pub offset: u64,
    pub size: u64,
    pub link: u32,
}

impl Section {
    pub fn addresses(&self) -> std::ops::Range<u64> {
        self.addr..self.addr.saturating_add(self.size)
    }

    /// The section's bytes, where it has some in the file.
    pub fn read(&self, reader: &Reader<'_>) -> Option<Vec<u8>> {
        (self.kind != SHT_NOBITS).then(|| reader.read(self.offset, self.size))?
    }
}

/// A program header (segment).
#[derive(Clone, Copy)]
pub struct Segment {
    pub kind: u32,
    pub flags: u32,
    pub offset: u64,
    pub vaddr: u64,
    pub filesz: u64,
    pub memsz: u64,
}

pub const SEGMENT_SIZE: usize = 56;

/// The program headers in `bytes` (a table of them, as in the file or in memory).
pub fn segments(bytes: &[u8]) -> impl Iterator<Item = Segment> + '_ {
    bytes.chunks_exact(SEGMENT_SIZE).map(|h| Segment {
        kind: u32_at(h, 0),
        flags: u32_at(h, 4),
        offset: u64_at(h, 8),
        vaddr: u64_at(h, 16),
        filesz: u64_at(h, 32),
        memsz: u64_at(h, 40),
    })
}

/// A file's headers: where its program headers are, and its sections by name.
pub struct Elf {
    /// The program headers' place in the file.
    pub headers: (u64, u64),
    sections: Vec<(Vec<u8>, Section)>,
}

impl Elf {
    pub fn read(reader: &Reader<'_>) -> Option<Elf> {
        let h = reader.read(0, 64)?;
        if h[..4] != *b"\x7fELF" || h[4] != 2 || h[5] != 1 {
            return None;
        }
        let (phoff, phentsize, phnum) = (u64_at(&h, 32), u16_at(&h, 54), u16_at(&h, 56));
        let (shoff, shentsize, shnum, shstrndx) = (u64_at(&h, 40), u16_at(&h, 58), u16_at(&h, 60), u16_at(&h, 62));
        let headers = (phoff, u64::from(phentsize) * u64::from(phnum));
        if shentsize != 64 || shnum == 0 {
            return Some(Elf { headers, sections: Vec::new() });
        }
        let table = reader.read(shoff, 64 * u64::from(shnum))?;
        let sections: Vec<Section> = table.chunks_exact(64).map(section).collect();
        let names = sections.get(usize::from(shstrndx))?.read(reader)?;
        let name = |s: &Section| {
            let rest = names.get(s.name as usize..).unwrap_or_default();
            rest[..rest.iter().position(|&b| b == 0).unwrap_or(0)].to_vec()
        };
        let named = sections.iter().map(|s| (name(s), *s)).collect();
        Some(Elf { headers, sections: named })
    }

    pub fn section(&self, name: &str) -> Option<Section> {
        self.sections.iter().find(|(n, _)| n == name.as_bytes()).map(|(_, s)| *s)
    }

    pub fn of_kind(&self, kind: u32) -> Option<Section> {
        self.sections.iter().map(|(_, s)| *s).find(|s| s.kind == kind)
    }

    pub fn at(&self, index: u32) -> Option<Section> {
        self.sections.get(index as usize).map(|(_, s)| *s)
    }
}

fn section(h: &[u8]) -> Section {
    Section {
        name: u32_at(h, 0),
        kind: u32_at(h, 4),
        addr: u64_at(h, 16),
        offset: u64_at(h, 24),
        size: u64_at(h, 32),
        link: u32_at(h, 40),
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}

pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

pub fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
