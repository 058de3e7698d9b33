//! Reading a stream: whole committed chunks from a position, with read-ahead (RabbitMQ 4.2's
//! stream read-ahead, seed 003).
//!
//! Without read-ahead a chunk costs two `pread`s (its header, then its data). With it, the
//! header read asks for `read_ahead` bytes (4096 by default), and every following chunk that
//! lies whole inside those bytes is served from them: a stream of small chunks costs one
//! system call per `read_ahead` bytes instead of two per chunk. A chunk that does not fit is
//! large; with `ranges_from` (and at least that big) it is handed out as a (file, offset, length) range so a socket shell
//! can `sendfile`/`splice` it without copying it through user space; without, it is read
//! together with the next chunk's header in one call (one call per large chunk). As in
//! RabbitMQ 4.2, reading ahead follows a small chunk only: reading `read_ahead` bytes past
//! every large chunk read (and zeroed, and copied) the first 4 KiB of the next large chunk
//! twice, 25% more bytes for 16 KiB chunks.

use super::bloom::ChunkFilter;
use super::format::{
    self, CHUNK_HEADER, ChunkHeader, ChunkType, FILE_HEADER, FormatError, TrackingKind,
};
use super::{Shared, StreamError, StreamRead, data_path};
use bytes::{Bytes, BytesMut};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Chunks a filtered reader passes over in one `next_chunk` call before it returns `None`
/// as if caught up (its position moved; the caller reads again), so one call is bounded.
const MAX_SKIPPED: usize = 10_000;

/// How a reader reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReaderOptions {
    /// Bytes read ahead at each header read (RabbitMQ: 4096); 0 = off.
    pub read_ahead: usize,
    /// `Some(min)`: chunks whose messages section is at least `min` bytes and not within
    /// the read-ahead bytes come as [`ChunkData::File`] ranges instead of being read into
    /// memory (for a shell that can send file ranges to its socket: below a few pages the
    /// extra system call per chunk costs more than the copy it saves). `None`: never.
    pub ranges_from: Option<u32>,
}

impl Default for ReaderOptions {
    fn default() -> ReaderOptions {
        ReaderOptions {
            read_ahead: 4096,
            ranges_from: None,
        }
    }
}

/// A chunk's messages section.
#[derive(Clone, Debug)]
pub enum ChunkData {
    /// In memory, checked against the chunk's CRC.
    Bytes(Bytes),
    /// In the segment file at `offset`, `len` bytes (not checked: the stream protocol's
    /// clients check the CRC sent with the chunk).
    File {
        file: Arc<File>,
        offset: u64,
        len: u32,
    },
}

/// One user chunk as read.
#[derive(Clone, Debug)]
pub struct ReadChunk {
    pub first_offset: u64,
    /// Entries in the data section (the stream protocol's `NumEntries`).
    pub entries: u16,
    /// Messages (`NumRecords`).
    pub count: u32,
    pub timestamp: u64,
    /// CRC-32 of the data: the stream protocol's `ChunkCrc`.
    pub data_crc: u32,
    pub data: ChunkData,
}

impl ReadChunk {
    /// Length of the messages section: with `first_offset`, `count`, `timestamp` and
    /// `data_crc`, what a stream protocol `Deliver` chunk header needs.
    pub fn data_len(&self) -> u32 {
        match &self.data {
            ChunkData::Bytes(b) => b.len() as u32,
            ChunkData::File { len, .. } => *len,
        }
    }

    /// The data in memory (a `File` range is read with one `pread` and checked).
    pub fn bytes(&self) -> io::Result<Bytes> {
        match &self.data {
            ChunkData::Bytes(b) => Ok(b.clone()),
            ChunkData::File { file, offset, len } => {
                let mut b = vec![0u8; *len as usize];
                file.read_exact_at(&mut b, *offset)?;
                if crc32fast::hash(&b) != self.data_crc {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "stream chunk data checksum mismatch",
                    ));
                }
                Ok(Bytes::from(b))
            }
        }
    }

    /// The chunk's messages, in offset order, as slices of `data` (from [`ReadChunk::bytes`]).
    /// Simple entries only: [`ReadChunk::records`] reads sub-batches too.
    pub fn messages(data: &Bytes) -> impl Iterator<Item = Result<Bytes, FormatError>> + '_ {
        format::messages(data).map(|m| m.map(|m| data.slice_ref(m)))
    }

    /// The chunk's records, in offset order: its messages, and the records of its sub-batch
    /// entries (uncompressed: slices of `data`; gzip: inflated).
    pub fn records(data: &Bytes) -> super::sub_batch::Records<'_> {
        super::sub_batch::Records::new(data)
    }
}

/// See the module docs. Reads only what the writer's last `sync` committed.
pub struct StreamReader {
    shared: Arc<Shared>,
    options: ReaderOptions,
    segment: u64,
    file: Option<Arc<File>>,
    /// File position of the next chunk header.
    pos: u64,
    /// First offset of the next chunk.
    next_offset: u64,
    start_offset: u64,
    /// The writer's committed offset when last looked at.
    committed: u64,
    /// Bytes read ahead, from file position `buf_at`.
    buf: Bytes,
    buf_at: u64,
    syscalls: u64,
    bytes_read: u64,
    /// Stream filtering: only chunks that may hold a wanted message (`set_filter`).
    filter: Option<ChunkFilter>,
}

impl StreamReader {
    pub(super) fn new(
        shared: Arc<Shared>,
        options: ReaderOptions,
        segment: u64,
        pos: u64,
        next_offset: u64,
        start_offset: u64,
    ) -> StreamReader {
        StreamReader {
            shared,
            options,
            segment,
            file: None,
            pos,
            next_offset,
            start_offset,
            committed: 0,
            buf: Bytes::new(),
            buf_at: 0,
            syscalls: 0,
            bytes_read: 0,
            filter: None,
        }
    }

    /// From now on, skips chunks whose stored Bloom filter says they hold none of the
    /// filter's values (and, unless it matches unfiltered messages, chunks without one).
    pub fn set_filter(&mut self, filter: Option<ChunkFilter>) {
        self.filter = filter;
    }

    /// Whether the user chunk `h` at `self.pos` may hold a message `filter` wants: its
    /// trailer's filter entry (read from the read-ahead bytes, or with one `pread`, and
    /// checked against the trailer CRC).
    fn wanted(&mut self, file: &File, h: &ChunkHeader) -> Result<bool, StreamError> {
        let stored = if h.trailer_len == 0 {
            None
        } else {
            let at = self.pos + CHUNK_HEADER as u64 + u64::from(h.data_len);
            let len = u64::from(h.trailer_len);
            let trailer = match self.buffered(at, len) {
                Some(t) => t,
                None => {
                    let t = self.pread(file, at, len as usize)?;
                    if t.len() as u64 != len {
                        return Err(self.corrupt(self.pos, "short chunk trailer"));
                    }
                    t
                }
            };
            if crc32fast::hash(&trailer) != h.trailer_crc {
                return Err(self.corrupt(self.pos, FormatError::TrailerCrc));
            }
            let mut found = None;
            for e in format::tracking_entries(&trailer) {
                let (kind, bits, flags) = e.map_err(|e| self.corrupt(self.pos, e))?;
                if kind == TrackingKind::Filter {
                    found = Some((bits.to_vec(), flags));
                }
            }
            found
        };
        Ok(self
            .filter
            .as_ref()
            .is_none_or(|f| f.matches(stored.as_ref().map(|(b, flags)| (&b[..], *flags)))))
    }

    /// The offset the reader was asked for (after clamping): chunks are whole, so the first
    /// one may start below it; the caller skips those messages.
    pub fn start_offset(&self) -> u64 {
        self.start_offset
    }

    /// First offset of the next chunk to read.
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }

    /// `pread` calls made so far.
    pub fn syscalls(&self) -> u64 {
        self.syscalls
    }

    /// Bytes those calls read.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    fn path(&self) -> PathBuf {
        data_path(&self.shared.dir, self.segment)
    }

    fn corrupt(&self, pos: u64, reason: impl ToString) -> StreamError {
        StreamError::Corrupt {
            path: self.path(),
            pos,
            reason: reason.to_string(),
        }
    }

    /// The segment file, opened on first use; a segment deleted by retention meanwhile sends
    /// the reader to the oldest one left (its messages are gone).
    fn file(&mut self) -> Result<Arc<File>, StreamError> {
        loop {
            if let Some(f) = &self.file {
                return Ok(f.clone());
            }
            match File::open(self.path()) {
                Ok(f) => {
                    let f = Arc::new(f);
                    self.file = Some(f.clone());
                    return Ok(f);
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    let segments = self.shared.segments();
                    match segments.first() {
                        Some(&first) if first > self.segment => self.jump(first),
                        _ => {
                            return Err(StreamError::Io {
                                path: self.path(),
                                source: e,
                            });
                        }
                    }
                }
                Err(e) => {
                    return Err(StreamError::Io {
                        path: self.path(),
                        source: e,
                    });
                }
            }
        }
    }

    fn jump(&mut self, segment: u64) {
        self.segment = segment;
        self.file = None;
        self.pos = FILE_HEADER as u64;
        self.next_offset = self.next_offset.max(segment);
        self.buf = Bytes::new();
    }

    /// One `pread` of up to `len` bytes at `at` (one call: a short count means end of file).
    fn pread(&mut self, file: &File, at: u64, len: usize) -> Result<Bytes, StreamError> {
        let mut b = BytesMut::zeroed(len);
        self.syscalls += 1;
        let n = loop {
            match file.read_at(&mut b, at) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(StreamError::Io {
                        path: self.path(),
                        source: e,
                    });
                }
            }
        };
        b.truncate(n);
        self.bytes_read += n as u64;
        Ok(b.freeze())
    }

    /// Where `len` bytes at file position `at` are in the read-ahead buffer, if it holds them.
    fn buffered_range(&self, at: u64, len: u64) -> Option<std::ops::Range<usize>> {
        let start = at.checked_sub(self.buf_at)?;
        let end = start.checked_add(len)?;
        (end <= self.buf.len() as u64).then_some(start as usize..end as usize)
    }

    fn buffered(&self, at: u64, len: u64) -> Option<Bytes> {
        self.buffered_range(at, len).map(|r| self.buf.slice(r))
    }

    /// The header at `pos`; `None` at the end of the segment file.
    fn header(&mut self, file: &File) -> Result<Option<ChunkHeader>, StreamError> {
        let h = match self.buffered_range(self.pos, CHUNK_HEADER as u64) {
            Some(h) => h,
            None => {
                let len = self.options.read_ahead.max(CHUNK_HEADER);
                let b = self.pread(file, self.pos, len)?;
                if b.is_empty() {
                    return Ok(None);
                }
                self.buf = b;
                self.buf_at = self.pos;
                match self.buffered_range(self.pos, CHUNK_HEADER as u64) {
                    Some(h) => h,
                    None => return Err(self.corrupt(self.pos, "short chunk header")),
                }
            }
        };
        ChunkHeader::decode(&self.buf[h])
            .map(Some)
            .map_err(|e| self.corrupt(self.pos, e))
    }

    fn data(&mut self, file: &Arc<File>, h: &ChunkHeader) -> Result<ChunkData, StreamError> {
        let at = self.pos + CHUNK_HEADER as u64;
        let len = u64::from(h.data_len);
        let data = match self.buffered(at, len) {
            Some(d) => d,
            None if self
                .options
                .ranges_from
                .is_some_and(|min| h.data_len >= min) =>
            {
                return Ok(ChunkData::File {
                    file: file.clone(),
                    offset: at,
                    len: h.data_len,
                });
            }
            None if self.options.read_ahead > 0 => {
                // Read it anyway: from its header, with the next chunk's header in the same
                // call (one call per large chunk instead of a data read plus a header read).
                // Not the read-ahead: after a large chunk the next is likely large too, and
                // the bytes past its header would be read again with it.
                let want = h.total_len() + CHUNK_HEADER as u64;
                self.buf = self.pread(file, self.pos, want as usize)?;
                self.buf_at = self.pos;
                match self.buffered(at, len) {
                    Some(d) => d,
                    None => return Err(self.corrupt(self.pos, "short chunk data")),
                }
            }
            None => {
                let d = self.pread(file, at, len as usize)?;
                if d.len() as u64 != len {
                    return Err(self.corrupt(self.pos, "short chunk data"));
                }
                d
            }
        };
        if crc32fast::hash(&data) != h.data_crc {
            return Err(self.corrupt(self.pos, FormatError::DataCrc));
        }
        Ok(ChunkData::Bytes(data))
    }

    /// Past the end of a segment: on to the next one (the one starting at `next_offset`, or
    /// the next left if retention took some).
    fn next_segment(&mut self) -> Result<(), StreamError> {
        let segments = self.shared.segments();
        match segments.iter().find(|&&s| s > self.segment) {
            Some(&s) => {
                self.jump(s);
                Ok(())
            }
            None => Err(self.corrupt(
                self.pos,
                format!(
                    "segment ends before committed offset {}",
                    self.shared.committed.load(Ordering::Acquire)
                ),
            )),
        }
    }

    /// The next committed user chunk; `None` once the reader has caught up with `sync`.
    pub fn next_chunk(&mut self) -> Result<Option<ReadChunk>, StreamError> {
        let mut skipped = 0;
        loop {
            if self.next_offset >= self.committed {
                // Only then look at the writer's progress (one shared cache line less per
                // chunk while there is a backlog).
                self.committed = self.shared.committed.load(Ordering::Acquire);
                if self.next_offset >= self.committed {
                    return Ok(None);
                }
            }
            let file = self.file()?;
            let Some(h) = self.header(&file)? else {
                self.next_segment()?;
                continue;
            };
            if h.first_offset != self.next_offset {
                return Err(self.corrupt(
                    self.pos,
                    format!(
                        "chunk offset {} where {} was due",
                        h.first_offset, self.next_offset
                    ),
                ));
            }
            if h.kind != ChunkType::User {
                self.pos += h.total_len();
                continue;
            }
            if self.filter.is_some() && !self.wanted(&file, &h)? {
                self.pos += h.total_len();
                self.next_offset = h.next_offset();
                skipped += 1;
                if skipped >= MAX_SKIPPED {
                    return Ok(None);
                }
                continue;
            }
            let data = self.data(&file, &h)?;
            self.pos += h.total_len();
            self.next_offset = h.next_offset();
            return Ok(Some(ReadChunk {
                first_offset: h.first_offset,
                entries: h.entries,
                count: h.count,
                timestamp: h.timestamp,
                data_crc: h.data_crc,
                data,
            }));
        }
    }
}

impl StreamRead for StreamReader {
    fn next_chunk(&mut self) -> Result<Option<ReadChunk>, StreamError> {
        StreamReader::next_chunk(self)
    }
}
