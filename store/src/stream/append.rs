//! Appending to a stream: batches buffered as chunks (plain, filtered, merged, sub-batch),
//! sealed into the active segment, and the segments rolled.

use super::*;

impl StreamLog {
    pub(super) fn check_ok(&self) -> Result<(), StreamError> {
        match &self.failed {
            Some(e) => Err(StreamError::Failed(e.clone())),
            None => Ok(()),
        }
    }

    /// Refuses a chunk of `len` bytes if the buffer would pass its limit (an empty buffer
    /// takes any chunk: it is written out at the next flush).
    pub(super) fn reserve(&self, len: usize) -> Result<(), StreamError> {
        let buffered = self.buffered_bytes();
        if buffered > 0 && buffered + len + INDEX_ENTRY > self.config.buffer_limit_bytes {
            return Err(StreamError::Backpressure {
                buffered,
                limit: self.config.buffer_limit_bytes,
            });
        }
        Ok(())
    }

    /// Appends `messages` as one chunk stamped `timestamp_ms` (raised to the previous
    /// chunk's, so timestamps never decrease and seeks by time can bisect). Nothing is
    /// durable or visible to readers before [`StreamLog::sync`].
    pub fn append<M: AsRef<[u8]>>(
        &mut self,
        messages: &[M],
        timestamp_ms: u64,
        publishers: &[(&str, u64)],
    ) -> Result<Range<u64>, StreamError> {
        self.append_filtered(messages, &[], timestamp_ms, publishers)
    }

    /// [`StreamLog::append`], with the messages' filter values (stream filtering; empty or
    /// all `None`: none): when one is set, the chunk's trailer carries their Bloom filter
    /// (`bloom.rs`), which filtered readers check before reading the chunk.
    pub fn append_filtered<M: AsRef<[u8]>>(
        &mut self,
        messages: &[M],
        filter_values: &[Option<&str>],
        timestamp_ms: u64,
        publishers: &[(&str, u64)],
    ) -> Result<Range<u64>, StreamError> {
        let data_len = check_batch(messages)?;
        for (name, _) in publishers {
            check_name(name)?;
        }
        self.seal()?;
        let publishers: Vec<(&[u8], u64)> =
            publishers.iter().map(|(n, v)| (n.as_bytes(), *v)).collect();
        self.put_user_chunk(
            (messages.len(), messages.len()),
            data_len,
            |buf| {
                buf.extend_from_slice(&[0u8; CHUNK_HEADER]);
                for m in messages {
                    format::put_message(buf, m.as_ref());
                }
            },
            bloom::build(filter_values),
            &publishers,
            timestamp_ms,
            true,
        )
    }

    /// [`StreamLog::append_filtered`], except that the batch joins the messages staged since
    /// the last write into one chunk (see `OpenChunk`) instead of making its own: the
    /// stream protocol's path, where a chunk per Publish frame would cost a header, an index
    /// entry and CRCs per frame. A batch is never split; it starts a new chunk when the
    /// staged one would pass `MAX_CHUNK_MESSAGES` or the write buffer's limit. The offsets
    /// are the batch's; nothing is durable or visible before the next sync, as for
    /// [`StreamLog::append`].
    pub fn append_merged<M: AsRef<[u8]>>(
        &mut self,
        messages: &[M],
        filter_values: &[Option<&str>],
        timestamp_ms: u64,
        publishers: &[(&str, u64)],
    ) -> Result<Range<u64>, StreamError> {
        self.append_merged_iter(
            messages
                .iter()
                .enumerate()
                .map(|(i, m)| (m.as_ref(), filter_values.get(i).copied().flatten())),
            None,
            timestamp_ms,
            publishers,
        )
    }

    /// [`StreamLog::append_merged`] over an iterator of (message, filter value): callers hand
    /// borrowed slices of what they received (a Publish frame) without collecting them
    /// first. `sized`: the message count and data-section bytes when the caller knows them
    /// (its parse counted them), so the messages are walked once, as they are staged (a
    /// batch that turns out to differ is unstaged and refused); `None`: walked twice.
    pub fn append_merged_iter<'m, I>(
        &mut self,
        messages: I,
        sized: Option<(usize, u64)>,
        timestamp_ms: u64,
        publishers: &[(&str, u64)],
    ) -> Result<Range<u64>, StreamError>
    where
        I: Iterator<Item = (&'m [u8], Option<&'m str>)> + Clone,
    {
        self.check_ok()?;
        let (count, data_len) = match sized {
            Some((count, data_len)) => check_sizes(count, data_len)?,
            None => check_batch_iter(messages.clone().map(|(m, _)| m))?,
        };
        for (name, _) in publishers {
            check_name(name)?;
        }
        self.seal_unless_room(count, count, data_len)?;
        // Room for the batch and its share of a chunk's header and trailer.
        let trailer: usize = publishers
            .iter()
            .map(|(n, _)| format::tracking_entry_len(n.as_bytes()))
            .sum::<usize>()
            + format::tracking_entry_len(&[0u8; bloom::FILTER_BYTES]);
        self.reserve(CHUNK_HEADER + data_len as usize + trailer)?;
        let o = &mut self.open;
        let first = self.next_offset + o.count as u64;
        if o.data.is_empty() {
            // Room for the chunk's header: sealed into an empty write buffer, the staged
            // bytes become that buffer as they are (no copy).
            o.data.extend_from_slice(&[0u8; CHUNK_HEADER]);
        }
        o.data.reserve(data_len as usize);
        let mark = o.data.len();
        let (mut n, mut len, mut too_big) = (0usize, 0u64, false);
        for (m, filter) in messages {
            too_big |= m.len() > MAX_MESSAGE;
            format::put_message(&mut o.data, m);
            o.filter.add(filter);
            n += 1;
            len += 4 + m.len() as u64;
        }
        if (n, len) != (count, data_len) || too_big {
            // Only a caller's wrong `sized` gets here. (Filter bits it added stay: at worst a
            // false positive for a filtered reader.)
            o.data.truncate(if o.count == 0 { 0 } else { mark });
            return Err(StreamError::Invalid(format!(
                "a batch said to hold {count} messages of {data_len} bytes holds {n} of {len}"
            )));
        }
        o.count += count;
        o.entries += count;
        o.staged(timestamp_ms, publishers);
        Ok(first..first + count as u64)
    }

    /// Seals the staged chunk if `entries` more entries of `records` records and `data_len`
    /// bytes would take it past `merge_entries`, the format's record count or the write
    /// buffer's limit.
    pub(super) fn seal_unless_room(
        &mut self,
        entries: usize,
        records: usize,
        data_len: u64,
    ) -> Result<(), StreamError> {
        let o = &self.open;
        if o.count > 0
            && (o.entries + entries > MAX_CHUNK_MESSAGES.min(self.config.merge_entries)
                || o.count + records > MAX_CHUNK_MESSAGES
                || o.data.len() as u64 + data_len
                    > (self.config.buffer_limit_bytes as u64).min(MAX_CHUNK_BODY / 2))
        {
            self.seal()?;
        }
        Ok(())
    }

    /// Stages one sub-batch entry of the stream protocol (`entry`: its wire layout, header
    /// included; see `sub_batch`) as one entry of its `count` records in the staged chunk, as
    /// osiris stores it: delivered to stream clients as written, its records counted in
    /// offsets, expanded for the AMQP side. Merged as [`StreamLog::append_merged`] merges;
    /// `filter` is the publisher's filter value for all of its records. A codec the log does
    /// not serve, or bytes that are not one sub-batch, are refused (`Invalid`).
    pub fn append_merged_sub_batch(
        &mut self,
        entry: &[u8],
        filter: Option<&str>,
        timestamp_ms: u64,
        publishers: &[(&str, u64)],
    ) -> Result<Range<u64>, StreamError> {
        self.check_ok()?;
        let h = sub_batch::SubBatch::parse(entry)
            .filter(|h| h.count > 0 && sub_batch::HEADER + h.size as usize == entry.len())
            .ok_or_else(|| StreamError::Invalid("not a sub-batch entry".into()))?;
        if !sub_batch::served(h.compression) {
            return Err(StreamError::Invalid(format!(
                "sub-batch compression {} is not served (none and gzip are)",
                h.compression
            )));
        }
        for (name, _) in publishers {
            check_name(name)?;
        }
        let count = usize::from(h.count);
        let data_len = entry.len() as u64;
        check_sizes(count, data_len)?;
        self.seal_unless_room(1, count, data_len)?;
        let trailer: usize = publishers
            .iter()
            .map(|(n, _)| format::tracking_entry_len(n.as_bytes()))
            .sum::<usize>()
            + format::tracking_entry_len(&[0u8; bloom::FILTER_BYTES]);
        self.reserve(CHUNK_HEADER + entry.len() + trailer)?;
        let o = &mut self.open;
        let first = self.next_offset + o.count as u64;
        if o.data.is_empty() {
            o.data.extend_from_slice(&[0u8; CHUNK_HEADER]);
        }
        o.data.extend_from_slice(entry);
        o.filter.add(filter);
        o.count += count;
        o.entries += 1;
        o.staged(timestamp_ms, publishers);
        Ok(first..first + count as u64)
    }

    /// Writes the staged messages (`append_merged`) into the buffer as one chunk.
    pub(super) fn seal(&mut self) -> Result<(), StreamError> {
        if self.open.count == 0 {
            return Ok(());
        }
        let mut o = std::mem::take(&mut self.open);
        let publishers: Vec<(&[u8], u64)> = o
            .publishers
            .iter()
            .map(|(n, v)| (n.as_bytes(), *v))
            .collect();
        // Its bytes were admitted at staging (`reserve`): no backpressure now, which would
        // lose them.
        let data = &mut o.data;
        let sealed = self.put_user_chunk(
            (o.entries, o.count),
            (data.len() - CHUNK_HEADER) as u64,
            |buf| {
                if buf.is_empty() {
                    // The usual case (the buffer was written out at the last flush): the
                    // staged chunk, its header's room included, becomes the buffer; the
                    // emptied buffer, with its capacity, stages the next one.
                    std::mem::swap(buf, data);
                } else {
                    buf.extend_from_slice(data);
                }
            },
            o.filter.finish(),
            &publishers,
            o.ts,
            false,
        );
        if let Err(e) = &sealed {
            // Offsets were handed out for these messages: the log cannot go on without them.
            self.failed = Some(e.to_string());
        }
        // The staging buffer keeps its capacity (at most about the write buffer's limit): a
        // fresh one per chunk would grow by doubling and fault its pages in at every write.
        drop(publishers);
        o.data.clear();
        self.open.data = o.data;
        sealed.map(|_| ())
    }

    /// Puts one user chunk in the buffer: room for its header and `data_len` bytes of
    /// messages (`count` of them) written by `write_data`, then the trailer (publishers,
    /// Bloom filter).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn put_user_chunk(
        &mut self,
        (entries, count): (usize, usize),
        data_len: u64,
        write_data: impl FnOnce(&mut Vec<u8>),
        filter: Option<(Vec<u8>, u64)>,
        publishers: &[(&[u8], u64)],
        timestamp_ms: u64,
        check_room: bool,
    ) -> Result<Range<u64>, StreamError> {
        self.check_ok()?;
        let mut trailer_len = 0u64;
        for (name, _) in publishers {
            trailer_len += format::tracking_entry_len(name) as u64;
        }
        if let Some((bits, _)) = &filter {
            trailer_len += format::tracking_entry_len(bits) as u64;
        }
        if data_len + trailer_len > MAX_CHUNK_BODY {
            return Err(StreamError::Invalid(format!(
                "a chunk of {} bytes (limit {MAX_CHUNK_BODY})",
                data_len + trailer_len
            )));
        }
        let total = CHUNK_HEADER as u64 + data_len + trailer_len;
        if check_room {
            self.reserve(total as usize)?;
        }
        let ts = timestamp_ms.max(self.last_ts);
        self.maybe_roll(total, ts)?;
        let first = self.next_offset;
        let buf = &mut self.active.buf;
        let start = buf.len();
        write_data(buf);
        let data_end = buf.len();
        debug_assert_eq!((data_end - start - CHUNK_HEADER) as u64, data_len);
        for (name, seq) in publishers {
            format::put_tracking(buf, TrackingKind::Publisher, name, *seq);
        }
        if let Some((bits, flags)) = &filter {
            format::put_tracking(buf, TrackingKind::Filter, bits, *flags);
        }
        let header = ChunkHeader {
            kind: ChunkType::User,
            entries: entries as u16,
            first_offset: first,
            count: count as u32,
            data_len: data_len as u32,
            trailer_len: trailer_len as u32,
            timestamp: ts,
            data_crc: crc32fast::hash(&buf[start + CHUNK_HEADER..data_end]),
            trailer_crc: crc32fast::hash(&buf[data_end..]),
        };
        buf[start..start + CHUNK_HEADER].copy_from_slice(&header.encode());
        self.indexed(&header);
        self.last_chunk = Some(first);
        for (name, seq) in publishers {
            self.tracking
                .set(TrackingKind::Publisher, name, *seq, self.config.max_tracked);
        }
        Ok(first..self.next_offset)
    }

    /// Books a chunk just put in the buffer: its index entry and the segment's summary.
    pub(super) fn indexed(&mut self, header: &ChunkHeader) {
        let Some(seg) = self.segments.last_mut() else {
            return;
        };
        let entry = IndexEntry::of(header, seg.size);
        self.active.ibuf.extend_from_slice(&entry.encode());
        seg.size += header.total_len();
        seg.index_len += INDEX_ENTRY as u64;
        seg.next_offset = header.next_offset();
        seg.last_ts = header.timestamp;
        self.next_offset = header.next_offset();
        self.last_ts = header.timestamp;
    }

    pub(super) fn maybe_roll(&mut self, chunk: u64, ts: u64) -> Result<(), StreamError> {
        let Some(seg) = self.segments.last() else {
            return Ok(());
        };
        // A segment holding no message yet takes any chunk (no empty segments).
        if seg.next_offset > seg.first_offset
            && seg.size + chunk > self.config.max_segment_size_bytes
        {
            self.roll(ts)?;
        }
        Ok(())
    }

    /// Closes the active segment (written and fsynced: segments before the newest are
    /// complete, so recovery needs to verify only the newest) and starts one at
    /// `next_offset`, beginning with a tracking snapshot; then applies retention.
    pub(super) fn roll(&mut self, ts: u64) -> Result<(), StreamError> {
        self.flush()?;
        if self.config.fsync {
            let first = self.segments.last().map_or(0, |s| s.first_offset);
            let path = data_path(&self.shared.dir, first);
            self.active.data.sync_data().map_err(io_err(&path))?;
            let path = index_path(&self.shared.dir, first);
            self.active.index.sync_data().map_err(io_err(&path))?;
        }
        let (active, seg) = create_segment(&self.shared.dir, self.next_offset)?;
        self.active = active;
        self.segments.push(seg);
        self.dir_dirty = true;
        self.write_snapshot(ts)?;
        self.shared
            .set_segments(self.segments.iter().map(|s| s.first_offset).collect());
        self.retain(ts)?;
        Ok(())
    }
}
