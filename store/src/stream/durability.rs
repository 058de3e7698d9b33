//! Making a stream's appends durable (flush, sync, the split begin/end sync of group commit)
//! and retention, which deletes whole oldest segments.

use super::*;

impl StreamLog {
    /// Writes the buffers out (data, then index) to the OS; no fsync.
    pub fn flush(&mut self) -> Result<(), StreamError> {
        self.check_ok()?;
        self.seal()?;
        let first = self.segments.last().map_or(0, |s| s.first_offset);
        let a = &mut self.active;
        if !a.buf.is_empty() {
            if let Err(e) = a.data.write_all_at(&a.buf, a.data_written) {
                let path = data_path(&self.shared.dir, first);
                self.failed = Some(e.to_string());
                return Err(io_err(&path)(e));
            }
            a.data_written += a.buf.len() as u64;
            a.buf.clear();
            // A chunk bigger than the limit passed through: give its memory back.
            a.buf.shrink_to(self.config.buffer_limit_bytes);
        }
        if !a.ibuf.is_empty() {
            if let Err(e) = a.index.write_all_at(&a.ibuf, a.index_written) {
                let path = index_path(&self.shared.dir, first);
                self.failed = Some(e.to_string());
                return Err(io_err(&path)(e));
            }
            a.index_written += a.ibuf.len() as u64;
            a.ibuf.clear();
        }
        Ok(())
    }

    /// Writes out and fsyncs what was appended, then lets readers see it; returns the highest
    /// durable offset. Only the data file is fsynced here: recovery verifies the newest
    /// segment chunk by chunk and rebuilds its index, so its index need not be durable
    /// (saving one fsync per group commit); older segments' indexes were fsynced at roll.
    pub fn sync(&mut self) -> Result<Option<u64>, StreamError> {
        self.flush()?;
        if self.config.fsync {
            let first = self.segments.last().map_or(0, |s| s.first_offset);
            if let Err(e) = self.active.data.sync_data() {
                self.failed = Some(e.to_string());
                return Err(io_err(&data_path(&self.shared.dir, first))(e));
            }
            self.active.data_durable = self.active.data_written;
            if self.dir_dirty {
                let dir = &self.shared.dir;
                File::open(dir)
                    .and_then(|d| d.sync_all())
                    .map_err(io_err(dir))?;
                self.dir_dirty = false;
            }
        }
        self.shared
            .committed
            .store(self.next_offset, Ordering::Release);
        Ok(self.next_offset.checked_sub(1))
    }

    /// Group commit in two steps, so the fsync runs without the writer's lock: writes the
    /// buffers out and returns what [`PendingSync::wait`] must fsync; appends may go on
    /// meanwhile (a roll fsyncs the segment it closes itself); [`StreamLog::end_sync`] then
    /// lets readers see the offsets the pending sync covered. [`StreamLog::sync`] in one call.
    pub fn begin_sync(&mut self) -> Result<PendingSync, StreamError> {
        self.flush()?;
        let first = self.segments.last().map_or(0, |s| s.first_offset);
        let dir = (self.config.fsync && std::mem::take(&mut self.dir_dirty))
            .then(|| self.shared.dir.clone());
        // Nothing written since a completed fsync (another sync made it durable, or only
        // tracking state that is already out): no fsync. A sync still in flight does not
        // count: its bytes are not durable until it completes.
        let needed = self.active.data_written > self.active.data_durable;
        Ok(PendingSync {
            data: (self.config.fsync && needed).then(|| self.active.data.clone()),
            path: data_path(&self.shared.dir, first),
            dir,
            next: self.next_offset,
            segment: first,
            written: self.active.data_written,
        })
    }

    /// Completes a [`StreamLog::begin_sync`] with its [`PendingSync::wait`] result: the
    /// highest durable offset, or the error (the log then refuses further writes).
    pub fn end_sync(
        &mut self,
        pending: &PendingSync,
        waited: Result<(), StreamError>,
    ) -> Result<Option<u64>, StreamError> {
        if let Err(e) = waited {
            self.failed = Some(e.to_string());
            return Err(e);
        }
        self.check_ok()?;
        if self.segments.last().map_or(0, |s| s.first_offset) == pending.segment {
            self.active.data_durable = self.active.data_durable.max(pending.written);
        }
        self.shared
            .committed
            .fetch_max(pending.next, Ordering::AcqRel);
        Ok(self.shared.committed.load(Ordering::Acquire).checked_sub(1))
    }

    /// Deletes whole oldest segments, never the active one, while the stream is larger than
    /// `max_length_bytes` or their newest chunk is older than `max_age_ms` at `now_ms`.
    pub fn retain(&mut self, now_ms: u64) -> Result<Retained, StreamError> {
        let mut done = Retained::default();
        while self.segments.len() > 1 {
            let total = self.size_bytes();
            let oldest = &self.segments[0];
            let too_big = self.config.max_length_bytes.is_some_and(|m| total > m);
            let too_old = self
                .config
                .max_age_ms
                .is_some_and(|a| oldest.last_ts.saturating_add(a) < now_ms);
            if !too_big && !too_old {
                break;
            }
            let seg = self.segments.remove(0);
            // Data first: an index left without its data is removed at open.
            for path in [
                data_path(&self.shared.dir, seg.first_offset),
                index_path(&self.shared.dir, seg.first_offset),
            ] {
                match fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_err(&path)(e)),
                }
            }
            done.segments += 1;
            done.bytes += seg.size;
            self.dir_dirty = true;
        }
        if done.segments > 0 {
            self.shared
                .set_segments(self.segments.iter().map(|s| s.first_offset).collect());
        }
        Ok(done)
    }
}
