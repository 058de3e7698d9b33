//! Osiris's chunk layout, which a Deliver frame carries as it is stored (`osiris_log.erl`,
//! "Chunk format"): a 48-byte header, the bloom filter (`bloom_size` bytes), the data
//! entries (`data_length` bytes), the trailer (`trailer_length` bytes). The CRC is
//! CRC-32 (IEEE, as zlib's and Erlang's `crc32`) over the data entries only.
//!
//! ```text
//! 0   u8   magic (5) << 4 | version (0)          = 0x50
//! 1   u8   chunk type (0 user, 1 tracking delta, 2 tracking snapshot)
//! 2   u16  number of entries
//! 4   u32  number of records (a sub-batch entry holds several)
//! 8   i64  timestamp, ms since the epoch
//! 16  u64  epoch
//! 24  u64  chunk id = offset of the first record
//! 32  u32  CRC-32 of the data entries
//! 36  u32  data length
//! 40  u32  trailer length
//! 44  u8   bloom filter size
//! 45  u24  reserved (0)
//! ```

use crate::frame::{DecodeError, Reader};
use bytes::{BufMut, Bytes, BytesMut};
use std::fs::File;
use std::sync::Arc;

pub const HEADER_LEN: usize = 48;
pub const MAGIC_VERSION: u8 = 0x50;
pub const CHUNK_USER: u8 = 0;
/// At most this many entries per chunk (the entry count is 16 bits).
pub const MAX_ENTRIES: usize = u16::MAX as usize;
/// Entries a backend puts in one chunk at most (a Publish frame of more becomes several
/// chunks). Consumer credit counts chunks, so this is how many messages one credit may let
/// through: RabbitMQ 3.10's writer made chunks of 32 to 512 entries of one 500- or
/// 3000-message frame; 256 keeps credit as fine-grained while a chunk's fixed costs (a
/// 48-byte header, an index entry, a Deliver frame, a CRC pass) stay a small share of it
/// (docs/storage.md, "Chunk size").
pub const CHUNK_ENTRIES: usize = 256;

/// The fields of a chunk header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHeader {
    pub chunk_type: u8,
    pub num_entries: u16,
    pub num_records: u32,
    pub timestamp: i64,
    pub epoch: u64,
    pub chunk_id: u64,
    pub crc: u32,
    pub data_len: u32,
    pub trailer_len: u32,
    pub bloom_size: u8,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChunkError {
    #[error("chunk shorter than its header or its declared sizes")]
    Truncated,
    #[error("bad magic/version byte {0:#04x}")]
    Magic(u8),
    #[error("data CRC mismatch")]
    Crc,
}

impl ChunkHeader {
    pub fn parse(b: &[u8]) -> Result<ChunkHeader, ChunkError> {
        if b.len() < HEADER_LEN {
            return Err(ChunkError::Truncated);
        }
        if b[0] != MAGIC_VERSION {
            return Err(ChunkError::Magic(b[0]));
        }
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_be_bytes(a)
        };
        Ok(ChunkHeader {
            chunk_type: b[1],
            num_entries: u16::from_be_bytes([b[2], b[3]]),
            num_records: u32_at(4),
            timestamp: u64_at(8) as i64,
            epoch: u64_at(16),
            chunk_id: u64_at(24),
            crc: u32_at(32),
            data_len: u32_at(36),
            trailer_len: u32_at(40),
            bloom_size: b[44],
        })
    }

    pub fn put(&self, out: &mut BytesMut) {
        out.put_u8(MAGIC_VERSION);
        out.put_u8(self.chunk_type);
        out.put_u16(self.num_entries);
        out.put_u32(self.num_records);
        out.put_i64(self.timestamp);
        out.put_u64(self.epoch);
        out.put_u64(self.chunk_id);
        out.put_u32(self.crc);
        out.put_u32(self.data_len);
        out.put_u32(self.trailer_len);
        out.put_u8(self.bloom_size);
        out.put_slice(&[0, 0, 0]);
    }

    /// Header + bloom + data + trailer.
    pub fn total_len(&self) -> usize {
        HEADER_LEN + self.bloom_size as usize + self.data_len as usize + self.trailer_len as usize
    }
}

/// Bytes in a file: a chunk's data section as it lies in a segment file. The session only
/// passes it on; its shell sends it to the socket (`sendfile`, no copy through user space)
/// or reads and writes it (TLS, or no `sendfile`).
#[derive(Clone, Debug)]
pub struct FileRange {
    pub file: Arc<File>,
    pub offset: u64,
    pub len: u32,
}

impl PartialEq for FileRange {
    fn eq(&self, other: &FileRange) -> bool {
        Arc::ptr_eq(&self.file, &other.file) && self.offset == other.offset && self.len == other.len
    }
}

impl Eq for FileRange {}

/// A chunk's data entries: in memory, or a range of a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChunkData {
    Bytes(Bytes),
    File(FileRange),
}

impl ChunkData {
    pub fn len(&self) -> usize {
        match self {
            ChunkData::Bytes(b) => b.len(),
            ChunkData::File(r) => r.len as usize,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<Bytes> for ChunkData {
    fn from(b: Bytes) -> ChunkData {
        ChunkData::Bytes(b)
    }
}

/// A user chunk as a backend hands it to a session: what its header needs, and its data
/// entries (the session writes the 48-byte header, without bloom filter or trailer, then the
/// data). A log whose data section is osiris's entries serves it without re-encoding, from
/// memory or as a file range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Offset of its first record (the chunk id).
    pub first_offset: u64,
    pub num_entries: u16,
    pub num_records: u32,
    /// ms since the epoch.
    pub timestamp: i64,
    /// CRC-32 (IEEE) of `data`.
    pub crc: u32,
    /// The data entries.
    pub data: ChunkData,
}

impl Chunk {
    pub fn header(&self) -> ChunkHeader {
        ChunkHeader {
            chunk_type: CHUNK_USER,
            num_entries: self.num_entries,
            num_records: self.num_records,
            timestamp: self.timestamp,
            epoch: 1,
            chunk_id: self.first_offset,
            crc: self.crc,
            data_len: self.data.len() as u32,
            trailer_len: 0,
            bloom_size: 0,
        }
    }

    /// Bytes on the wire: header and data.
    pub fn wire_len(&self) -> usize {
        HEADER_LEN + self.data.len()
    }

    /// Header then data, as a Deliver frame carries it; for data in a file, the header
    /// only, and the range to send after it.
    pub fn put(&self, out: &mut BytesMut) -> Option<&FileRange> {
        self.header().put(out);
        match &self.data {
            ChunkData::Bytes(b) => {
                out.put_slice(b);
                None
            }
            ChunkData::File(r) => Some(r),
        }
    }

    /// Header and data in memory (a chunk whose data is in memory).
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.wire_len());
        let file = self.put(&mut out);
        debug_assert!(file.is_none(), "to_bytes of a file-backed chunk");
        out.freeze()
    }
}

/// Builds a user chunk from at most [`MAX_ENTRIES`] entries.
pub fn build(first_offset: u64, timestamp: i64, entries: &[&Entry]) -> Chunk {
    debug_assert!(entries.len() <= MAX_ENTRIES);
    let data_len: usize = entries.iter().map(|e| e.encoded_len()).sum();
    let mut data = BytesMut::with_capacity(data_len);
    for e in entries {
        e.put(&mut data);
    }
    Chunk {
        first_offset,
        num_entries: entries.len() as u16,
        num_records: entries.iter().map(|e| e.records()).sum(),
        timestamp,
        crc: crc32fast::hash(&data),
        data: ChunkData::Bytes(data.freeze()),
    }
}

/// Checks a whole chunk (sizes and CRC) and returns its header.
pub fn verify(chunk: &[u8]) -> Result<ChunkHeader, ChunkError> {
    let h = ChunkHeader::parse(chunk)?;
    if chunk.len() < h.total_len() {
        return Err(ChunkError::Truncated);
    }
    let start = HEADER_LEN + h.bloom_size as usize;
    let data = &chunk[start..start + h.data_len as usize];
    if crc32fast::hash(data) != h.crc {
        return Err(ChunkError::Crc);
    }
    Ok(h)
}

/// A data entry as osiris stores it: one message, or a sub-batch of (possibly compressed)
/// messages that counts as `count` records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    Simple(Bytes),
    SubBatch {
        /// 0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd (opaque to the broker).
        compression: u8,
        count: u16,
        uncompressed_size: u32,
        data: Bytes,
    },
}

impl Entry {
    /// Records this entry accounts for (offsets it takes).
    pub fn records(&self) -> u32 {
        match self {
            Entry::Simple(_) => 1,
            Entry::SubBatch { count, .. } => *count as u32,
        }
    }

    /// Bytes it takes in a chunk's data section.
    pub fn encoded_len(&self) -> usize {
        match self {
            Entry::Simple(b) => 4 + b.len(),
            Entry::SubBatch { data, .. } => 11 + data.len(),
        }
    }

    /// The osiris entry layout (also the Publish layout after the publishing id).
    pub fn put(&self, out: &mut BytesMut) {
        match self {
            Entry::Simple(b) => {
                out.put_u32(b.len() as u32 & 0x7fff_ffff);
                out.put_slice(b);
            }
            Entry::SubBatch {
                compression,
                count,
                uncompressed_size,
                data,
            } => {
                out.put_u8(0x80 | ((compression & 0x07) << 4));
                out.put_u16(*count);
                out.put_u32(*uncompressed_size);
                out.put_u32(data.len() as u32);
                out.put_slice(data);
            }
        }
    }

    pub fn read(r: &mut Reader) -> Result<Entry, DecodeError> {
        let first = r.u8("entry header")?;
        if first & 0x80 == 0 {
            let rest = [
                r.u8("entry size")?,
                r.u8("entry size")?,
                r.u8("entry size")?,
            ];
            let len = u32::from_be_bytes([first, rest[0], rest[1], rest[2]]) as usize;
            Ok(Entry::Simple(r.take(len, "entry")?))
        } else {
            let compression = (first >> 4) & 0x07;
            let count = r.u16("sub-batch count")?;
            let uncompressed_size = r.u32("sub-batch size")?;
            let len = r.u32("sub-batch length")? as usize;
            let data = r.take(len, "sub-batch")?;
            Ok(Entry::SubBatch {
                compression,
                count,
                uncompressed_size,
                data,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_chunk_verifies_and_counts_records() {
        let a = Entry::Simple(Bytes::from_static(b"hello"));
        let b = Entry::SubBatch {
            compression: 0,
            count: 3,
            uncompressed_size: 9,
            data: Bytes::from_static(b"abcdefghi"),
        };
        let c = build(42, 1_700_000_000_000, &[&a, &b]).to_bytes();
        let h = verify(&c).unwrap();
        assert_eq!(h.chunk_id, 42);
        assert_eq!(h.num_entries, 2);
        assert_eq!(h.num_records, 4);
        assert_eq!(h.data_len as usize, 4 + 5 + 11 + 9);
        assert_eq!(c.len(), h.total_len());
        // The CRC is zlib's CRC-32 over the entries: "hello" with its size prefix.
        let only = build(0, 0, &[&a]).to_bytes();
        assert_eq!(
            ChunkHeader::parse(&only).unwrap().crc,
            crc32fast::hash(b"\x00\x00\x00\x05hello")
        );
        let mut bad = c.to_vec();
        bad[HEADER_LEN + 5] ^= 1;
        assert_eq!(verify(&bad), Err(ChunkError::Crc));
    }
}
