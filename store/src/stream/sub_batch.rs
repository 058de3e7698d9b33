//! The stream protocol's sub-batch entries in a chunk's data section, as osiris stores them:
//! `1:1 compression:3 0:4 count:u16 uncompressed_size:u32 size:u32` (big-endian), then
//! `size` bytes: `count` simple entries (`size:u32` + bytes), compressed as the codec says.
//! The log stores a sub-batch as it was published (one entry, `count` records and offsets) and
//! stream clients get it so (they decompress); the AMQP side of a stream reads its records
//! through [`Records`], which expands it. Codecs served: [`NONE`] and [`GZIP`]; the protocol's
//! others (snappy, lz4, zstd) are refused at publish, since the AMQP side could not read them.

use super::format::{self, FormatError, MAX_CHUNK_BODY};
use bytes::Bytes;
use std::io::Read;

/// The sub-batch header's length.
pub const HEADER: usize = 11;
/// Compression codecs of the protocol (`PROTOCOL.adoc`, "Sub-entry batching").
pub const NONE: u8 = 0;
pub const GZIP: u8 = 1;

/// Whether this log stores sub-batches of `compression` (and can expand them).
pub fn served(compression: u8) -> bool {
    matches!(compression, NONE | GZIP)
}

/// A sub-batch entry's header fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubBatch {
    pub compression: u8,
    pub count: u16,
    pub uncompressed_size: u32,
    pub size: u32,
}

impl SubBatch {
    /// The header of the entry at the start of `entry` (top bit set).
    pub fn parse(entry: &[u8]) -> Option<SubBatch> {
        let h = entry.get(..HEADER)?;
        if h[0] & 0x80 == 0 {
            return None;
        }
        Some(SubBatch {
            compression: (h[0] >> 4) & 0x07,
            count: u16::from_be_bytes([h[1], h[2]]),
            uncompressed_size: u32::from_be_bytes([h[3], h[4], h[5], h[6]]),
            size: u32::from_be_bytes([h[7], h[8], h[9], h[10]]),
        })
    }

    /// The wire header (what [`SubBatch::parse`] reads).
    pub fn encode(&self) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[0] = 0x80 | ((self.compression & 0x07) << 4);
        h[1..3].copy_from_slice(&self.count.to_be_bytes());
        h[3..7].copy_from_slice(&self.uncompressed_size.to_be_bytes());
        h[7..11].copy_from_slice(&self.size.to_be_bytes());
        h
    }
}

/// The simple entries of a sub-batch's `data`, uncompressed (a copy only when compressed).
/// Bounded by the header's `uncompressed_size` (and the chunk body limit): a sub-batch that
/// inflates past what it declares is an error, not an allocation.
pub fn inflate(h: &SubBatch, data: &Bytes) -> Result<Bytes, FormatError> {
    let bad = || FormatError::Entry(0);
    match h.compression {
        NONE => Ok(data.clone()),
        GZIP => {
            let limit = u64::from(h.uncompressed_size).min(MAX_CHUNK_BODY);
            let mut out = Vec::with_capacity(limit.min(1 << 20) as usize);
            flate2::read::GzDecoder::new(&data[..])
                .take(limit + 1)
                .read_to_end(&mut out)
                .map_err(|_| bad())?;
            if out.len() as u64 != u64::from(h.uncompressed_size) {
                return Err(bad());
            }
            Ok(Bytes::from(out))
        }
        _ => Err(bad()),
    }
}

/// A data section's records, in offset order: a simple entry is one, a sub-batch its
/// `count` (expanded). An error for bytes that do not parse, a codec not served, or a
/// sub-batch whose records are not `count`.
pub struct Records<'a> {
    data: &'a Bytes,
    at: usize,
    /// The sub-batch being expanded: its uncompressed records and the position in them, and
    /// how many of its `count` are left.
    inner: Option<(Bytes, usize, u16)>,
}

impl<'a> Records<'a> {
    pub fn new(data: &'a Bytes) -> Records<'a> {
        Records {
            data,
            at: 0,
            inner: None,
        }
    }

    fn fail(&mut self, at: usize) -> Option<Result<Bytes, FormatError>> {
        self.at = self.data.len();
        self.inner = None;
        Some(Err(FormatError::Entry(at)))
    }
}

impl Iterator for Records<'_> {
    type Item = Result<Bytes, FormatError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some((inner, pos, left)) = &mut self.inner {
            if *left == 0 {
                let done = *pos == inner.len();
                self.inner = None;
                if !done {
                    return self.fail(self.at);
                }
            } else {
                let m = format::messages(&inner[*pos..]).next();
                return match m {
                    Some(Ok(m)) => {
                        let start = *pos + 4;
                        *pos = start + m.len();
                        *left -= 1;
                        Some(Ok(inner.slice(start..*pos)))
                    }
                    _ => self.fail(self.at),
                };
            }
        }
        if self.at >= self.data.len() {
            return None;
        }
        let at = self.at;
        let rest = &self.data[at..];
        if rest[0] & 0x80 == 0 {
            return match format::messages(rest).next() {
                Some(Ok(m)) => {
                    self.at = at + 4 + m.len();
                    Some(Ok(self.data.slice(at + 4..self.at)))
                }
                _ => self.fail(at),
            };
        }
        let Some(h) = SubBatch::parse(rest) else {
            return self.fail(at);
        };
        let end = at + HEADER + h.size as usize;
        if end > self.data.len() || h.count == 0 {
            return self.fail(at);
        }
        let Ok(inner) = inflate(&h, &self.data.slice(at + HEADER..end)) else {
            return self.fail(at);
        };
        self.at = end;
        self.inner = Some((inner, 0, h.count));
        self.next()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn simple(records: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for r in records {
            format::put_message(&mut out, r);
        }
        out
    }

    fn sub_batch(compression: u8, records: &[&[u8]]) -> Vec<u8> {
        let plain = simple(records);
        let data = match compression {
            GZIP => {
                let mut e =
                    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                e.write_all(&plain).unwrap();
                e.finish().unwrap()
            }
            _ => plain.clone(),
        };
        let h = SubBatch {
            compression,
            count: records.len() as u16,
            uncompressed_size: plain.len() as u32,
            size: data.len() as u32,
        };
        let mut out = h.encode().to_vec();
        out.extend_from_slice(&data);
        out
    }

    #[test]
    fn records_expand_plain_and_gzip_sub_batches_between_simple_entries() {
        let mut data = simple(&[b"a"]);
        data.extend(sub_batch(NONE, &[b"b1", b"b22"]));
        data.extend(simple(&[b"c"]));
        data.extend(sub_batch(GZIP, &[b"d1", b"", b"d333"]));
        let data = Bytes::from(data);
        let got: Vec<Bytes> = Records::new(&data).collect::<Result<_, _>>().unwrap();
        let want: Vec<&[u8]> = vec![b"a", b"b1", b"b22", b"c", b"d1", b"", b"d333"];
        assert_eq!(got, want);
    }

    /// The log stores a sub-batch as one entry of its records, merged with the messages
    /// around it, reads its records back expanded, and keeps it all across a reopen;
    /// a codec it does not serve is refused before anything is staged.
    #[test]
    fn the_log_stores_sub_batches_as_entries_of_their_records() {
        use crate::stream::{OffsetSpec, ReaderOptions, StreamConfig, StreamLog};
        let dir = std::env::temp_dir().join(format!("warren-sub-batch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = || StreamConfig {
            fsync: false,
            ..StreamConfig::default()
        };
        let mut log = StreamLog::open(&dir, config()).unwrap();
        log.append_merged(&[b"a"], &[], 1, &[]).unwrap();
        let gz = sub_batch(GZIP, &[b"b1", b"b22", b"b333"]);
        let r = log
            .append_merged_sub_batch(&gz, None, 2, &[("w", 7)])
            .unwrap();
        assert_eq!(r, 1..4);
        let mut snappy = sub_batch(NONE, &[b"x"]);
        snappy[0] = 0x80 | (2 << 4);
        assert!(
            log.append_merged_sub_batch(&snappy, None, 3, &[]).is_err(),
            "snappy"
        );
        assert!(
            log.append_merged_sub_batch(&gz[..gz.len() - 1], None, 3, &[])
                .is_err()
        );
        log.sync().unwrap();
        for reopened in [false, true] {
            if reopened {
                drop(log);
                log = StreamLog::open(&dir, config()).unwrap();
            }
            assert_eq!(log.bounds().next, 4);
            assert_eq!(log.last_chunk(), Some(0));
            assert_eq!(log.publisher_sequence("w"), Some(7));
            let mut reader = log
                .reader(OffsetSpec::First, ReaderOptions::default())
                .unwrap();
            let chunk = reader.next_chunk().unwrap().expect("a chunk");
            assert_eq!((chunk.entries, chunk.count), (2, 4));
            let data = chunk.bytes().unwrap();
            assert_eq!(&data[5..], &gz[..], "stored as published");
            let got: Vec<Bytes> = crate::stream::ReadChunk::records(&data)
                .collect::<Result<_, _>>()
                .unwrap();
            let want: Vec<&[u8]> = vec![b"a", b"b1", b"b22", b"b333"];
            assert_eq!(got, want);
            assert!(reader.next_chunk().unwrap().is_none());
        }
        drop(log);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_sub_batches_are_errors_not_panics() {
        let good = sub_batch(GZIP, &[b"x", b"y"]);
        // Every cut, every codec not served, a count that lies, an inflated size that lies.
        for cut in 0..good.len() {
            let d = Bytes::from(good[..cut].to_vec());
            assert!(
                Records::new(&d).any(|r| r.is_err()) || cut == 0,
                "cut {cut}"
            );
        }
        for codec in 2..8u8 {
            let mut b = good.clone();
            b[0] = 0x80 | (codec << 4);
            let d = Bytes::from(b);
            assert!(Records::new(&d).any(|r| r.is_err()), "codec {codec}");
        }
        let mut more = good.clone();
        more[2] = 3;
        assert!(Records::new(&Bytes::from(more)).any(|r| r.is_err()));
        let mut fewer = good.clone();
        fewer[2] = 1;
        assert!(Records::new(&Bytes::from(fewer)).any(|r| r.is_err()));
        let mut size = good;
        size[6] = size[6].wrapping_add(1);
        assert!(Records::new(&Bytes::from(size)).any(|r| r.is_err()));
    }
}
