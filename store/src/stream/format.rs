//! Byte layouts of a stream's files: segment (`.sd`) and index (`.si`) file headers, chunk
//! headers, index entries, message entries and tracking entries. Documented byte by byte in
//! docs/storage.md ("Streams"); every decoder checks lengths and checksums and returns an
//! error, never panics, on bytes it did not write.

/// Segment data file magic.
pub const SEGMENT_MAGIC: &[u8; 8] = b"WARRENSD";
/// Segment index file magic.
pub const INDEX_MAGIC: &[u8; 8] = b"WARRENSI";
pub const FORMAT_VERSION: u32 = 1;
/// Both files start with: magic (8), version u32, reserved u32, the segment's first offset u64.
pub const FILE_HEADER: usize = 24;

pub const CHUNK_MAGIC: &[u8; 4] = b"WSCK";
pub const CHUNK_VERSION: u8 = 1;
pub const CHUNK_HEADER: usize = 48;
pub const INDEX_ENTRY: usize = 32;

/// Messages per chunk: the stream protocol's chunk header counts entries in a u16, so a chunk
/// of at most this many messages can go to a stream client as it is.
pub const MAX_CHUNK_MESSAGES: usize = u16::MAX as usize;
/// Data plus trailer of one chunk. Bounds what a reader allocates for a header it trusts.
pub const MAX_CHUNK_BODY: u64 = 256 << 20;
/// A message length prefix is the stream protocol's "simple entry": the top bit says "sub
/// batch" (never written here), the other 31 bits the length.
pub const MAX_MESSAGE: usize = 0x7FFF_FFFF;
/// Tracking names (publisher and consumer references; RabbitMQ allows 256 characters).
pub const MAX_NAME: usize = 1024;

/// Index entry flag: the chunk carries a trailer (publisher sequences, a filter).
pub const FLAG_TRAILER: u8 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ChunkType {
    /// Messages (count >= 1), optionally with a trailer of publisher sequences.
    User = 0,
    /// Tracking entries changed since the last snapshot (count 0: consumes no offset).
    TrackingDelta = 1,
    /// The whole tracking state, first chunk of every segment (count 0).
    TrackingSnapshot = 2,
}

impl ChunkType {
    pub fn from_u8(b: u8) -> Option<ChunkType> {
        match b {
            0 => Some(ChunkType::User),
            1 => Some(ChunkType::TrackingDelta),
            2 => Some(ChunkType::TrackingSnapshot),
            _ => None,
        }
    }
}

/// What one tracking entry records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum TrackingKind {
    /// Publisher reference -> the last publishing id stored (deduplication).
    Publisher = 1,
    /// Consumer reference -> its stored offset (server-side offset tracking).
    Consumer = 2,
    /// In a user chunk's trailer only: the Bloom filter of its messages' filter values (the
    /// "name") and flags (the value; `bloom.rs`). Not tracking state: replay skips it.
    Filter = 3,
}

impl TrackingKind {
    pub fn from_u8(b: u8) -> Option<TrackingKind> {
        match b {
            1 => Some(TrackingKind::Publisher),
            2 => Some(TrackingKind::Consumer),
            3 => Some(TrackingKind::Filter),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHeader {
    pub kind: ChunkType,
    pub first_offset: u64,
    /// Entries in the data section (user chunks; 0 for tracking chunks). Today every entry
    /// is one message; the stream protocol's sub-batch entries (several records, possibly
    /// compressed, in one entry) would make it smaller than `count`, as osiris's
    /// `num_entries` / `num_records`.
    pub entries: u16,
    /// Messages (records): offsets this chunk consumes (0 for tracking chunks).
    pub count: u32,
    pub data_len: u32,
    pub trailer_len: u32,
    pub timestamp: u64,
    /// CRC-32 (IEEE) of the data section: the stream protocol's `ChunkCrc`.
    pub data_crc: u32,
    pub trailer_crc: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("short: {0} bytes")]
    Short(usize),
    #[error("bad magic or version")]
    Magic,
    #[error("header checksum mismatch")]
    HeaderCrc,
    #[error("unknown chunk type {0}")]
    Type(u8),
    #[error("message count {0} invalid for its chunk type")]
    Count(u32),
    #[error("chunk body of {0} bytes is over the limit")]
    TooLarge(u64),
    #[error("data checksum mismatch")]
    DataCrc,
    #[error("trailer checksum mismatch")]
    TrailerCrc,
    #[error("malformed entry at byte {0}")]
    Entry(usize),
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl ChunkHeader {
    /// Header plus data plus trailer.
    pub fn total_len(&self) -> u64 {
        CHUNK_HEADER as u64 + u64::from(self.data_len) + u64::from(self.trailer_len)
    }

    /// The offset after this chunk's messages.
    pub fn next_offset(&self) -> u64 {
        self.first_offset.saturating_add(u64::from(self.count))
    }

    pub fn encode(&self) -> [u8; CHUNK_HEADER] {
        let mut h = [0u8; CHUNK_HEADER];
        h[0..4].copy_from_slice(CHUNK_MAGIC);
        h[4] = CHUNK_VERSION;
        h[5] = self.kind as u8;
        h[6..8].copy_from_slice(&self.entries.to_le_bytes());
        h[8..16].copy_from_slice(&self.first_offset.to_le_bytes());
        h[16..20].copy_from_slice(&self.count.to_le_bytes());
        h[20..24].copy_from_slice(&self.data_len.to_le_bytes());
        h[24..28].copy_from_slice(&self.trailer_len.to_le_bytes());
        h[28..36].copy_from_slice(&self.timestamp.to_le_bytes());
        h[36..40].copy_from_slice(&self.data_crc.to_le_bytes());
        h[40..44].copy_from_slice(&self.trailer_crc.to_le_bytes());
        let crc = crc32fast::hash(&h[..44]);
        h[44..48].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Decodes and checks a header (magic, version, its own CRC, type, count, sizes).
    pub fn decode(h: &[u8]) -> Result<ChunkHeader, FormatError> {
        if h.len() < CHUNK_HEADER {
            return Err(FormatError::Short(h.len()));
        }
        if &h[0..4] != CHUNK_MAGIC || h[4] != CHUNK_VERSION {
            return Err(FormatError::Magic);
        }
        if crc32fast::hash(&h[..44]) != u32_at(h, 44) {
            return Err(FormatError::HeaderCrc);
        }
        let kind = ChunkType::from_u8(h[5]).ok_or(FormatError::Type(h[5]))?;
        let header = ChunkHeader {
            kind,
            entries: u16::from_le_bytes([h[6], h[7]]),
            first_offset: u64_at(h, 8),
            count: u32_at(h, 16),
            data_len: u32_at(h, 20),
            trailer_len: u32_at(h, 24),
            timestamp: u64_at(h, 28),
            data_crc: u32_at(h, 36),
            trailer_crc: u32_at(h, 40),
        };
        let count_ok = match kind {
            ChunkType::User => header.entries >= 1 && u32::from(header.entries) <= header.count,
            _ => header.count == 0 && header.entries == 0,
        };
        if !count_ok {
            return Err(FormatError::Count(header.count));
        }
        let body = header.total_len() - CHUNK_HEADER as u64;
        if body > MAX_CHUNK_BODY {
            return Err(FormatError::TooLarge(body));
        }
        Ok(header)
    }

    /// Checks data and trailer against the header's CRCs (`body` = data then trailer).
    pub fn verify_body(&self, body: &[u8]) -> Result<(), FormatError> {
        let d = self.data_len as usize;
        if body.len() < d + self.trailer_len as usize {
            return Err(FormatError::Short(body.len()));
        }
        if crc32fast::hash(&body[..d]) != self.data_crc {
            return Err(FormatError::DataCrc);
        }
        if crc32fast::hash(&body[d..d + self.trailer_len as usize]) != self.trailer_crc {
            return Err(FormatError::TrailerCrc);
        }
        Ok(())
    }
}

/// Segment and index file header.
pub fn file_header(magic: &[u8; 8], first_offset: u64) -> [u8; FILE_HEADER] {
    let mut h = [0u8; FILE_HEADER];
    h[0..8].copy_from_slice(magic);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&first_offset.to_le_bytes());
    h
}

/// The first offset a file header names, if it is a header of this kind and version.
pub fn decode_file_header(magic: &[u8; 8], h: &[u8]) -> Option<u64> {
    if h.len() < FILE_HEADER || &h[0..8] != magic || u32_at(h, 8) != FORMAT_VERSION {
        return None;
    }
    Some(u64_at(h, 16))
}

/// One index entry: where a chunk is and what it starts with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    pub first_offset: u64,
    pub timestamp: u64,
    /// Byte position of the chunk header in the segment file.
    pub position: u64,
    pub count: u32,
    pub kind: ChunkType,
    pub flags: u8,
}

impl IndexEntry {
    pub fn of(header: &ChunkHeader, position: u64) -> IndexEntry {
        IndexEntry {
            first_offset: header.first_offset,
            timestamp: header.timestamp,
            position,
            count: header.count,
            kind: header.kind,
            flags: if header.trailer_len > 0 {
                FLAG_TRAILER
            } else {
                0
            },
        }
    }

    pub fn encode(&self) -> [u8; INDEX_ENTRY] {
        let mut e = [0u8; INDEX_ENTRY];
        e[0..8].copy_from_slice(&self.first_offset.to_le_bytes());
        e[8..16].copy_from_slice(&self.timestamp.to_le_bytes());
        e[16..24].copy_from_slice(&self.position.to_le_bytes());
        e[24..28].copy_from_slice(&self.count.to_le_bytes());
        e[28] = self.kind as u8;
        e[29] = self.flags;
        e
    }

    pub fn decode(e: &[u8]) -> Option<IndexEntry> {
        if e.len() < INDEX_ENTRY {
            return None;
        }
        Some(IndexEntry {
            first_offset: u64_at(e, 0),
            timestamp: u64_at(e, 8),
            position: u64_at(e, 16),
            count: u32_at(e, 24),
            kind: ChunkType::from_u8(e[28])?,
            flags: e[29],
        })
    }

    /// Whether the chunk changes the tracking state (a tracking chunk, or a user chunk with
    /// publisher sequences in its trailer).
    pub fn tracks(&self) -> bool {
        self.kind != ChunkType::User || self.flags & FLAG_TRAILER != 0
    }
}

/// Appends a message entry: u32 big-endian length (top bit 0), then the bytes. Big-endian
/// because this is the stream protocol's simple entry, so the data section can be sent to
/// a stream client as it is on disk.
pub fn put_message(out: &mut Vec<u8>, m: &[u8]) {
    out.extend_from_slice(&(m.len() as u32).to_be_bytes());
    out.extend_from_slice(m);
}

/// The messages of a data section, in order; an error for a sub-batch entry or a length past
/// the end.
pub struct Messages<'a> {
    data: &'a [u8],
    at: usize,
}

pub fn messages(data: &[u8]) -> Messages<'_> {
    Messages { data, at: 0 }
}

impl<'a> Iterator for Messages<'a> {
    type Item = Result<&'a [u8], FormatError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.data.len() {
            return None;
        }
        let at = self.at;
        let Some(len) = self.data.get(at..at + 4) else {
            self.at = self.data.len();
            return Some(Err(FormatError::Entry(at)));
        };
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]);
        if len & 0x8000_0000 != 0 {
            self.at = self.data.len();
            return Some(Err(FormatError::Entry(at)));
        }
        let end = at + 4 + len as usize;
        match self.data.get(at + 4..end) {
            Some(m) => {
                self.at = end;
                Some(Ok(m))
            }
            None => {
                self.at = self.data.len();
                Some(Err(FormatError::Entry(at)))
            }
        }
    }
}

/// Appends a tracking entry: kind u8, name length u16, name, value u64.
pub fn put_tracking(out: &mut Vec<u8>, kind: TrackingKind, name: &[u8], value: u64) {
    out.push(kind as u8);
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(name);
    out.extend_from_slice(&value.to_le_bytes());
}

pub fn tracking_entry_len(name: &[u8]) -> usize {
    1 + 2 + name.len() + 8
}

/// Decodes tracking entries (a tracking chunk's data, or a user chunk's trailer).
pub fn tracking_entries(
    mut b: &[u8],
) -> impl Iterator<Item = Result<(TrackingKind, &[u8], u64), FormatError>> {
    let total = b.len();
    std::iter::from_fn(move || {
        if b.is_empty() {
            return None;
        }
        let at = total - b.len();
        let parsed = (|| {
            let kind = TrackingKind::from_u8(*b.first()?)?;
            let n = u16::from_le_bytes([*b.get(1)?, *b.get(2)?]) as usize;
            let name = b.get(3..3 + n)?;
            let value = u64::from_le_bytes(b.get(3 + n..11 + n)?.try_into().ok()?);
            Some((kind, name, value, 11 + n))
        })();
        match parsed {
            Some((kind, name, value, used)) => {
                b = &b[used..];
                Some(Ok((kind, name, value)))
            }
            None => {
                b = &[];
                Some(Err(FormatError::Entry(at)))
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_detects_any_flipped_bit() {
        let h = ChunkHeader {
            kind: ChunkType::User,
            entries: 3,
            first_offset: 42,
            count: 3,
            data_len: 100,
            trailer_len: 11,
            timestamp: 1_700_000_000_000,
            data_crc: 7,
            trailer_crc: 9,
        };
        let b = h.encode();
        assert_eq!(ChunkHeader::decode(&b), Ok(h));
        for i in 0..CHUNK_HEADER * 8 {
            let mut c = b;
            c[i / 8] ^= 1 << (i % 8);
            assert!(ChunkHeader::decode(&c).is_err(), "bit {i}");
        }
        assert_eq!(ChunkHeader::decode(&b[..47]), Err(FormatError::Short(47)));
    }

    #[test]
    fn messages_and_tracking_entries_round_trip_and_reject_garbage() {
        let mut d = Vec::new();
        put_message(&mut d, b"a");
        put_message(&mut d, b"");
        put_message(&mut d, b"hello");
        let got: Vec<_> = messages(&d).collect::<Result<_, _>>().unwrap();
        assert_eq!(got, vec![&b"a"[..], b"", b"hello"]);
        assert!(messages(&d[..d.len() - 1]).any(|m| m.is_err()));
        let mut sub = vec![0x80, 0, 0, 0];
        sub.extend_from_slice(&d);
        assert!(messages(&sub).next().unwrap().is_err());

        let mut t = Vec::new();
        put_tracking(&mut t, TrackingKind::Publisher, b"p", 5);
        put_tracking(&mut t, TrackingKind::Consumer, b"c1", u64::MAX);
        let got: Vec<_> = tracking_entries(&t).collect::<Result<_, _>>().unwrap();
        assert_eq!(
            got,
            vec![
                (TrackingKind::Publisher, &b"p"[..], 5),
                (TrackingKind::Consumer, &b"c1"[..], u64::MAX)
            ]
        );
        for cut in 1..t.len() {
            if cut == tracking_entry_len(b"p") {
                continue;
            }
            assert!(tracking_entries(&t[..cut]).any(|e| e.is_err()), "cut {cut}");
        }
        t[0] = 9;
        assert!(tracking_entries(&t).next().unwrap().is_err());
    }
}
