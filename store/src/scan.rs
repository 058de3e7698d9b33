//! Walking a file of framed records (`len u32 | crc32(payload) u32 | payload`, the framing of
//! segment data files, shared body files and journal generations) and telling a tear from
//! corruption (docs/storage.md, "Recovery: tears and corruption").
//!
//! A record that fails (its length impossible, its checksum wrong, its payload not what the
//! file holds) is either the start of a torn tail or damage in the middle. The walk looks for
//! the next valid record after it (resynchronisation): if there is one, the bytes in between
//! are corruption, skipped and reported, and everything after is kept; if there is none, the
//! rest of the file is a tail (a tear: the caller may cut it). So data followed by a valid
//! record is never cut.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;

/// What a file's records look like.
pub(crate) struct Framing {
    /// Bounds of a payload's length.
    pub min_payload: usize,
    pub max_payload: usize,
    /// Whether the first bytes of a payload (up to `PREFIX`, fewer if the payload is shorter)
    /// can start a record of this file: checked before the CRC, so resynchronising over a
    /// damaged region costs a few comparisons per byte, not a checksum.
    pub plausible: fn(&[u8]) -> bool,
}

/// Payload bytes handed to `Framing::plausible` and kept per record.
pub(crate) const PREFIX: usize = 16;
const FRAME: u64 = 8;
/// Bytes read at once while verifying or resynchronising.
const CHUNK: usize = 1 << 20;

/// A valid record.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rec {
    pub offset: u64,
    /// Framed length (8 + payload).
    pub len: u64,
    /// The payload's first bytes (zero-padded).
    pub prefix: [u8; PREFIX],
}

/// What a walk found.
#[derive(Debug, Default)]
pub(crate) struct Scanned {
    pub records: Vec<Rec>,
    /// Damaged regions followed by a valid record: corruption, skipped.
    pub damaged: Vec<Range<u64>>,
    /// Where a tail without any valid record starts (a tear), if the file has one.
    pub tail: Option<u64>,
    /// Whether checksums were verified (a header-only walk that met an inconsistency
    /// verifies the whole file instead).
    pub verified: bool,
}

/// A read window over a file: sequential walks cost one `pread` per `CHUNK`.
struct Window<'a> {
    file: &'a File,
    len: u64,
    start: u64,
    buf: Vec<u8>,
    chunk: usize,
}

impl Window<'_> {
    /// `n` bytes at `at` (fewer at the end of the file).
    fn get(&mut self, at: u64, n: usize) -> io::Result<&[u8]> {
        let end = (at + n as u64).min(self.len);
        let have = at >= self.start && end <= self.start + self.buf.len() as u64;
        if !have {
            let want = (end - at).max(self.chunk as u64).min(self.len - at) as usize;
            self.buf.resize(want, 0);
            self.file.read_exact_at(&mut self.buf, at)?;
            self.start = at;
        }
        let from = (at - self.start) as usize;
        Ok(&self.buf[from..from + (end - at) as usize])
    }
}

/// Walks `file` from `from` to `file_len`. Without `verify`, only frames are read (one
/// small read per record) and checksums are left to the reader; the first inconsistency
/// (an impossible frame, or one that does not end exactly at the end of the file) makes it
/// walk the whole file again verifying every checksum, resynchronising past damage.
pub(crate) fn scan(
    file: &File,
    from: u64,
    file_len: u64,
    framing: &Framing,
    verify: bool,
) -> io::Result<Scanned> {
    let mut w = Window {
        file,
        len: file_len,
        start: 0,
        buf: Vec::new(),
        chunk: if verify {
            CHUNK
        } else {
            FRAME as usize + PREFIX
        },
    };
    let mut out = Scanned {
        verified: verify,
        ..Scanned::default()
    };
    let mut at = from;
    while at < file_len {
        if let Some(rec) = record_at(&mut w, at, framing, verify)? {
            out.records.push(rec);
            at += rec.len;
            continue;
        }
        if !verify {
            return scan(file, from, file_len, framing, true);
        }
        match resync(&mut w, at + 1, framing)? {
            Some(next) => {
                out.damaged.push(at..next);
                at = next;
            }
            None => {
                out.tail = Some(at);
                break;
            }
        }
    }
    Ok(out)
}

/// The valid record at `at`, if there is one (its checksum checked when `verify`).
fn record_at(
    w: &mut Window<'_>,
    at: u64,
    framing: &Framing,
    verify: bool,
) -> io::Result<Option<Rec>> {
    let file_len = w.len;
    if at + FRAME > file_len {
        return Ok(None);
    }
    let head = w.get(at, FRAME as usize + PREFIX)?;
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    if len < framing.min_payload
        || len > framing.max_payload
        || at + FRAME + len as u64 > file_len
        || (len == 0 && crc == 0)
    {
        return Ok(None);
    }
    let mut prefix = [0u8; PREFIX];
    let shown = len.min(PREFIX).min(head.len() - FRAME as usize);
    prefix[..shown].copy_from_slice(&head[FRAME as usize..FRAME as usize + shown]);
    if !(framing.plausible)(&prefix[..len.min(PREFIX)]) {
        return Ok(None);
    }
    if verify {
        let payload = w.get(at + FRAME, len)?;
        if crc32fast::hash(payload) != crc {
            return Ok(None);
        }
    }
    Ok(Some(Rec {
        offset: at,
        len: FRAME + len as u64,
        prefix,
    }))
}

/// The offset of the first valid record at or after `from`, if any.
fn resync(w: &mut Window<'_>, from: u64, framing: &Framing) -> io::Result<Option<u64>> {
    let mut at = from;
    while at + FRAME <= w.len {
        if record_at(w, at, framing, true)?.is_some() {
            return Ok(Some(at));
        }
        at += 1;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const ANY: Framing = Framing {
        min_payload: 1,
        max_payload: 1 << 20,
        plausible: |p| p.first() == Some(&0xAB),
    };

    fn framed(payload: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        out.extend_from_slice(payload);
    }

    fn file_of(bytes: &[u8], tag: &str) -> (File, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!("warren-scan-{tag}-{}", std::process::id()));
        let mut f = File::create(&path).expect("create");
        f.write_all(bytes).expect("write");
        (File::open(&path).expect("open"), path)
    }

    fn records(n: usize) -> (Vec<u8>, Vec<u64>) {
        let mut bytes = Vec::new();
        let mut offsets = Vec::new();
        for i in 0..n {
            offsets.push(bytes.len() as u64);
            let mut p = vec![0xAB];
            p.extend(std::iter::repeat_n(i as u8, 100 + i));
            framed(&p, &mut bytes);
        }
        (bytes, offsets)
    }

    #[test]
    fn damage_in_the_middle_is_skipped_and_a_tail_is_a_tear() {
        let (mut bytes, offsets) = records(10);
        // A flipped byte in record 4's payload, and record 7's length.
        bytes[offsets[4] as usize + 20] ^= 0xFF;
        bytes[offsets[7] as usize] ^= 0x01;
        let good_len = bytes.len() as u64;
        bytes.extend_from_slice(&[1, 2, 3, 0, 0, 9]);
        let (f, path) = file_of(&bytes, "mid");
        for verify in [false, true] {
            let s = scan(&f, 0, bytes.len() as u64, &ANY, verify).expect("scan");
            assert!(s.verified);
            let kept: Vec<u64> = s.records.iter().map(|r| r.offset).collect();
            let expected: Vec<u64> = offsets
                .iter()
                .copied()
                .enumerate()
                .filter(|(i, _)| *i != 4 && *i != 7)
                .map(|(_, o)| o)
                .collect();
            assert_eq!(kept, expected);
            assert_eq!(
                s.damaged,
                vec![offsets[4]..offsets[5], offsets[7]..offsets[8]]
            );
            assert_eq!(s.tail, Some(good_len));
        }
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn an_intact_file_is_walked_by_its_frames_only() {
        let (bytes, offsets) = records(5);
        let (f, path) = file_of(&bytes, "intact");
        let s = scan(&f, 0, bytes.len() as u64, &ANY, false).expect("scan");
        assert!(!s.verified);
        assert_eq!(s.records.len(), offsets.len());
        assert!(s.damaged.is_empty() && s.tail.is_none());
        let _ = std::fs::remove_file(path);
    }
}
