//! Unwinding a copied stack: framehop follows each module's `.eh_frame` (frame
//! pointers where a module has none) over the bytes the signal handler copied, but
//! for the rows it cannot step (`realigned`).
//! Hand-written assembly (BLAS kernels) often has neither: there the unwind can go
//! on from a return address found by scanning the stack (`unwind_from`).

use super::modules::Modules;
use super::signal::Regs;
use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64};
use framehop::{FrameAddress, Unwinder};

/// Deeper stacks are cut here.
const MAX_FRAMES: usize = 1024;
/// Return addresses tried, at most, where a frame led nowhere (see `unwind_from`).
const MAX_TRIES: usize = 12;
/// Of them, those above one place the scan starts at.
const PER_START: usize = 4;

/// How an unwind ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// At the thread's first function.
    Root,
    /// At the end of the copy: the stack goes on past what was copied.
    Cut,
    /// Where no unwind information or frame pointer led further.
    Lost,
}

/// One native frame: an address inside its call (a return address less one), and
/// the stack it holds, from its stack pointer up to its caller's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NativeFrame {
    pub pc: u64,
    pub sp: u64,
    pub caller_sp: u64,
}

/// The frames of the stack in `stack` (copied from `regs.sp` up), innermost first.
pub fn unwind(modules: &Modules, cache: &mut CacheX86_64, regs: Regs, stack: &[u8], out: &mut Vec<NativeFrame>) -> End {
    out.clear();
    let state = UnwindRegsX86_64::new(regs.ip, regs.sp, regs.bp);
    walk(modules, cache, regs.sp, stack, state, FrameAddress::from_instruction_pointer(regs.ip), out)
}

/// Unwinds `out` again from the return address `ra` found at `at` in the copy: the
/// frames below `at` stay, the last of them spanning the words up to it (assembly
/// without unwind information, often with a stack of its own it realigned).
pub fn unwind_from(
    modules: &Modules,
    cache: &mut CacheX86_64,
    regs: Regs,
    stack: &[u8],
    (at, ra): (u64, u64),
    out: &mut Vec<NativeFrame>,
) -> End {
    out.retain(|f| f.sp <= at);
    let (Some(last), Some(address)) = (out.last_mut(), FrameAddress::from_return_address(ra)) else {
        return End::Lost;
    };
    last.caller_sp = at + 8;
    let state = UnwindRegsX86_64::new(ra, at + 8, regs.bp);
    walk(modules, cache, regs.sp, stack, state, address, out)
}

/// Where return addresses may be, for a frame at `from` that led nowhere: above each
/// register kept for the caller that points into the copy past `from` (assembly that
/// realigned its stack keeps the caller's stack pointer in one, and what lies between
/// is stale), then above `from` itself; (where, value) per word `is_return` takes,
/// at most `MAX_TRIES`, each once.
pub fn return_addresses(
    regs: Regs,
    stack: &[u8],
    from: u64,
    mut is_return: impl FnMut(u64) -> bool,
) -> Vec<(u64, u64)> {
    let end = regs.sp + stack.len() as u64;
    let mut starts: Vec<u64> = regs.kept.iter().copied().filter(|&r| r > from && r < end).collect();
    starts.sort_unstable();
    starts.push(from);
    let mut found: Vec<(u64, u64)> = Vec::with_capacity(MAX_TRIES);
    for start in starts {
        let first = (start.saturating_sub(regs.sp).div_ceil(8) * 8) as usize;
        let words = stack[first.min(stack.len())..].chunks_exact(8).enumerate();
        let here: Vec<(u64, u64)> = words
            .map(|(i, w)| (regs.sp + (first + 8 * i) as u64, u64::from_le_bytes(w.try_into().expect("8 bytes"))))
            .filter(|&(at, _)| !found.iter().any(|&(seen, _)| seen == at))
            .filter(|&(_, w)| is_return(w))
            .take(PER_START)
            .collect();
        found.extend(here);
    }
    found.truncate(MAX_TRIES);
    found
}

/// The word at `at` in the copy `stack` of the stack from `low` up.
pub fn word_at(stack: &[u8], low: u64, at: u64) -> Option<u64> {
    let off = usize::try_from(at.checked_sub(low)?).ok()?;
    Some(u64::from_le_bytes(stack.get(off..off.checked_add(8)?)?.try_into().ok()?))
}

/// Appends the frames from `address` (with `state`) to `out`, over the copy `stack` of
/// the stack from `low` up.
fn walk(
    modules: &Modules,
    cache: &mut CacheX86_64,
    low: u64,
    stack: &[u8],
    mut state: UnwindRegsX86_64,
    mut address: FrameAddress,
    out: &mut Vec<NativeFrame>,
) -> End {
    let high = low + stack.len() as u64;
    let mut past_copy = false;
    let mut read = |addr: u64| {
        let word = word_at(stack, low, addr);
        past_copy |= word.is_none() && addr >= high;
        word.ok_or(())
    };
    let end = loop {
        if out.len() >= MAX_FRAMES {
            break End::Cut;
        }
        let sp = state.sp();
        let pc = address.address_for_lookup();
        let step = match modules.realigned.step(pc, &mut state, &mut read) {
            Some(step) => step.map(Some),
            None => modules.unwinder.unwind_frame(address, &mut state, cache, &mut read).map_err(drop),
        };
        let caller_sp = state.sp().max(sp);
        out.push(NativeFrame { pc, sp, caller_sp });
        match step {
            Ok(Some(ra)) => match FrameAddress::from_return_address(ra) {
                Some(next) => address = next,
                None => break End::Root,
            },
            Ok(None) => break End::Root,
            Err(_) => break End::Lost,
        }
    };
    if end == End::Lost && past_copy {
        End::Cut
    } else {
        end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn return_addresses_above_a_kept_stack_pointer_come_first() {
        // Words from sp = 0x1000: a stale return address at +0x10 (left in the gap a
        // kernel realigned over), its caller's stack pointer kept in rbx (+0x30), the
        // return address it saved above that (+0x40).
        let words = [0u64, 0, 0x7000, 0, 0, 0, 0, 0, 0x7100, 0];
        let stack: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let regs = Regs { ip: 0x6000, sp: 0x1000, bp: 0, kept: [0x1030, 0, 0, 0, 0x9999] };
        let found = return_addresses(regs, &stack, 0x1000, |w| w >= 0x7000);
        assert_eq!(found, vec![(0x1040, 0x7100), (0x1010, 0x7000)]);
        assert_eq!(word_at(&stack, regs.sp, 0x1040), Some(0x7100));
        assert_eq!(word_at(&stack, regs.sp, 0x1000 + stack.len() as u64), None);
    }
}
