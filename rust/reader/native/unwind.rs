//! Unwinding a copied stack: framehop follows each module's `.eh_frame` (frame
//! pointers where a module has none) over the bytes the signal handler copied.
//! Hand-written assembly (BLAS kernels) often has neither: there the unwind can go
//! on from a return address found by scanning the stack (`unwind_from`).

use super::modules::Section;
use super::signal::Regs;
use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{FrameAddress, Unwinder};

/// Deeper stacks are cut here.
const MAX_FRAMES: usize = 1024;
/// Return addresses tried, at most, where a frame led nowhere (see `unwind_from`).
pub const MAX_TRIES: usize = 8;

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
pub fn unwind(
    unwinder: &UnwinderX86_64<Section>,
    cache: &mut CacheX86_64,
    regs: Regs,
    stack: &[u8],
    out: &mut Vec<NativeFrame>,
) -> End {
    out.clear();
    let state = UnwindRegsX86_64::new(regs.ip, regs.sp, regs.bp);
    walk(unwinder, cache, regs.sp, stack, state, FrameAddress::from_instruction_pointer(regs.ip), out)
}

/// Unwinds `out` again from the return address `ra` found at `at` in the copy: the
/// frames below `at` stay, the last of them spanning the words up to it (assembly
/// without unwind information, often with a stack of its own it realigned).
pub fn unwind_from(
    unwinder: &UnwinderX86_64<Section>,
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
    walk(unwinder, cache, regs.sp, stack, state, address, out)
}

/// The words of the copy from `from` up that `is_return` takes for return addresses:
/// (where, value), nearest first.
pub fn return_addresses<'a>(
    regs: Regs,
    stack: &'a [u8],
    from: u64,
    mut is_return: impl FnMut(u64) -> bool + 'a,
) -> impl Iterator<Item = (u64, u64)> + 'a {
    let skip = from.saturating_sub(regs.sp).div_ceil(8) as usize;
    (stack.chunks_exact(8).enumerate().skip(skip))
        .map(move |(i, w)| (regs.sp + 8 * i as u64, u64::from_le_bytes(w.try_into().expect("8 bytes"))))
        .filter(move |&(_, w)| is_return(w))
}

/// Appends the frames from `address` (with `state`) to `out`, over the copy `stack` of
/// the stack from `low` up.
fn walk(
    unwinder: &UnwinderX86_64<Section>,
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
        if addr < low || addr + 8 > high {
            past_copy |= addr >= high;
            return Err(());
        }
        let at = (addr - low) as usize;
        Ok(u64::from_le_bytes(stack[at..at + 8].try_into().expect("8 bytes")))
    };
    let end = loop {
        if out.len() >= MAX_FRAMES {
            break End::Cut;
        }
        let sp = state.sp();
        let step = unwinder.unwind_frame(address, &mut state, cache, &mut read);
        let caller_sp = state.sp().max(sp);
        out.push(NativeFrame { pc: address.address_for_lookup(), sp, caller_sp });
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
