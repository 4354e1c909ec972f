//! What loading a file may take, from config `pyspy.max-result`, so that a small file
//! cannot take the machine: a gzip bomb stops at a cap as it is decompressed, JSON
//! that would parse into gigabytes (a few MB of tiny objects) is refused before it is
//! parsed, and speedscope weights cannot expand into more samples than fit (see
//! `speedscope_read.rs`). A load then takes at most about twice `max-result`.

use crate::formats::compress;
use serde_json::value::RawValue;
use std::collections::HashMap;

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Bytes of JSON text, decompressed.
    pub json: usize,
    /// Memory of the loaded profile, as a collection counts it; parsing may take twice it.
    pub memory: usize,
}

/// What parsed JSON may take, per byte of text that opens an object or an array, and
/// per further element (after a comma).
pub struct Costs {
    object: u64,
    array: u64,
    element: u64,
}

/// For `serde_json::Value`s (and our small structs), with their copy in Python when
/// metadata is checked: an object a tree node (~700 bytes, ~250 more in Python) for 7
/// bytes of text; an array room for 4 elements in both; an element a 32-byte `Value`
/// and an int object in Python.
pub const VALUES: Costs = Costs { object: 1000, array: 256, element: 72 };
/// For columns of numbers (samples, speedscope stacks and weights): an array a slot,
/// an element at most 8 bytes in its column and a seventh of the 40-byte sample it makes.
pub const COLUMNS: Costs = Costs { object: 1000, array: 16, element: 11 };

/// The most memory parsing `json` may take, from the text alone; a string or a key
/// may cost a heap block.
pub fn parse_cost(json: &str, costs: &Costs) -> u64 {
    json.bytes()
        .map(|b| match b {
            b'{' => costs.object,
            b'[' => costs.array,
            b'"' | b':' => 64,
            b',' => costs.element,
            _ => 1,
        })
        .sum()
}

impl Limits {
    pub fn new(max_result: usize) -> Limits {
        Limits { json: max_result / 2, memory: max_result }
    }

    /// An error unless `len` bytes of JSON are within the limit.
    pub fn check_json(&self, len: usize) -> Result<(), String> {
        match len <= self.json {
            true => Ok(()),
            false => Err(self.too_much_json()),
        }
    }

    fn too_much_json(&self) -> String {
        format!(
            "more than {} MiB of JSON (half of config pyspy.max-result, {} MiB)",
            self.json >> 20,
            self.memory >> 20
        )
    }

    /// An error unless parsing `json`, whose part `columns` holds columns of numbers,
    /// may take at most twice `memory`.
    pub fn check_parse(&self, json: &str, columns: Option<&str>) -> Result<(), String> {
        let discount = columns.map_or(0, |c| parse_cost(c, &VALUES) - parse_cost(c, &COLUMNS));
        let cost = parse_cost(json, &VALUES) - discount;
        match cost <= 2 * self.memory as u64 {
            true => Ok(()),
            false => Err(format!(
                "parsing its JSON could take {} MiB, more than twice config pyspy.max-result ({} MiB)",
                cost >> 20,
                self.memory >> 20
            )),
        }
    }

    /// Bytes of a gzip file, decompressed as a stream up to `json` of them; an error
    /// says whether they were no gzip at all, a cut or damaged one, or too many.
    pub fn gunzip(&self, bytes: &[u8]) -> Result<Vec<u8>, String> {
        if !is_gzip(bytes) {
            return Err("not gzip-compressed".into());
        }
        compress::gunzip_untrusted(bytes, self.json)
            .map_err(|e| format!("a truncated or corrupt gzip file ({e})"))?
            .ok_or_else(|| format!("it decompresses to {}", self.too_much_json()))
    }
}

pub fn is_gzip(bytes: &[u8]) -> bool {
    bytes.starts_with(&[0x1f, 0x8b])
}

/// The text of the field at `path` (keys of nested objects), if there is one.
pub fn raw_field<'a>(json: &'a str, path: &[&str]) -> Option<&'a str> {
    let mut text = json;
    for key in path {
        let fields: HashMap<&str, &RawValue> = serde_json::from_str(text).ok()?;
        text = fields.get(key)?.get();
    }
    Some(text)
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use flate2::Compression;

    pub const LOOSE: Limits = Limits { json: 1 << 40, memory: 1 << 40 };

    #[test]
    fn a_gzip_bomb_stops_at_the_limit() {
        let bomb = compress::gzip(&vec![b' '; 1 << 20], Compression::best());
        let e = Limits { json: 1 << 19, memory: 1 << 30 }.gunzip(&bomb).unwrap_err();
        assert!(e.starts_with("it decompresses to more than 0 MiB of JSON"), "{e}");
        assert_eq!(Limits::new(1 << 22).gunzip(&bomb).unwrap().len(), 1 << 20);
        assert_eq!(Limits::new(1 << 22).gunzip(b"{}").unwrap_err(), "not gzip-compressed");
    }

    #[test]
    fn json_that_would_parse_into_much_more_is_refused() {
        // 80 KB of one-key objects: ~10 MB once parsed into `Value`s and Python dicts.
        let objects = format!("{{\"x\": [{}]}}", vec![r#"{"a":0}"#; 10_000].join(","));
        let e = Limits { json: 1 << 20, memory: 1 << 22 }.check_parse(&objects, None).unwrap_err();
        assert!(
            e.starts_with("parsing its JSON could take 12 MiB, more than twice config pyspy.max-result (4 MiB)"),
            "{e}"
        );
        let columns = format!("[{}]", vec!["0"; 100_000].join(","));
        let doc = format!("{{\"samples\": {columns}}}");
        let limits = Limits { json: 1 << 20, memory: 1 << 20 };
        assert!(limits.check_parse(&doc, None).is_err(), "as values");
        assert!(limits.check_parse(&doc, raw_field(&doc, &["samples"])).is_ok(), "as columns: 1.1 MB");
        assert_eq!(raw_field(r#"{"a": {"b": [1, 2]}}"#, &["a", "b"]), Some("[1, 2]"));
        assert_eq!(raw_field(r#"{"a": 1}"#, &["a", "b"]), None);
    }
}
