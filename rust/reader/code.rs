//! Code objects, cached by address: name, file, first line and line table are
//! copied once, then kept until the interpreter reports the object freed (`frees`).
//!
//! A code object can be freed and another allocated at its address, often with
//! its strings and line table at their predecessors' addresses too (the allocator
//! reuses freed blocks first). Where frees cannot be watched, each tick checks every
//! cached object's string and table pointers and the start of its qualified name
//! (its hash and first bytes).

use super::clock_ns;
use super::frees::FreeLog;
use super::layout::Layout;
use super::linetable::line_at;
use super::memory::{u32_at, u64_at, Batch, Memory};
use crate::profile::model::Frame;
use nix::libc;
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::Arc;

/// Bytes read at first for the qualified name, file name and line table; longer
/// ones are read again. Most names fit, as do most site-packages paths.
const GUESSES: [usize; 3] = [128, 256, 320];
/// Enough of a string or bytes object to know its length.
const OBJECT_HEAD: usize = 80;
/// Past these, a length is taken for a torn read (a stale frame can point at a freed
/// code object whose fields point at memory reused since).
const MAX_STRING: usize = 64 << 10;
const MAX_CODE_UNITS: u64 = 1 << 20;
/// A location table entry takes at most ~12 bytes per code unit it covers.
const TABLE_BYTES_PER_UNIT: usize = 16;
/// Heap the cache may hold (strings, tables) before it starts over.
const MAX_BYTES: usize = 64 << 20;
/// Bytes of the qualified name compared each tick, from its length on: length, hash,
/// state and first characters (not the header: reference counts change).
const NAME_PROBE_LEN: usize = 48;
/// Tables are emptied past these sizes (many short-lived code objects).
const MAX_CODES: usize = 50_000;
const MAX_FRAMES: usize = 500_000;
/// The name of 3.12's code object for an eval loop's entry frame, a shim the walk
/// skips by its owner. Yet a stack read as a C function called back into Python showed
/// a frame of this code as a Python frame (pyenv's 3.12.1, in the matrix): an entry
/// frame read while being written or after it was left, its owner not (or no longer)
/// the shim's. Its code is never Python's, whatever its owner reads.
const TRAMPOLINE: &str = "<interpreter trampoline>";

/// What a frame shows: its line's meaning depends on the sampler's line mode.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LineMode {
    Current,
    First,
    None,
}

/// What a frame's executable turned out to be.
pub enum Found {
    Frame(u64),
    /// Not a code object (entry frames hold None): not a Python call, skipped.
    NotCode,
    /// Unreadable, or an instruction outside the code: a torn read or a stale frame.
    Torn,
}

struct Code {
    serial: u64,
    /// 3.12's code object of an eval loop's entry frame, which is never a Python frame.
    trampoline: bool,
    name: Arc<str>,
    file: Arc<str>,
    first_line: i32,
    bytecode_len: i64,
    linetable: Vec<u8>,
    identity: Vec<u8>,
    name_probe_at: u64,
    name_probe: Vec<u8>,
    lines: FxHashMap<i64, u64>,
    last_seen: u64,
    /// CLOCK_MONOTONIC ns once it was read: the object was at its address then.
    read_ns: u64,
}

impl Code {
    fn heap_bytes(&self) -> usize {
        self.name.len() + self.file.len() + self.linetable.len() + self.identity.len() + self.name_probe.len()
    }
}

/// A code object being fetched.
struct Fetch {
    addr: u64,
    header: Vec<u8>,
}

pub struct CodeCache {
    code_type: u64,
    codes: FxHashMap<u64, Code>,
    frees: FreeLog,
    /// Cached addresses whose object was freed: fetching one again is a reuse.
    freed: FxHashSet<u64>,
    /// Addresses seen this tick that are not code objects (e.g. entry frames' None).
    not_code: FxHashSet<u64>,
    frames: Vec<Frame>,
    frame_ids: FxHashMap<(u64, i32), u64>,
    serial: u64,
    tick: u64,
    /// Whether the last refresh had no log of frees: every cached object it did not
    /// check may have been freed and its address reused since it last was.
    unchecked_may_be_stale: bool,
    /// Bumped whenever frame ids are forgotten, so users of them forget theirs.
    pub epoch: u64,
    /// Heap bytes held by the cached strings and tables, and by the frames.
    bytes: usize,
    frame_bytes: usize,
    pub reused: u64,
    pub unreadable: u64,
}

impl CodeCache {
    pub fn new(code_type: u64, frees: FreeLog) -> CodeCache {
        CodeCache {
            code_type,
            codes: FxHashMap::default(),
            frees,
            freed: FxHashSet::default(),
            not_code: FxHashSet::default(),
            frames: Vec::new(),
            frame_ids: FxHashMap::default(),
            serial: 0,
            tick: 0,
            unchecked_may_be_stale: true,
            epoch: 0,
            bytes: 0,
            frame_bytes: 0,
            reused: 0,
            unreadable: 0,
        }
    }

    /// Makes every address of `addrs` either a checked cache entry or a known non-code.
    pub fn refresh(
        &mut self,
        addrs: &FxHashSet<u64>,
        layout: &Layout,
        mem: &mut Memory,
        batch: &mut Batch,
    ) -> Result<(), String> {
        self.tick += 1;
        self.not_code.clear();
        self.trim();
        let freed = self.forget_freed();
        let check_all = freed.is_none();
        self.unchecked_may_be_stale = check_all;
        let header_len = layout.code_header_len() as usize;
        batch.clear();
        let mut checks = Vec::new();
        let mut fetches = Vec::new();
        for &addr in addrs {
            match self.codes.get_mut(&addr) {
                Some(c) if check_all => checks.push(push_check(batch, addr, c, layout)),
                Some(c) => c.last_seen = self.tick,
                None => {
                    self.reused += self.freed.remove(&addr) as u64;
                    fetches.push((addr, batch.push(addr, header_len)))
                }
            }
        }
        if batch.len() == 0 {
            return Ok(());
        }
        mem.read_merged(batch)?;
        for check in checks {
            if !self.still_holds(check, batch) {
                fetches.push((check.0, usize::MAX));
            }
        }
        let mut pending = Vec::new();
        for (addr, i) in fetches {
            match batch.get(i) {
                Some(h) if self.plausible(h, layout) => pending.push(Fetch { addr, header: h.to_vec() }),
                Some(_) => {
                    self.not_code.insert(addr);
                }
                None if i == usize::MAX => pending.push(Fetch { addr, header: Vec::new() }),
                None => {}
            }
        }
        if !pending.is_empty() {
            let fetched: Vec<u64> = pending.iter().map(|f| f.addr).collect();
            self.fetch(pending, layout, mem, batch)?;
            if let Some(mut freed) = freed {
                // Freed since the log was last read, perhaps after the stacks were
                // copied: the fetch may have read the dead object, whose free is now
                // consumed. Not kept; its frames read as torn and are read again.
                let late = self.forget_freed();
                freed.extend(late.iter().flatten());
                for addr in fetched.iter().filter(|a| late.is_none() || freed.contains(a)) {
                    if let Some(old) = self.codes.remove(addr) {
                        self.bytes -= old.heap_bytes();
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether the cached objects of `addrs` are the ones at those addresses at
    /// `copied_ns` (CLOCK_MONOTONIC), when a signal copied frames that point to them.
    /// Each must have been read before then: one read since may have taken a freed
    /// object's address after the copy. And each must still be at its address: where
    /// that is in doubt (no log of frees) and this tick's refresh did not check it, it
    /// is checked as `refresh` checks, and one that changed is dropped. Nothing is
    /// fetched, trimmed or forgotten, so the ids handed out this tick stand. Addresses
    /// not cached are `frame_id`'s to report.
    pub fn confirm(
        &mut self,
        addrs: &FxHashSet<u64>,
        copied_ns: u64,
        layout: &Layout,
        mem: &mut Memory,
        batch: &mut Batch,
    ) -> bool {
        if addrs.iter().any(|a| self.codes.get(a).is_some_and(|c| c.read_ns > copied_ns)) {
            return false;
        }
        if !self.unchecked_may_be_stale {
            return true;
        }
        batch.clear();
        let checks: Vec<Check> = (addrs.iter())
            .filter_map(|&a| self.codes.get(&a).filter(|c| c.last_seen != self.tick).map(|c| (a, c)))
            .map(|(a, c)| push_check(batch, a, c, layout))
            .collect();
        if checks.is_empty() {
            return true;
        }
        if mem.read_merged(batch).is_err() {
            return false;
        }
        checks.into_iter().all(|check| self.still_holds(check, batch))
    }

    /// Whether the object `check` read is the one cached: then seen this tick; else
    /// dropped, its address reused.
    fn still_holds(&mut self, (addr, identity, probe): Check, batch: &Batch) -> bool {
        let c = &self.codes[&addr];
        if batch.get(identity) == Some(&c.identity[..]) && batch.get(probe) == Some(&c.name_probe[..]) {
            self.codes.get_mut(&addr).expect("checked above").last_seen = self.tick;
            return true;
        }
        let old = self.codes.remove(&addr).expect("checked above");
        self.bytes -= old.heap_bytes();
        self.reused += 1;
        false
    }

    /// Drops the cached objects the interpreter freed since the last call, and gives
    /// their addresses; None if the frees are not known, so every cached object must
    /// be checked instead.
    fn forget_freed(&mut self) -> Option<FxHashSet<u64>> {
        let freed: FxHashSet<u64> = self.frees.since_last()?.into_iter().collect();
        if self.freed.len() > MAX_CODES {
            self.freed.clear();
        }
        for &addr in &freed {
            if let Some(old) = self.codes.remove(&addr) {
                self.bytes -= old.heap_bytes();
                self.freed.insert(addr);
            }
        }
        Some(freed)
    }

    /// Reads new code objects: headers (if missing), then strings and line tables
    /// at a guessed length, then again at their full length where the guess fell short.
    fn fetch(
        &mut self,
        mut pending: Vec<Fetch>,
        layout: &Layout,
        mem: &mut Memory,
        batch: &mut Batch,
    ) -> Result<(), String> {
        if pending.iter().any(|f| f.header.is_empty()) {
            batch.clear();
            let idx: Vec<_> = pending.iter().map(|f| batch.push(f.addr, layout.code_header_len() as usize)).collect();
            mem.read(batch)?;
            for (f, i) in pending.iter_mut().zip(idx) {
                match batch.get(i) {
                    Some(h) if self.plausible(h, layout) => f.header = h.to_vec(),
                    Some(_) => drop(self.not_code.insert(f.addr)),
                    None => {}
                }
            }
            pending.retain(|f| !f.header.is_empty());
        }
        let fields = [layout.code_qualname, layout.code_filename, layout.code_linetable];
        let mut parts: Vec<[Option<Vec<u8>>; 3]> = vec![Default::default(); pending.len()];
        // A guessed length first; then the exact length of what did not fit, after
        // reading just the object's head where the guess ran into unmapped memory.
        for pass in 0..3 {
            batch.clear();
            let mut reads = Vec::new();
            for (n, f) in pending.iter().enumerate() {
                for k in 0..3 {
                    let len = match &parts[n][k] {
                        None if pass == 0 => GUESSES[k],
                        None if pass == 1 => OBJECT_HEAD,
                        None => continue,
                        Some(got) => match needed(got, k, code_units(&f.header, layout), layout) {
                            Some(need) if need > got.len() => need,
                            _ => continue,
                        },
                    };
                    reads.push((n, k, batch.push(u64_at(&f.header, fields[k]), len)));
                }
            }
            if reads.is_empty() {
                break;
            }
            mem.read(batch)?;
            for (n, k, i) in reads {
                parts[n][k] = batch.get(i).map(<[u8]>::to_vec);
            }
        }
        let read_ns = clock_ns(libc::CLOCK_MONOTONIC).unwrap_or(u64::MAX);
        for (f, parts) in pending.iter().zip(parts) {
            match self.decode(f, &parts, layout, read_ns) {
                Some(code) => {
                    self.bytes += code.heap_bytes();
                    if let Some(old) = self.codes.insert(f.addr, code) {
                        self.bytes -= old.heap_bytes();
                    }
                }
                None => self.unreadable += 1,
            }
        }
        Ok(())
    }

    fn decode(&mut self, f: &Fetch, parts: &[Option<Vec<u8>>; 3], layout: &Layout, read_ns: u64) -> Option<Code> {
        let [name, file, table] = parts;
        let (name, file, table) = (name.as_deref()?, file.as_deref()?, table.as_deref()?);
        let table_len = u64_at(table, layout.bytes_size) as usize;
        let linetable = table.get(layout.bytes_data as usize..layout.bytes_data as usize + table_len)?.to_vec();
        let (span_at, span_len) = layout.code_identity_span();
        let identity = f.header.get(span_at as usize..(span_at + span_len) as usize)?.to_vec();
        // Only bytes of the string itself: what lies past it may change at any time.
        let probe_from = layout.unicode_length as usize;
        let probe_end = needed(name, 0, 0, layout)?.min(probe_from + NAME_PROBE_LEN);
        let name_probe = name.get(probe_from..probe_end)?.to_vec();
        self.serial += 1;
        let name: Arc<str> = decode_string(name, layout)?.into();
        Some(Code {
            serial: self.serial,
            trampoline: &*name == TRAMPOLINE,
            name,
            file: decode_string(file, layout)?.into(),
            first_line: u32_at(&f.header, layout.code_firstlineno) as i32,
            bytecode_len: 2 * code_units(&f.header, layout) as i64,
            linetable,
            identity,
            name_probe_at: u64_at(&f.header, layout.code_qualname) + probe_from as u64,
            name_probe,
            lines: FxHashMap::default(),
            last_seen: self.tick,
            read_ns,
        })
    }

    /// A code object's header, with a size a real one can have.
    fn plausible(&self, header: &[u8], layout: &Layout) -> bool {
        u64_at(header, layout.ob_type) == self.code_type && code_units(header, layout) <= MAX_CODE_UNITS
    }

    /// The frame id of `code` at byte offset `offset` into its bytecode.
    pub fn frame_id(&mut self, code: u64, offset: i64, mode: LineMode) -> Found {
        let Some(c) = self.codes.get_mut(&code) else {
            return if self.not_code.contains(&code) { Found::NotCode } else { Found::Torn };
        };
        if c.trampoline {
            return Found::NotCode;
        }
        if offset >= c.bytecode_len {
            return Found::Torn;
        }
        if let Some(&id) = c.lines.get(&offset) {
            return Found::Frame(id);
        }
        let line = match mode {
            LineMode::Current => line_at(&c.linetable, c.first_line, offset.max(0) as u32).unwrap_or(c.first_line),
            LineMode::First => c.first_line,
            LineMode::None => 0,
        };
        let next = self.frames.len() as u64;
        let id = *self.frame_ids.entry((c.serial, line)).or_insert(next);
        if id == next {
            self.frame_bytes += c.name.len() + c.file.len();
            self.frames.push(Frame::python(c.name.to_string(), c.file.to_string(), line));
        }
        c.lines.insert(offset, id);
        Found::Frame(id)
    }

    pub fn frame(&self, id: u64) -> &Frame {
        &self.frames[id as usize]
    }

    /// Keeps the tables bounded: code objects unseen for a while go, and frame ids
    /// are all forgotten (a new epoch) when too many accumulated.
    fn trim(&mut self) {
        if self.codes.len() > MAX_CODES || self.bytes > MAX_BYTES {
            let horizon = self.tick.saturating_sub(1000);
            self.codes.retain(|_, c| c.last_seen >= horizon);
            self.bytes = self.codes.values().map(Code::heap_bytes).sum();
        }
        if self.frames.len() > MAX_FRAMES || self.codes.len() > MAX_CODES || self.bytes + self.frame_bytes > MAX_BYTES {
            self.bytes = 0;
            self.frame_bytes = 0;
            self.codes.clear();
            self.frames.clear();
            self.frame_ids.clear();
            self.epoch += 1;
        }
    }
}

/// A cached object's address and where its identity span and name probe went in a batch.
type Check = (u64, usize, usize);

/// Asks `batch` for what tells whether `c` is still the object at `addr`.
fn push_check(batch: &mut Batch, addr: u64, c: &Code, layout: &Layout) -> Check {
    let (span_at, span_len) = layout.code_identity_span();
    let identity = batch.push(addr + span_at, span_len as usize);
    let probe = batch.push(c.name_probe_at, c.name_probe.len());
    (addr, identity, probe)
}

fn code_units(header: &[u8], layout: &Layout) -> u64 {
    u64_at(header, layout.ob_size)
}

/// Bytes a string (k 0, 1) or line table (k 2, of a code of `units` code units)
/// object needs, from its first bytes; None for an implausible length.
fn needed(head: &[u8], k: usize, units: u64, layout: &Layout) -> Option<usize> {
    if k == 2 {
        let len = u64_at(head, layout.bytes_size) as usize;
        return (len <= TABLE_BYTES_PER_UNIT * units as usize + 64).then(|| layout.bytes_data as usize + len);
    }
    let state = u32_at(head, layout.unicode_state);
    let (kind, compact, ascii) = ((state >> 2) & 7, state & 0x20 != 0, state & 0x40 != 0);
    let len = u64_at(head, layout.unicode_length) as usize;
    if !compact || !matches!(kind, 1 | 2 | 4) || len > MAX_STRING {
        return None;
    }
    let data = if ascii { layout.unicode_ascii_data } else { layout.unicode_compact_data } as usize;
    Some(data + len * kind as usize)
}

fn decode_string(bytes: &[u8], layout: &Layout) -> Option<String> {
    let state = u32_at(bytes, layout.unicode_state);
    let (kind, ascii) = ((state >> 2) & 7, state & 0x40 != 0);
    let len = u64_at(bytes, layout.unicode_length) as usize;
    let data = if ascii { layout.unicode_ascii_data } else { layout.unicode_compact_data } as usize;
    let raw = bytes.get(data..data + len * kind as usize)?;
    Some(match kind {
        1 => raw.iter().map(|&b| char::from(b)).collect(),
        2 => raw.chunks_exact(2).map(|c| u32::from(u16::from_ne_bytes([c[0], c[1]]))).map(to_char).collect(),
        _ => raw.chunks_exact(4).map(|c| u32::from_ne_bytes(c.try_into().unwrap())).map(to_char).collect(),
    })
}

fn to_char(c: u32) -> char {
    char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER)
}
