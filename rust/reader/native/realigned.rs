//! Functions whose frame address (CFA) their unwind tables give as an expression that
//! reads memory. GCC writes them for functions it realigns the stack of (locals kept
//! 32- or 64-byte aligned: AVX-512 kernels such as numpy's SIMD sort): the caller's
//! stack pointer is kept at `[rbp-8]`, and the CFA is `DW_OP_breg6 -8; DW_OP_deref`.
//! framehop evaluates no memory in an expression and falls back to the frame pointer,
//! which finds the return address but puts the caller's stack pointer up to 64 bytes
//! too low: the caller's own unwind then reads a wrong word, and the stack goes astray
//! before its eval loops. These rows are found (gimli parses the tables) when a
//! module's tables are read, decoded to `Place`s, and stepped here.

use super::modules::Table;
use framehop::x86_64::UnwindRegsX86_64;
use framehop::ExplicitModuleSectionInfo;
use gimli::{
    BaseAddresses, CfaRule, CieOrFde, EhFrame, EndianSlice, Expression, LittleEndian, Operation, RegisterRule,
    UnwindContext, UnwindSection, X86_64,
};
use std::ops::Range;

/// An address a row's expression computes: the stack or frame pointer plus `offset`,
/// the word there where `deref` (`DW_OP_bregN offset`, then `DW_OP_deref` or not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Place {
    from_bp: bool,
    offset: i64,
    deref: bool,
}

/// Where a row keeps the caller's frame pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SavedBp {
    Unchanged,
    AtCfa(i64),
    At(Place),
}

/// The rows of one span of code: the CFA at `cfa`, the return address at CFA-8.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rule {
    cfa: Place,
    bp: SavedBp,
}

/// The rows framehop cannot step, of every module read, by code address.
#[derive(Default)]
pub struct Realigned {
    rows: Vec<(Range<u64>, Rule)>,
}

impl Realigned {
    /// Adds the rows of a module's `tables` (as framehop takes them), loaded with load
    /// bias `bias`.
    pub fn add(&mut self, tables: &ExplicitModuleSectionInfo<Table>, bias: u64) {
        let found = rows(tables).unwrap_or_default();
        if found.is_empty() {
            return;
        }
        let shifted = found.into_iter().map(|(r, rule)| (r.start.wrapping_add(bias)..r.end.wrapping_add(bias), rule));
        self.rows.extend(shifted);
        self.rows.sort_unstable_by_key(|(r, _)| r.start);
    }

    /// Forgets the rows of a module unloaded, whose code was `code`.
    pub fn remove(&mut self, code: &Range<u64>) {
        self.rows.retain(|(r, _)| !code.contains(&r.start));
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Steps `regs` from the frame at `pc` (an address to look up: a return address
    /// less one, or the interrupted instruction) to its caller, reading the stack with
    /// `read`; None where `pc` is in no row here (framehop's to step). Ok(the return
    /// address), or Err where the words it needs are not in the copy.
    pub fn step(
        &self,
        pc: u64,
        regs: &mut UnwindRegsX86_64,
        read: &mut impl FnMut(u64) -> Result<u64, ()>,
    ) -> Option<Result<u64, ()>> {
        let i = self.rows.partition_point(|(r, _)| r.start <= pc).checked_sub(1)?;
        let (range, rule) = &self.rows[i];
        range.contains(&pc).then(|| step(rule, regs, read))
    }
}

fn step(rule: &Rule, regs: &mut UnwindRegsX86_64, read: &mut impl FnMut(u64) -> Result<u64, ()>) -> Result<u64, ()> {
    let cfa = rule.cfa.address(regs, read)?;
    // A caller's frame is above its callee's: anything else is a stale or torn word.
    if cfa <= regs.sp() {
        return Err(());
    }
    let bp = match rule.bp {
        SavedBp::Unchanged => regs.bp(),
        SavedBp::AtCfa(offset) => read(cfa.wrapping_add_signed(offset))?,
        SavedBp::At(place) => {
            let at = place.address(regs, read)?;
            read(at)?
        }
    };
    let ra = read(cfa - 8)?;
    regs.set_ip(ra);
    regs.set_sp(cfa);
    regs.set_bp(bp);
    Ok(ra)
}

impl Place {
    fn address(&self, regs: &UnwindRegsX86_64, read: &mut impl FnMut(u64) -> Result<u64, ()>) -> Result<u64, ()> {
        let at = if self.from_bp { regs.bp() } else { regs.sp() }.wrapping_add_signed(self.offset);
        if self.deref {
            read(at)
        } else {
            Ok(at)
        }
    }

    /// `expr` as a place, if it is one.
    fn of(expr: Expression<Reader<'_>>) -> Option<Place> {
        let encoding = gimli::Encoding { address_size: 8, format: gimli::Format::Dwarf32, version: 4 };
        let mut ops = expr.operations(encoding);
        let Some(Operation::RegisterOffset { register, offset, base_type }) = ops.next().ok()? else { return None };
        let from_bp = match register {
            X86_64::RBP => true,
            X86_64::RSP => false,
            _ => return None,
        };
        let deref = match ops.next().ok()? {
            None => false,
            Some(Operation::Deref { size: 8, space: false, .. }) => true,
            Some(_) => return None,
        };
        (base_type.0 == 0 && ops.next().ok()?.is_none()).then_some(Place { from_bp, offset, deref })
    }
}

type Reader<'a> = EndianSlice<'a, LittleEndian>;

/// The rows of `tables` whose CFA is a place (and whose return address is at CFA-8,
/// as on every x86-64 row), adjacent rows of one rule joined; file addresses.
fn rows(tables: &ExplicitModuleSectionInfo<Table>) -> gimli::Result<Vec<(Range<u64>, Rule)>> {
    let (Some(eh_frame), Some(at)) = (&tables.eh_frame, &tables.eh_frame_svma) else { return Ok(Vec::new()) };
    let section = EhFrame::new(eh_frame, LittleEndian);
    let mut bases = BaseAddresses::default().set_eh_frame(at.start);
    if let Some(text) = &tables.text_svma {
        bases = bases.set_text(text.start);
    }
    if let Some(got) = &tables.got_svma {
        bases = bases.set_got(got.start);
    }
    let mut context = Box::new(UnwindContext::new());
    let mut found: Vec<(Range<u64>, Rule)> = Vec::new();
    let mut entries = section.entries(&bases);
    while let Some(entry) = entries.next()? {
        let CieOrFde::Fde(partial) = entry else { continue };
        if !may_set_cfa_by_expression(eh_frame, partial.offset(), partial.entry_len()) {
            continue; // most, unparsed: parsing every FDE of a large library took ~10 ms
        }
        let Ok(fde) = partial.parse(|s, b, o| s.cie_from_offset(b, o)) else { continue };
        if !sets_cfa_by_expression(fde.instructions(&section, &bases)) {
            continue; // most: rows are built only where one can be ours (GCC's CIEs set none)
        }
        let Ok(mut table) = fde.rows(&section, &bases, &mut context) else { continue };
        while let Ok(Some(row)) = table.next_row() {
            let Some(rule) = rule_of(&section, row) else { continue };
            let span = row.start_address()..row.end_address();
            match found.last_mut() {
                Some((last, same)) if *same == rule && last.end == span.start => last.end = span.end,
                _ => found.push((span, rule)),
            }
        }
    }
    Ok(found)
}

/// Whether the FDE at `offset` of `eh_frame` (`len` bytes after its 32-bit length) may
/// hold `DW_CFA_def_cfa_expression`: whether any byte after its CIE pointer is that
/// opcode. True where that cannot be told (64-bit lengths, bytes missing).
fn may_set_cfa_by_expression(eh_frame: &[u8], offset: usize, len: usize) -> bool {
    const DWARF64: [u8; 4] = [0xff; 4];
    if eh_frame.get(offset..offset + 4).is_none_or(|length| length == DWARF64) {
        return true;
    }
    let opcode = gimli::constants::DW_CFA_def_cfa_expression.0;
    eh_frame.get(offset + 8..offset + 4 + len).is_none_or(|body| body.contains(&opcode))
}

fn sets_cfa_by_expression(mut instructions: gimli::CallFrameInstructionIter<'_, Reader<'_>>) -> bool {
    while let Ok(Some(instruction)) = instructions.next() {
        if matches!(instruction, gimli::CallFrameInstruction::DefCfaExpression { .. }) {
            return true;
        }
    }
    false
}

fn rule_of(section: &EhFrame<Reader<'_>>, row: &gimli::UnwindTableRow<usize>) -> Option<Rule> {
    let CfaRule::Expression(cfa) = row.cfa() else { return None };
    if row.register(X86_64::RA) != Some(RegisterRule::Offset(-8)) {
        return None;
    }
    let bp = match row.register(X86_64::RBP) {
        None | Some(RegisterRule::Undefined | RegisterRule::SameValue) => SavedBp::Unchanged,
        Some(RegisterRule::Offset(offset)) => SavedBp::AtCfa(offset),
        Some(RegisterRule::Expression(e)) => SavedBp::At(Place::of(e.get(section).ok()?)?),
        _ => return None,
    };
    Some(Rule { cfa: Place::of(cfa.get(section).ok()?)?, bp })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GCC's rule for a realigned body: CFA = [rbp-8], the caller's rbp at [rbp].
    fn realigned() -> Rule {
        Rule {
            cfa: Place { from_bp: true, offset: -8, deref: true }, // DW_OP_breg6 -8; DW_OP_deref
            bp: SavedBp::At(Place { from_bp: true, offset: 0, deref: false }), // DW_OP_breg6 0
        }
    }

    #[test]
    fn a_realigned_frame_steps_to_its_callers_stack_pointer() {
        // The caller called at sp 0x1040: its return address at 0x1038, CFA 0x1040.
        // The callee realigned down to 0x1000, copied the return address to 0xff8,
        // saved rbp at 0xff0 (rbp = 0xff0) and the CFA at 0xfe8.
        let words = [(0xfe8, 0x1040), (0xff0, 0x2222), (0xff8, 0x7000), (0x1038, 0x7000)];
        let mut read = |at: u64| words.iter().find(|(a, _)| *a == at).map(|(_, w)| *w).ok_or(());
        let mut regs = UnwindRegsX86_64::new(0x6000, 0xfc0, 0xff0);
        let realigned = Realigned { rows: vec![(0x6000..0x6100, realigned())] };
        assert_eq!(realigned.step(0x6000, &mut regs, &mut read), Some(Ok(0x7000)));
        assert_eq!((regs.ip(), regs.sp(), regs.bp()), (0x7000, 0x1040, 0x2222));
        assert_eq!(realigned.step(0x6100, &mut regs, &mut read), None, "outside the row: framehop's");
        let mut torn = UnwindRegsX86_64::new(0x6000, 0xfc0, 0x5000);
        assert_eq!(realigned.step(0x6000, &mut torn, &mut read), Some(Err(())), "no word at [rbp-8]");
    }

    #[test]
    fn rows_whose_cfa_reads_memory_are_found_in_eh_frame() {
        let eh_frame = minimal_eh_frame();
        let len = eh_frame.len() as u64;
        let tables = ExplicitModuleSectionInfo {
            eh_frame_svma: Some(0x10000..0x10000 + len),
            eh_frame: Some(eh_frame),
            ..Default::default()
        };
        let found = rows(&tables).unwrap();
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].0, 0x5004..0x5040);
        assert_eq!(found[0].1, realigned());
    }

    #[test]
    fn only_fdes_holding_the_opcode_are_parsed() {
        let eh_frame = minimal_eh_frame();
        let fde_at = 4 + u32::from_le_bytes(eh_frame[..4].try_into().unwrap()) as usize;
        let fde_len = u32::from_le_bytes(eh_frame[fde_at..fde_at + 4].try_into().unwrap()) as usize;
        assert!(may_set_cfa_by_expression(&eh_frame, fde_at, fde_len), "the realigned FDE");
        let mut plain = eh_frame.clone();
        let opcode = plain[fde_at..].iter().position(|&b| b == 0x0f).unwrap() + fde_at;
        plain[opcode] = 0x0e; // def_cfa_offset 3: no expression left
        assert!(!may_set_cfa_by_expression(&plain, fde_at, fde_len));
        assert!(may_set_cfa_by_expression(&plain, fde_at, fde_len + 64), "bytes missing: parsed");
    }

    /// A CIE (CFA = rsp+8, ra at CFA-8) and an FDE for 0x5000..0x5040 (pcrel) that
    /// from 0x5004 on sets CFA = [rbp-8] and rbp at [rbp].
    fn minimal_eh_frame() -> Vec<u8> {
        let mut cie = vec![0, 0, 0, 0, 1, b'z', b'R', 0, 1, 0x78, 16, 1, 0x1b];
        cie.extend([0x0c, 7, 8, 0x90, 1]); // def_cfa rsp+8; ra at cfa-8
        pad_entry(&mut cie);
        let fde_at = cie.len();
        let mut fde = (fde_at as u32 + 4).to_le_bytes().to_vec(); // CIE pointer
        let pc_field = 0x10000 + fde_at as i64 + 4 + 4; // where the initial location is
        fde.extend(((0x5000 - pc_field) as i32).to_le_bytes());
        fde.extend(0x40u32.to_le_bytes());
        fde.push(0); // augmentation data length
        fde.extend([0x44]); // advance_loc 4
        fde.extend([0x0f, 3, 0x76, 0x78, 0x06]); // def_cfa_expression breg6 -8; deref
        fde.extend([0x10, 6, 2, 0x76, 0x00]); // expression rbp: breg6 0
        pad_entry(&mut fde);
        let mut out = cie;
        out.extend(fde);
        out.extend([0, 0, 0, 0]); // terminator
        out
    }

    /// Prefixes an entry's length and pads it with DW_CFA_nop to 8 bytes.
    fn pad_entry(entry: &mut Vec<u8>) {
        while (entry.len() + 4) % 8 != 0 {
            entry.push(0);
        }
        let len = (entry.len() as u32).to_le_bytes();
        entry.splice(0..0, len);
    }
}
