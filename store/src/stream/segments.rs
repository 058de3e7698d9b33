//! A stream's segment files: created, opened, checked and recovered after a crash (a torn tail
//! cut at the last whole chunk), and chunks read back by position.

use super::*;

/// A batch's data section length, if it can be one chunk's messages.
pub(super) fn check_batch<M: AsRef<[u8]>>(messages: &[M]) -> Result<u64, StreamError> {
    check_batch_iter(messages.iter().map(|m| m.as_ref())).map(|(_, len)| len)
}

/// `check_batch_iter`'s bounds on a batch's known count and data-section bytes.
pub(super) fn check_sizes(count: usize, data_len: u64) -> Result<(usize, u64), StreamError> {
    if count == 0 || count > MAX_CHUNK_MESSAGES {
        return Err(StreamError::Invalid(format!(
            "a chunk holds 1 to {MAX_CHUNK_MESSAGES} messages, not {count}"
        )));
    }
    if data_len > MAX_CHUNK_BODY {
        return Err(StreamError::Invalid(format!(
            "a chunk of {data_len} bytes (limit {MAX_CHUNK_BODY})"
        )));
    }
    Ok((count, data_len))
}

/// The message count and data-section bytes of a batch, or why it cannot be one chunk.
pub(super) fn check_batch_iter<'m>(
    messages: impl Iterator<Item = &'m [u8]>,
) -> Result<(usize, u64), StreamError> {
    let mut count = 0usize;
    let mut data_len = 0u64;
    for m in messages {
        if m.len() > MAX_MESSAGE {
            return Err(StreamError::Invalid(format!(
                "a message of {} bytes",
                m.len()
            )));
        }
        count += 1;
        data_len += 4 + m.len() as u64;
    }
    if count == 0 || count > MAX_CHUNK_MESSAGES {
        return Err(StreamError::Invalid(format!(
            "a chunk holds 1 to {MAX_CHUNK_MESSAGES} messages, not {count}"
        )));
    }
    if data_len > MAX_CHUNK_BODY {
        return Err(StreamError::Invalid(format!(
            "a chunk of {data_len} bytes (limit {MAX_CHUNK_BODY})"
        )));
    }
    Ok((count, data_len))
}

pub(super) fn check_name(name: &str) -> Result<(), StreamError> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(StreamError::Invalid(format!(
            "a tracking name of {} bytes (1 to {MAX_NAME})",
            name.len()
        )));
    }
    Ok(())
}

pub(super) fn open_rw(path: &Path) -> Result<File, StreamError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io_err(path))
}

/// A new segment's files with their headers written (durable with the next sync's directory
/// and data fsync; the index header with the roll's).
pub(super) fn create_segment(dir: &Path, first: u64) -> Result<(Active, Segment), StreamError> {
    let dpath = data_path(dir, first);
    let ipath = index_path(dir, first);
    let data = open_rw(&dpath)?;
    let index = open_rw(&ipath)?;
    data.set_len(0).map_err(io_err(&dpath))?;
    index.set_len(0).map_err(io_err(&ipath))?;
    let header = FILE_HEADER as u64;
    let active = Active {
        data: Arc::new(data),
        index,
        data_written: 0,
        data_durable: 0,
        index_written: 0,
        buf: format::file_header(SEGMENT_MAGIC, first).to_vec(),
        ibuf: format::file_header(INDEX_MAGIC, first).to_vec(),
    };
    let seg = Segment {
        first_offset: first,
        next_offset: first,
        last_ts: 0,
        size: header,
        index_len: header,
    };
    Ok((active, seg))
}

pub(super) fn open_active(dir: &Path, seg: &Segment) -> Result<Active, StreamError> {
    Ok(Active {
        data: Arc::new(open_rw(&data_path(dir, seg.first_offset))?),
        index: open_rw(&index_path(dir, seg.first_offset))?,
        data_written: seg.size,
        // Made durable by `open`'s sync before anything is read as committed.
        data_durable: 0,
        index_written: seg.index_len,
        buf: Vec::new(),
        ibuf: Vec::new(),
    })
}

/// Reads and verifies the chunk at `pos`: header, then data and trailer.
pub(super) fn read_chunk_at(
    file: &File,
    path: &Path,
    pos: u64,
) -> Result<(ChunkHeader, Vec<u8>), StreamError> {
    let corrupt = |reason: String| StreamError::Corrupt {
        path: path.to_path_buf(),
        pos,
        reason,
    };
    let mut h = [0u8; CHUNK_HEADER];
    file.read_exact_at(&mut h, pos).map_err(io_err(path))?;
    let header = ChunkHeader::decode(&h).map_err(|e| corrupt(e.to_string()))?;
    let mut body = vec![0u8; (header.total_len() - CHUNK_HEADER as u64) as usize];
    file.read_exact_at(&mut body, pos + CHUNK_HEADER as u64)
        .map_err(io_err(path))?;
    header
        .verify_body(&body)
        .map_err(|e| corrupt(e.to_string()))?;
    Ok((header, body))
}

/// A segment before the newest: complete when it was rolled, so only its index is checked
/// (whole entries, the last one naming the last chunk, which ends the file). `None`: the
/// index must be rebuilt.
pub(super) fn check_segment(dir: &Path, first: u64) -> Result<Option<Segment>, StreamError> {
    let dpath = data_path(dir, first);
    let ipath = index_path(dir, first);
    let data = File::open(&dpath).map_err(io_err(&dpath))?;
    let size = data.metadata().map_err(io_err(&dpath))?.len();
    let Ok(index) = File::open(&ipath) else {
        return Ok(None);
    };
    let index_len = index.metadata().map_err(io_err(&ipath))?.len();
    let mut h = [0u8; FILE_HEADER];
    if index.read_exact_at(&mut h, 0).is_err()
        || format::decode_file_header(INDEX_MAGIC, &h) != Some(first)
        || index_len < (FILE_HEADER + INDEX_ENTRY) as u64
        || !(index_len - FILE_HEADER as u64).is_multiple_of(INDEX_ENTRY as u64)
    {
        return Ok(None);
    }
    let mut e = [0u8; INDEX_ENTRY];
    if index
        .read_exact_at(&mut e, index_len - INDEX_ENTRY as u64)
        .is_err()
    {
        return Ok(None);
    }
    let Some(last) = IndexEntry::decode(&e) else {
        return Ok(None);
    };
    let mut ch = [0u8; CHUNK_HEADER];
    if data.read_exact_at(&mut ch, last.position).is_err() {
        return Ok(None);
    }
    match ChunkHeader::decode(&ch) {
        Ok(header)
            if header.first_offset == last.first_offset
                && last.position + header.total_len() == size =>
        {
            Ok(Some(Segment {
                first_offset: first,
                next_offset: header.next_offset(),
                last_ts: header.timestamp,
                size,
                index_len,
            }))
        }
        _ => Ok(None),
    }
}

/// Verifies a segment chunk by chunk (header, offsets, CRCs of data and trailer), cuts the
/// data file after the last whole chunk (a torn tail: short header, short data, checksum
/// mismatch), and makes the index match: entries that agree are kept, the rest rewritten.
/// Memory stays bounded whatever the segment's size (streamed through buffers).
pub(super) fn recover_segment(dir: &Path, first: u64) -> Result<Segment, StreamError> {
    let dpath = data_path(dir, first);
    let ipath = index_path(dir, first);
    let data = open_rw(&dpath)?;
    let index = open_rw(&ipath)?;
    let file_len = data.metadata().map_err(io_err(&dpath))?.len();
    let mut h = [0u8; FILE_HEADER];
    let header_ok = data.read_exact_at(&mut h, 0).is_ok();
    match format::decode_file_header(SEGMENT_MAGIC, &h) {
        Some(f) if header_ok && f == first => {}
        _ if file_len < FILE_HEADER as u64 || h.iter().all(|b| *b == 0) => {
            // Created by a roll whose header never reached the disk.
            tracing::warn!(segment = %dpath.display(), "stream: segment header torn; rewritten");
            data.set_len(0).map_err(io_err(&dpath))?;
            data.write_all_at(&format::file_header(SEGMENT_MAGIC, first), 0)
                .map_err(io_err(&dpath))?;
        }
        _ => {
            return Err(StreamError::Corrupt {
                path: dpath,
                pos: 0,
                reason: "not a stream segment of this offset".into(),
            });
        }
    }
    let file_len = file_len.max(FILE_HEADER as u64);

    // The index: its header, then entries compared one by one with the scan.
    let index_len = index.metadata().map_err(io_err(&ipath))?.len();
    let mut ih = [0u8; FILE_HEADER];
    let index_header_ok = index.read_exact_at(&mut ih, 0).is_ok()
        && format::decode_file_header(INDEX_MAGIC, &ih) == Some(first);
    let old_entries = if index_header_ok {
        (index_len - FILE_HEADER as u64) / INDEX_ENTRY as u64
    } else {
        index.set_len(0).map_err(io_err(&ipath))?;
        index
            .write_all_at(&format::file_header(INDEX_MAGIC, first), 0)
            .map_err(io_err(&ipath))?;
        0
    };
    let mut old = BufReader::with_capacity(1 << 16, index.try_clone().map_err(io_err(&ipath))?);
    let mut skip = [0u8; FILE_HEADER];
    if index_header_ok {
        old.read_exact(&mut skip).map_err(io_err(&ipath))?;
    }
    // Set once the index diverges: the writer of the rest (from entry `k`).
    let mut rewrite: Option<BufWriter<File>> = None;

    let mut r = BufReader::with_capacity(1 << 20, File::open(&dpath).map_err(io_err(&dpath))?);
    let mut skip = [0u8; FILE_HEADER];
    r.read_exact(&mut skip).map_err(io_err(&dpath))?;
    let mut pos = FILE_HEADER as u64;
    let mut expected = first;
    let mut last_ts = 0;
    let mut k = 0u64;
    let mut body = Vec::new();
    let mut torn: Option<String> = None;
    while pos < file_len {
        let mut hb = [0u8; CHUNK_HEADER];
        if pos + CHUNK_HEADER as u64 > file_len {
            torn = Some(format!("short header ({} bytes)", file_len - pos));
            break;
        }
        r.read_exact(&mut hb).map_err(io_err(&dpath))?;
        let header = match ChunkHeader::decode(&hb) {
            Ok(h) => h,
            Err(e) => {
                torn = Some(e.to_string());
                break;
            }
        };
        if header.first_offset != expected {
            torn = Some(format!(
                "chunk offset {} where {expected} was due",
                header.first_offset
            ));
            break;
        }
        if pos + header.total_len() > file_len {
            torn = Some(format!(
                "short data ({} of {} bytes)",
                file_len - pos,
                header.total_len()
            ));
            break;
        }
        body.resize((header.total_len() - CHUNK_HEADER as u64) as usize, 0);
        r.read_exact(&mut body).map_err(io_err(&dpath))?;
        if let Err(e) = header.verify_body(&body) {
            torn = Some(e.to_string());
            break;
        }
        let entry = IndexEntry::of(&header, pos).encode();
        match &mut rewrite {
            Some(w) => w.write_all(&entry).map_err(io_err(&ipath))?,
            None => {
                let mut e = [0u8; INDEX_ENTRY];
                let same = k < old_entries && old.read_exact(&mut e).is_ok() && e == entry;
                if !same {
                    if k < old_entries {
                        tracing::warn!(segment = %dpath.display(), entry = k, "stream: index disagrees with its segment; rewritten from there");
                    }
                    let at = FILE_HEADER as u64 + k * INDEX_ENTRY as u64;
                    index.set_len(at).map_err(io_err(&ipath))?;
                    let mut f = index.try_clone().map_err(io_err(&ipath))?;
                    std::io::Seek::seek(&mut f, io::SeekFrom::Start(at)).map_err(io_err(&ipath))?;
                    let mut w = BufWriter::with_capacity(1 << 16, f);
                    w.write_all(&entry).map_err(io_err(&ipath))?;
                    rewrite = Some(w);
                }
            }
        }
        k += 1;
        pos += header.total_len();
        expected = header.next_offset();
        last_ts = header.timestamp;
    }
    if let Some(reason) = &torn {
        tracing::warn!(segment = %dpath.display(), at = pos, cut = file_len - pos, reason = %reason, "stream: torn chunk at the tail cut off");
        data.set_len(pos).map_err(io_err(&dpath))?;
    }
    let index_len = FILE_HEADER as u64 + k * INDEX_ENTRY as u64;
    if let Some(mut w) = rewrite.take() {
        w.flush().map_err(io_err(&ipath))?;
    }
    let on_disk = index.metadata().map_err(io_err(&ipath))?.len();
    if on_disk != index_len {
        // Entries for chunks that are not there (the index reached the disk before the
        // data did), or a torn entry.
        index.set_len(index_len).map_err(io_err(&ipath))?;
    }
    if torn.is_some() || old_entries != k || on_disk != index_len {
        data.sync_data().map_err(io_err(&dpath))?;
        index.sync_data().map_err(io_err(&ipath))?;
    }
    Ok(Segment {
        first_offset: first,
        next_offset: expected,
        last_ts,
        size: pos,
        index_len,
    })
}
