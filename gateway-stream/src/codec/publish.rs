//! A `Publish` command's messages read in place (v1 and v2, plain and sub-batch entries),
//! without copying their bodies.

use super::*;

/// One message of a Publish frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishedMessage {
    pub publishing_id: u64,
    /// Version 2 only: the filter value (`None`: null string).
    pub filter_value: Option<String>,
    pub entry: Entry,
}

/// A Publish frame's messages, or decoded ones: what a backend appends. The session reads
/// Publish frames straight from its read buffer into [`PublishedBatch::Wire`] (checked once
/// by [`parse_publish`], then iterated over the frame's own bytes), so a 1-message frame
/// costs no allocation and no reference count on its way to the log.
#[derive(Clone, Copy, Debug)]
pub enum PublishedBatch<'a> {
    /// The message section of a Publish frame (after the count), checked by
    /// [`parse_publish`]: `count` messages, each a publishing id, a filter value (`v2`) and
    /// an entry, filling `bytes` exactly.
    Wire {
        bytes: &'a [u8],
        count: usize,
        v2: bool,
        summary: BatchSummary,
    },
    Messages(&'a [PublishedMessage]),
}

/// What a backend checks before it appends, known from the parse (no pass of its own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchSummary {
    pub min_id: u64,
    pub max_id: u64,
    /// Bytes of the simple entries as a chunk's data section holds them (4-byte size each).
    pub simple_bytes: u64,
    pub sub_batches: bool,
}

impl BatchSummary {
    fn add(&mut self, first: bool, m: &PublishedRef<'_>) {
        if first {
            self.min_id = m.publishing_id;
            self.max_id = m.publishing_id;
        }
        self.min_id = self.min_id.min(m.publishing_id);
        self.max_id = self.max_id.max(m.publishing_id);
        match m.entry {
            EntryRef::Simple(b) => self.simple_bytes += 4 + b.len() as u64,
            EntryRef::SubBatch { .. } => self.sub_batches = true,
        }
    }
}

/// One message of a [`PublishedBatch`], borrowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublishedRef<'a> {
    pub publishing_id: u64,
    pub filter_value: Option<&'a str>,
    pub entry: EntryRef<'a>,
}

/// An [`Entry`], borrowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryRef<'a> {
    Simple(&'a [u8]),
    SubBatch {
        compression: u8,
        count: u16,
        uncompressed_size: u32,
        data: &'a [u8],
    },
}

impl<'a> PublishedBatch<'a> {
    pub fn len(&self) -> usize {
        match self {
            PublishedBatch::Wire { count, .. } => *count,
            PublishedBatch::Messages(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> PublishedIter<'a> {
        match *self {
            PublishedBatch::Wire {
                bytes, count, v2, ..
            } => PublishedIter::Wire {
                bytes,
                left: count,
                v2,
            },
            PublishedBatch::Messages(m) => PublishedIter::Messages(m.iter()),
        }
    }

    /// Ids, sizes and sub-batches (from the parse for a frame).
    pub fn summary(&self) -> BatchSummary {
        match self {
            PublishedBatch::Wire { summary, .. } => *summary,
            PublishedBatch::Messages(_) => {
                let mut s = BatchSummary::default();
                for (i, m) in self.iter().enumerate() {
                    s.add(i == 0, &m);
                }
                s
            }
        }
    }

    /// The messages as owned values, for backends that keep them: a frame's section is
    /// copied once and its messages share that copy.
    pub fn to_messages(&self) -> Vec<PublishedMessage> {
        let PublishedBatch::Wire { bytes, .. } = *self else {
            return match self {
                PublishedBatch::Messages(m) => m.to_vec(),
                PublishedBatch::Wire { .. } => Vec::new(),
            };
        };
        let owned = Bytes::copy_from_slice(bytes);
        // Each entry is a subslice of `bytes`: the same range of the copy.
        let share = |d: &[u8]| {
            let at = (d.as_ptr() as usize).saturating_sub(bytes.as_ptr() as usize);
            owned.slice(at.min(owned.len())..(at + d.len()).min(owned.len()))
        };
        self.iter()
            .map(|m| PublishedMessage {
                publishing_id: m.publishing_id,
                filter_value: m.filter_value.map(str::to_string),
                entry: match m.entry {
                    EntryRef::Simple(d) => Entry::Simple(share(d)),
                    EntryRef::SubBatch {
                        compression,
                        count,
                        uncompressed_size,
                        data,
                    } => Entry::SubBatch {
                        compression,
                        count,
                        uncompressed_size,
                        data: share(data),
                    },
                },
            })
            .collect()
    }
}

/// Iterates a [`PublishedBatch`].
#[derive(Clone, Debug)]
pub enum PublishedIter<'a> {
    Wire {
        /// What is left of the section.
        bytes: &'a [u8],
        left: usize,
        v2: bool,
    },
    Messages(std::slice::Iter<'a, PublishedMessage>),
}

impl<'a> Iterator for PublishedIter<'a> {
    type Item = PublishedRef<'a>;

    fn next(&mut self) -> Option<PublishedRef<'a>> {
        match self {
            PublishedIter::Messages(it) => it.next().map(|m| PublishedRef {
                publishing_id: m.publishing_id,
                filter_value: m.filter_value.as_deref(),
                entry: match &m.entry {
                    Entry::Simple(b) => EntryRef::Simple(b),
                    Entry::SubBatch {
                        compression,
                        count,
                        uncompressed_size,
                        data,
                    } => EntryRef::SubBatch {
                        compression: *compression,
                        count: *count,
                        uncompressed_size: *uncompressed_size,
                        data,
                    },
                },
            }),
            PublishedIter::Wire { bytes, left, v2 } => {
                if *left == 0 {
                    return None;
                }
                // Checked by `parse_publish`; a short read ends the iteration, never panics.
                let (m, used) = read_published(bytes, *v2).ok()?;
                *bytes = bytes.get(used..)?;
                *left -= 1;
                Some(m)
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match self {
            PublishedIter::Wire { left, .. } => (*left, Some(*left)),
            PublishedIter::Messages(it) => it.size_hint(),
        }
    }
}

/// One message of a Publish frame at the front of `b`: it and the bytes it took.
pub(super) fn read_published(b: &[u8], v2: bool) -> Result<(PublishedRef<'_>, usize), DecodeError> {
    let take = |at: usize, n: usize, what: &'static str| -> Result<&[u8], DecodeError> {
        b.get(at..at.checked_add(n).ok_or(DecodeError::Truncated(what))?)
            .ok_or(DecodeError::Truncated(what))
    };
    let publishing_id = u64::from_be_bytes(
        take(0, 8, "publishing id")?
            .try_into()
            .map_err(|_| DecodeError::Truncated("publishing id"))?,
    );
    let mut at = 8;
    let mut filter_value = None;
    if v2 {
        let len = i16::from_be_bytes([
            *b.get(at).ok_or(DecodeError::Truncated("filter value"))?,
            *b.get(at + 1)
                .ok_or(DecodeError::Truncated("filter value"))?,
        ]);
        at += 2;
        if len >= 0 {
            let s = take(at, len as usize, "filter value")?;
            filter_value = Some(std::str::from_utf8(s).map_err(|_| DecodeError::Utf8)?);
            at += len as usize;
        }
    }
    let first = *b.get(at).ok_or(DecodeError::Truncated("entry header"))?;
    let entry = if first & 0x80 == 0 {
        let h = take(at, 4, "entry size")?;
        let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize;
        at += 4;
        let data = take(at, len, "entry")?;
        at += len;
        EntryRef::Simple(data)
    } else {
        let h = take(at, 11, "sub-batch header")?;
        let compression = (first >> 4) & 0x07;
        let count = u16::from_be_bytes([h[1], h[2]]);
        let uncompressed_size = u32::from_be_bytes([h[3], h[4], h[5], h[6]]);
        let len = u32::from_be_bytes([h[7], h[8], h[9], h[10]]) as usize;
        at += 11;
        let data = take(at, len, "sub-batch")?;
        at += len;
        EntryRef::SubBatch {
            compression,
            count,
            uncompressed_size,
            data,
        }
    };
    Ok((
        PublishedRef {
            publishing_id,
            filter_value,
            entry,
        },
        at,
    ))
}

/// A Publish frame's body (key and version included) read in place, without a [`Frame`]:
/// the publisher id and its messages as a [`PublishedBatch::Wire`], the section checked whole
/// (the same checks and errors as [`decode`]); `None` when the body is not a Publish command.
pub fn parse_publish(b: &[u8]) -> Option<Result<(u8, PublishedBatch<'_>), DecodeError>> {
    if b.len() < 4 || u16::from_be_bytes([b[0], b[1]]) != key::PUBLISH {
        return None;
    }
    let version = u16::from_be_bytes([b[2], b[3]]);
    if version != 1 && version != 2 {
        return None;
    }
    let v2 = version == 2;
    Some((|| {
        let publisher_id = *b.get(4).ok_or(DecodeError::Truncated("publisher id"))?;
        let n = b
            .get(5..9)
            .ok_or(DecodeError::Truncated("published messages"))?;
        let n = i32::from_be_bytes([n[0], n[1], n[2], n[3]]);
        if n < 0 {
            return Err(DecodeError::BadValue("published messages"));
        }
        let n = n as usize;
        let section = &b[9..];
        // id + smallest entry (4-byte size) [+ null filter string], as `decode`.
        if n.saturating_mul(if v2 { 14 } else { 12 }) > section.len() {
            return Err(DecodeError::Truncated("published messages"));
        }
        let mut summary = BatchSummary::default();
        let mut at = 0;
        for i in 0..n {
            let (m, used) = read_published(&section[at..], v2)?;
            summary.add(i == 0, &m);
            at += used;
        }
        if at != section.len() {
            return Err(DecodeError::Trailing(section.len() - at));
        }
        Ok((
            publisher_id,
            PublishedBatch::Wire {
                bytes: section,
                count: n,
                v2,
                summary,
            },
        ))
    })())
}
