//! Unwinding a copied stack: framehop follows each module's `.eh_frame` (frame
//! pointers where a module has none) over the bytes the signal handler copied.

use super::modules::Section;
use super::signal::Regs;
use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{FrameAddress, Unwinder};

/// Deeper stacks are cut here.
const MAX_FRAMES: usize = 1024;

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
    let (low, high) = (regs.sp, regs.sp + stack.len() as u64);
    let mut past_copy = false;
    let mut read = |addr: u64| {
        if addr < low || addr + 8 > high {
            past_copy |= addr >= high;
            return Err(());
        }
        let at = (addr - low) as usize;
        Ok(u64::from_le_bytes(stack[at..at + 8].try_into().expect("8 bytes")))
    };
    let mut state = UnwindRegsX86_64::new(regs.ip, regs.sp, regs.bp);
    let mut address = FrameAddress::from_instruction_pointer(regs.ip);
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
