//! gzip for files and the wire.

use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;
use std::io::{Read, Write};

/// Documents above this are gzipped at a fast level: a 1000-worker speedscope file
/// (~570 MB of JSON) took 15 s at the default level, most of its report's time.
const LARGE: usize = 64 << 20;

/// The level of large documents: it took 2.4 s there for a file 1.3x larger (level 1:
/// 1.2 s, 1.8x; level 3: 4 s, 1.1x).
const LARGE_LEVEL: u32 = 2;

/// Files people keep: the default level; a large document LARGE_LEVEL.
pub fn kept(data: &[u8]) -> Vec<u8> {
    gzip(data, if data.len() > LARGE { Compression::new(LARGE_LEVEL) } else { Compression::default() })
}

/// `kept` of a document written in pieces: held until it passes LARGE, then gzipped
/// as it comes, so a large one is never whole in memory.
#[derive(Default)]
pub struct Kept {
    held: Vec<u8>,
    stream: Option<GzEncoder<Vec<u8>>>,
}

impl Write for Kept {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(stream) = &mut self.stream {
            return stream.write(buf);
        }
        self.held.extend_from_slice(buf);
        if self.held.len() > LARGE {
            let mut stream = GzEncoder::new(Vec::with_capacity(LARGE / 4), Compression::new(LARGE_LEVEL));
            stream.write_all(&std::mem::take(&mut self.held))?;
            self.stream = Some(stream);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Kept {
    pub fn finish(self) -> Vec<u8> {
        match self.stream {
            Some(stream) => stream.finish().expect("writing to a Vec cannot fail"),
            None => kept(&self.held),
        }
    }
}

/// Files people keep get `kept`'s level; the wire between processes the fastest.
pub fn gzip(data: &[u8], level: Compression) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::with_capacity(data.len() / 8), level);
    enc.write_all(data).expect("writing to a Vec cannot fail");
    enc.finish().expect("writing to a Vec cannot fail")
}

/// Decompresses at most `limit` bytes, as a stream: `Ok(None)` if there are more
/// (a lie about the size), which stop there. Every member of the data counts, as gzip
/// and Python read it: concatenated gzips (`cat a.gz b.gz`, parallel compressors) are
/// one file.
pub fn gunzip_at_most(data: &[u8], limit: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut out = Vec::with_capacity(limit.min(data.len().saturating_mul(16)));
    MultiGzDecoder::new(data).take((limit as u64).saturating_add(1)).read_to_end(&mut out)?;
    Ok((out.len() <= limit).then_some(out))
}

/// `gunzip_at_most` after a first pass that keeps nothing: a file that decompresses
/// past `limit` (a gzip bomb) is refused having taken no memory but its own, where
/// decompressing it into memory would take `limit`. Untrusted files only: the wire's
/// parts announce their size, checked before they are sent.
pub fn gunzip_untrusted(data: &[u8], limit: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut counted = MultiGzDecoder::new(data).take((limit as u64).saturating_add(1));
    let size = std::io::copy(&mut counted, &mut std::io::sink())?;
    match usize::try_from(size) {
        Ok(size) if size <= limit => gunzip_at_most(data, size),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn kept_in_pieces_is_kept() {
        use std::io::Write;
        for size in [1000, super::LARGE + 1] {
            let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            let mut pieces = super::Kept::default();
            data.chunks(4096).for_each(|c| pieces.write_all(c).unwrap());
            let (whole, streamed) = (super::kept(&data), pieces.finish());
            assert_eq!(super::gunzip_at_most(&streamed, size).unwrap(), Some(data));
            assert_eq!(streamed.len(), whole.len(), "the same level as `kept`");
        }
    }

    #[test]
    fn round_trip() {
        let data = b"{\"a\": 1}".repeat(1000);
        let z = super::gzip(&data, flate2::Compression::fast());
        assert!(z.len() < data.len() / 10);
        assert_eq!(super::gunzip_at_most(&z, data.len()).unwrap(), Some(data.clone()));
        assert!(super::gunzip_at_most(b"not gzip", 100).is_err());
        assert_eq!(super::gunzip_at_most(&z, data.len() - 1).unwrap(), None);
    }

    #[test]
    fn every_member_counts_toward_the_limit() {
        let member = super::gzip(&[0; 1000], flate2::Compression::best());
        let members = member.repeat(5);
        for gunzip in [super::gunzip_at_most, super::gunzip_untrusted] {
            assert_eq!(gunzip(&members, 5000).unwrap(), Some(vec![0; 5000]));
            assert_eq!(gunzip(&members, 4999).unwrap(), None);
            assert!(gunzip(&members[..members.len() - 3], 5000).is_err(), "a cut member");
        }
    }
}
