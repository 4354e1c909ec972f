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

pub fn gunzip(data: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(data.len() * 8);
    GzDecoder::new(data).read_to_end(&mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        let data = b"{\"a\": 1}".repeat(1000);
        let z = super::gzip(&data, flate2::Compression::fast());
        assert!(z.len() < data.len() / 10);
        assert_eq!(super::gunzip(&z).unwrap(), data);
        assert!(super::gunzip(b"not gzip").is_err());
    }
}
