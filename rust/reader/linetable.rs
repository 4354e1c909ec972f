//! Line numbers from a code object's location table (`co_linetable`, the format
//! CPython 3.11 introduced; described in CPython's `Objects/locations.md`).
//!
//! Each entry covers 1-8 code units (2 bytes each) and moves the line by a delta;
//! entries with code 15 have no line.

/// The line of the instruction at `byte_offset`, or None if it has no line or the
/// table ends first.
pub fn line_at(table: &[u8], first_line: i32, byte_offset: u32) -> Option<i32> {
    let mut pos = 0;
    let mut line = first_line;
    let mut start: u32 = 0;
    while pos < table.len() {
        let head = table[pos];
        if head & 0x80 == 0 {
            return None; // not at an entry start: a torn or foreign table
        }
        pos += 1;
        let code = (head >> 3) & 0x0f;
        let end = start + 2 * (u32::from(head & 7) + 1);
        let delta = match code {
            15 => 0,
            14 => {
                let d = read_svarint(table, &mut pos)?;
                for _ in 0..3 {
                    read_varint(table, &mut pos)?; // end line, start and end column
                }
                d
            }
            13 => read_svarint(table, &mut pos)?,
            10..=12 => {
                pos += 2; // start and end column
                i32::from(code) - 10
            }
            _ => {
                pos += 1; // short form: column only
                0
            }
        };
        line = line.wrapping_add(delta);
        if byte_offset < end {
            return (code != 15).then_some(line);
        }
        start = end;
    }
    None
}

fn read_varint(table: &[u8], pos: &mut usize) -> Option<u32> {
    let mut value = 0u32;
    let mut shift = 0;
    loop {
        let b = *table.get(*pos)?;
        *pos += 1;
        value |= u32::from(b & 0x3f).checked_shl(shift)?;
        if b & 0x40 == 0 {
            return Some(value);
        }
        shift += 6;
    }
}

fn read_svarint(table: &[u8], pos: &mut usize) -> Option<i32> {
    let v = read_varint(table, pos)?;
    let magnitude = (v >> 1) as i32;
    Some(if v & 1 != 0 { -magnitude } else { magnitude })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(code: u8, units: u8) -> u8 {
        0x80 | (code << 3) | (units - 1)
    }

    #[test]
    fn walks_each_entry_kind() {
        let table = [
            entry(13, 1),
            0, // line +0 (svarint 0): units 0
            entry(10, 2),
            4,
            9, // one-line form, line +0, cols: units 1-2
            entry(12, 1),
            0,
            5, // line +2: unit 3
            entry(14, 1),
            3,
            0,
            1,
            2,            // long form, line -1 (svarint 3): unit 4
            entry(15, 1), // no line: unit 5
            entry(3, 2),
            7, // short form, same line: units 6-7
        ];
        let lines: Vec<_> = (0..8).map(|u| line_at(&table, 10, 2 * u)).collect();
        assert_eq!(lines, [Some(10), Some(10), Some(10), Some(12), Some(11), None, Some(11), Some(11)]);
        assert_eq!(line_at(&table, 10, 16), None, "past the end");
    }

    #[test]
    fn multi_byte_varints() {
        // svarint 200 -> varint 400 = 0b110010000: low 6 bits 0x10 with continuation, then 6.
        let table = [entry(13, 1), 0x40 | 0x10, 6];
        assert_eq!(line_at(&table, 1, 0), Some(201));
    }

    #[test]
    fn garbage_is_refused_not_panicking() {
        assert_eq!(line_at(&[0x01, 0x02], 1, 0), None);
        assert_eq!(line_at(&[entry(14, 1), 0xff], 1, 0), None);
        assert_eq!(line_at(&[], 1, 0), None);
    }
}
