//! gzip for files and the wire.

use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;
use std::io::{Read, Write};

/// Files people keep get the default level; the wire between processes the fastest.
pub fn gzip(data: &[u8], level: Compression) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::with_capacity(data.len() / 8), level);
    enc.write_all(data).expect("writing to a Vec cannot fail");
    enc.finish().expect("writing to a Vec cannot fail")
}

/// Decompresses at most `limit` bytes, as a stream: `Ok(None)` if there are more
/// (a gzip bomb, or a lie about the size), which stop there instead of taking memory.
pub fn gunzip_at_most(data: &[u8], limit: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut out = Vec::with_capacity(limit.min(data.len().saturating_mul(16)));
    GzDecoder::new(data).take((limit as u64).saturating_add(1)).read_to_end(&mut out)?;
    Ok((out.len() <= limit).then_some(out))
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        let data = b"{\"a\": 1}".repeat(1000);
        let z = super::gzip(&data, flate2::Compression::fast());
        assert!(z.len() < data.len() / 10);
        assert_eq!(super::gunzip_at_most(&z, data.len()).unwrap(), Some(data.clone()));
        assert!(super::gunzip_at_most(b"not gzip", 100).is_err());
        assert_eq!(super::gunzip_at_most(&z, data.len() - 1).unwrap(), None);
    }
}
