//! Reads of this process's own memory.
//!
//! Plain copies that survive a fault (`guarded`) while our fault handler is the one
//! installed; otherwise every read of a batch goes out in as few `process_vm_readv`
//! calls as possible, and where that syscall is forbidden (a seccomp profile, an
//! injected error) through `/proc/self/mem`. A range that is not mapped (a torn
//! pointer) fails alone; it never faults.

use super::guarded;
use nix::libc;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// How long copies go on after a check that our fault handler is installed. A handler
/// installed since (the application's, which wins) would get a copy's fault in that
/// time only if a page being read was unmapped then.
const HANDLER_CHECK_EVERY: Duration = Duration::from_millis(100);

/// Most iovecs one call takes (Linux's `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

#[derive(Clone, Copy, Debug)]
struct Request {
    addr: u64,
    offset: usize,
    len: usize,
    ok: bool,
}

/// Ranges to read together, copied into one buffer.
#[derive(Default)]
pub struct Batch {
    requests: Vec<Request>,
    buf: Vec<u8>,
}

impl Batch {
    pub fn clear(&mut self) {
        self.requests.clear();
        self.buf.clear();
    }

    /// Queues `len` bytes at `addr`; returns the request's index.
    pub fn push(&mut self, addr: u64, len: usize) -> usize {
        let offset = self.buf.len();
        self.buf.resize(offset + len, 0);
        self.requests.push(Request { addr, offset, len, ok: false });
        self.requests.len() - 1
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// The bytes of request `i`, or None if that range could not be read.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        let r = self.requests.get(i)?;
        r.ok.then(|| &self.buf[r.offset..r.offset + r.len])
    }
}

pub struct Memory {
    pid: libc::pid_t,
    /// Whether reads are plain copies: our fault handler was installed at the last check.
    copying: bool,
    handler_checked: Instant,
    /// Set once `process_vm_readv` is refused; every read then goes through it.
    proc_mem: Option<File>,
    pub calls: u64,
    /// Ranges and bytes read, over all calls.
    pub ranges: u64,
    pub bytes: u64,
    /// Scratch batches of `read_merged`.
    spans: Batch,
    alone: Batch,
}

impl Memory {
    pub fn new() -> Memory {
        guarded::acquire();
        Memory {
            pid: std::process::id() as libc::pid_t,
            copying: guarded::installed(),
            handler_checked: Instant::now(),
            proc_mem: None,
            calls: 0,
            ranges: 0,
            bytes: 0,
            spans: Batch::default(),
            alone: Batch::default(),
        }
    }

    pub fn uses_proc_mem(&self) -> bool {
        self.proc_mem.is_some()
    }

    /// How reads are made now: "copy", "process_vm_readv" or "/proc/self/mem".
    pub fn method(&self) -> &'static str {
        match (self.copying, &self.proc_mem) {
            (true, _) => "copy",
            (false, None) => "process_vm_readv",
            (false, Some(_)) => "/proc/self/mem",
        }
    }

    /// Checks that our fault handler is still the one installed (an application's own,
    /// installed since, wins): before a tick's reads, at most every `HANDLER_CHECK_EVERY`.
    /// Each check asks the kernel twice, a tenth of a quiet tick's calls.
    pub fn check_handler(&mut self) {
        if self.handler_checked.elapsed() >= HANDLER_CHECK_EVERY {
            self.copying = guarded::installed();
            self.handler_checked = Instant::now();
        }
    }

    /// Reads every request of `batch`, in order; each one's success is kept in the batch.
    pub fn read(&mut self, batch: &mut Batch) -> Result<(), String> {
        self.ranges += batch.requests.len() as u64;
        self.bytes += batch.buf.len() as u64;
        if self.copying {
            copy(batch, 0..batch.requests.len());
            return Ok(());
        }
        let mut next = 0;
        while next < batch.requests.len() {
            next = match &self.proc_mem {
                Some(file) => read_with_file(file, batch, next),
                None => match self.readv_from(batch, next) {
                    Ok(n) => n,
                    Err(e) => {
                        self.proc_mem = Some(File::open("/proc/self/mem").map_err(|f| {
                            format!("process_vm_readv failed ({e}) and /proc/self/mem cannot be opened: {f}")
                        })?);
                        next
                    }
                },
            };
        }
        Ok(())
    }

    /// Reads `batch` like `read`, where the requests from `rounds[i]` on form round i and
    /// a round marked `true` repeats the copies of the round before it: that round starts
    /// at least `apart` after the one before started. Copies of a running thread's stack
    /// must lie that far apart, as the kernel's do, for one torn by a call in progress
    /// to show as a disagreement: plain copies tens of nanoseconds apart agreed on 2 of
    /// ~3,500 stacks read with the other task's tag (3.13t, under load).
    pub fn read_spaced(&mut self, batch: &mut Batch, rounds: &[(usize, bool)], apart: Duration) -> Result<(), String> {
        if !self.copying {
            return self.read(batch);
        }
        self.ranges += batch.requests.len() as u64;
        self.bytes += batch.buf.len() as u64;
        let mut began = Instant::now();
        for (i, &(start, repeats)) in rounds.iter().enumerate() {
            let end = rounds.get(i + 1).map_or(batch.requests.len(), |r| r.0);
            while repeats && began.elapsed() < apart {
                std::hint::spin_loop();
            }
            began = Instant::now();
            copy(batch, start..end);
        }
        Ok(())
    }

    /// Reads every request of `batch` like `read`, in any order: a request that starts
    /// on a page another already touches is read within the same range, since the
    /// kernel looks up and pins every range's pages anew. For many small scattered
    /// requests whose order does not matter (checks of cached objects).
    pub fn read_merged(&mut self, batch: &mut Batch) -> Result<(), String> {
        if self.copying {
            return self.read(batch);
        }
        let mut spans = std::mem::take(&mut self.spans);
        let members = page_spans(&batch.requests, &mut spans);
        let outcome =
            if spans.len() < batch.len() { self.read_spans(batch, &mut spans, &members) } else { self.read(batch) };
        self.spans = spans;
        outcome
    }

    /// Reads `spans` and hands each request of `batch` its bytes; the requests of a
    /// span that failed (an unmapped page inside it) are read again one by one.
    fn read_spans(&mut self, batch: &mut Batch, spans: &mut Batch, members: &[(usize, usize)]) -> Result<(), String> {
        self.read(spans)?;
        let mut alone = std::mem::take(&mut self.alone);
        alone.clear();
        let mut retried = Vec::new();
        for &(span, i) in members {
            let r = batch.requests[i];
            match spans.get(span) {
                Some(bytes) => {
                    let from = (r.addr - spans.requests[span].addr) as usize;
                    batch.buf[r.offset..r.offset + r.len].copy_from_slice(&bytes[from..from + r.len]);
                    batch.requests[i].ok = true;
                }
                None => retried.push((i, alone.push(r.addr, r.len))),
            }
        }
        let outcome = if retried.is_empty() { Ok(()) } else { self.read(&mut alone) };
        for (i, j) in retried {
            let r = batch.requests[i];
            batch.requests[i].ok = match alone.get(j) {
                Some(bytes) => {
                    batch.buf[r.offset..r.offset + r.len].copy_from_slice(bytes);
                    true
                }
                None => false,
            };
        }
        self.alone = alone;
        outcome
    }

    /// One `process_vm_readv` from request `first`; returns the first request not yet tried.
    fn readv_from(&mut self, batch: &mut Batch, first: usize) -> Result<usize, std::io::Error> {
        let end = (first + IOV_MAX).min(batch.requests.len());
        let base = batch.buf.as_mut_ptr();
        let (local, remote): (Vec<libc::iovec>, Vec<libc::iovec>) = batch.requests[first..end]
            .iter()
            .map(|r| {
                // SAFETY: offset + len lies inside `buf`, which outlives the call below.
                let local = libc::iovec { iov_base: unsafe { base.add(r.offset) }.cast(), iov_len: r.len };
                (local, libc::iovec { iov_base: r.addr as *mut libc::c_void, iov_len: r.len })
            })
            .unzip();
        self.calls += 1;
        // SAFETY: the local iovecs point into our own buffer; the remote ones are only
        // read by the kernel, which reports unmapped ranges instead of faulting.
        let n = unsafe {
            libc::process_vm_readv(self.pid, local.as_ptr(), local.len() as _, remote.as_ptr(), remote.len() as _, 0)
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            return match err.raw_os_error() {
                // The first range is unmapped: fail it alone and go on after it.
                Some(libc::EFAULT) => {
                    batch.requests[first].ok = false;
                    Ok(first + 1)
                }
                _ => Err(err),
            };
        }
        // The call stops at the first range it cannot copy whole.
        let mut copied = n as usize;
        for i in first..end {
            let r = &mut batch.requests[i];
            if copied < r.len {
                r.ok = false;
                return Ok(i + 1);
            }
            r.ok = true;
            copied -= r.len;
        }
        Ok(end)
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        guarded::release();
    }
}

fn read_with_file(file: &File, batch: &mut Batch, first: usize) -> usize {
    let Batch { requests, buf } = batch;
    for r in &mut requests[first..] {
        r.ok = file.read_exact_at(&mut buf[r.offset..r.offset + r.len], r.addr).is_ok();
    }
    requests.len()
}

/// Groups `requests` by address into `spans`: one that starts on a page the current
/// span touches joins it. Returns (span, request) for every request.
fn page_spans(requests: &[Request], spans: &mut Batch) -> Vec<(usize, usize)> {
    const PAGE: u64 = 4096;
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_unstable_by_key(|&i| requests[i].addr);
    let mut bounds: Vec<(u64, u64)> = Vec::new();
    let mut members = Vec::with_capacity(requests.len());
    for i in order {
        let r = &requests[i];
        let r_end = r.addr.saturating_add(r.len as u64);
        match bounds.last_mut() {
            Some((_, end)) if r.addr / PAGE <= end.saturating_sub(1) / PAGE => *end = (*end).max(r_end),
            _ => bounds.push((r.addr, r_end)),
        }
        members.push((bounds.len() - 1, i));
    }
    spans.clear();
    for (start, end) in bounds {
        spans.push(start, (end - start) as usize);
    }
    members
}

/// Reads one plain value of our own memory through `mem` (setup paths only).
pub fn read_u64(mem: &mut Memory, addr: u64) -> Option<u64> {
    let mut batch = Batch::default();
    batch.push(addr, 8);
    mem.read(&mut batch).ok()?;
    batch.get(0).map(|b| u64::from_ne_bytes(b.try_into().unwrap()))
}

/// Little helpers to decode fields from copied bytes.
pub fn u64_at(bytes: &[u8], offset: u64) -> u64 {
    let o = offset as usize;
    bytes.get(o..o + 8).map_or(0, |b| u64::from_ne_bytes(b.try_into().unwrap()))
}

pub fn u32_at(bytes: &[u8], offset: u64) -> u32 {
    let o = offset as usize;
    bytes.get(o..o + 4).map_or(0, |b| u32::from_ne_bytes(b.try_into().unwrap()))
}

pub fn u8_at(bytes: &[u8], offset: u64) -> u8 {
    bytes.get(offset as usize).copied().unwrap_or(0)
}

/// Plain copies of `batch`'s requests in `range`, under our fault handler.
fn copy(batch: &mut Batch, range: std::ops::Range<usize>) {
    let Batch { requests, buf } = batch;
    for r in &mut requests[range] {
        r.ok = guarded::copy(&mut buf[r.offset..r.offset + r.len], r.addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads through the system call, as where another fault handler came after ours.
    fn by_syscall() -> Memory {
        let mut mem = Memory::new();
        mem.copying = false;
        mem
    }

    #[test]
    fn reads_many_ranges_and_fails_only_the_unmapped_one() {
        let a = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let b = 0x1122_3344_5566_7788u64;
        for mut mem in [Memory::new(), by_syscall()] {
            let mut batch = Batch::default();
            batch.push(a.as_ptr() as u64, a.len());
            batch.push(8, 16); // the null page is never mapped
            batch.push(&b as *const u64 as u64, 8);
            mem.read(&mut batch).unwrap();
            assert_eq!(batch.get(0), Some(&a[..]));
            assert_eq!(batch.get(1), None);
            assert_eq!(u64_at(batch.get(2).unwrap(), 0), b);
            assert!(mem.calls <= 3);
        }
    }

    #[test]
    fn merged_reads_give_each_request_its_bytes() {
        let page: Vec<u8> = (0..=255u8).cycle().take(3 * 4096).collect();
        let base = page.as_ptr() as u64;
        let mut mem = by_syscall();
        let mut batch = Batch::default();
        let wanted = [(base + 4100, 16), (base + 10, 8), (base + 4090, 12), (8, 8), (base + 9000, 100), (base + 20, 4)];
        for (addr, len) in wanted {
            batch.push(addr, len);
        }
        mem.read_merged(&mut batch).unwrap();
        for (i, (addr, len)) in wanted.into_iter().enumerate() {
            let expected = (addr >= base).then(|| &page[(addr - base) as usize..(addr - base) as usize + len]);
            assert_eq!(batch.get(i), expected, "request {i}");
        }
        assert!(mem.ranges < wanted.len() as u64, "requests on one page read as one range");
    }

    #[test]
    fn proc_mem_reads_the_same() {
        let a = [9u8; 32];
        let mut mem = by_syscall();
        mem.proc_mem = Some(File::open("/proc/self/mem").unwrap());
        let mut batch = Batch::default();
        batch.push(a.as_ptr() as u64, 32);
        batch.push(8, 8);
        mem.read(&mut batch).unwrap();
        assert_eq!(batch.get(0), Some(&a[..]));
        assert_eq!(batch.get(1), None);
    }
}
