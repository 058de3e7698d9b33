//! Frame assembly: a message being put together from basic.publish, its content header and
//! its body frames, with bounded allocation whatever size the header announces.

use amq_protocol::protocol::basic;
use bytes::Bytes;

/// Bodies are assembled in a buffer this large at first, growing geometrically after, so a
/// client announcing 128 MiB cannot make us allocate it before sending it.
const INITIAL_BODY: u64 = 1024 * 1024;
/// Single-frame bodies shorter than this are copied out of the read buffer. Kept as a slice,
/// a small body would pin the whole read allocation (up to the shell's read chunk) for as long
/// as the message sits in a queue: a slow publisher's 100-byte messages would hold 4-64 KiB
/// each, invisible to the core's memory accounting, which counts body bytes.
const COPY_BODY_BELOW: usize = 32 * 1024;

/// A message being assembled from publish + header + body frames.
pub(crate) struct Content {
    pub(crate) publish: basic::Publish,
    /// The announced body size and the properties, once the header arrived.
    pub(crate) header: Option<(u64, warren_core::message::Properties)>,
    pub(crate) body: Body,
}

impl Content {
    pub(crate) fn new(publish: basic::Publish) -> Content {
        Content {
            publish,
            header: None,
            body: Body::Empty,
        }
    }
}

pub(crate) enum Body {
    Empty,
    /// The whole body arrived in one frame (see `own`).
    One(Bytes),
    /// Assembled from several frames. Capacity grows geometrically from at most
    /// `INITIAL_BODY` but never beyond the announced size, so a complete body holds exactly
    /// its length and a client announcing 128 MiB must send it before we allocate it.
    Many(Vec<u8>),
}

impl Body {
    pub(crate) fn len(&self) -> u64 {
        match self {
            Body::Empty => 0,
            Body::One(b) => b.len() as u64,
            Body::Many(b) => b.len() as u64,
        }
    }

    /// Appends a chunk; the caller has checked that the body stays within `total`.
    pub(crate) fn push(&mut self, chunk: Bytes, total: u64) {
        *self = match std::mem::replace(self, Body::Empty) {
            Body::Empty if chunk.len() as u64 == total => Body::One(own(chunk)),
            Body::Empty => {
                let mut b = Vec::with_capacity(total.min(INITIAL_BODY) as usize);
                b.extend_from_slice(&chunk);
                Body::Many(b)
            }
            Body::One(first) => {
                let mut b = Vec::with_capacity(total.min(INITIAL_BODY) as usize);
                extend_within(&mut b, &first, total);
                extend_within(&mut b, &chunk, total);
                Body::Many(b)
            }
            Body::Many(mut b) => {
                extend_within(&mut b, &chunk, total);
                Body::Many(b)
            }
        };
    }

    pub(crate) fn freeze(self) -> Bytes {
        match self {
            Body::Empty => Bytes::new(),
            Body::One(b) => b,
            Body::Many(b) => Bytes::from(b),
        }
    }
}

/// Appends `chunk`, doubling the capacity when it is short but capping it at `total`.
fn extend_within(b: &mut Vec<u8>, chunk: &[u8], total: u64) {
    let needed = b.len() + chunk.len();
    if needed > b.capacity() {
        let cap = usize::try_from(total).unwrap_or(usize::MAX);
        let target = b
            .capacity()
            .saturating_mul(2)
            .max(needed)
            .min(cap.max(needed));
        b.reserve_exact(target - b.len());
    }
    b.extend_from_slice(chunk);
}

/// A body chunk fit to keep: small ones get their own allocation (see `COPY_BODY_BELOW`).
fn own(chunk: Bytes) -> Bytes {
    if chunk.len() < COPY_BODY_BELOW {
        Bytes::copy_from_slice(&chunk)
    } else {
        chunk
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_assemble_to_exactly_their_size() {
        let total = 3 * 1024 * 1024 + 17;
        let mut body = Body::Empty;
        let chunk = Bytes::from(vec![7u8; 131_064]);
        while body.len() + (chunk.len() as u64) <= total {
            body.push(chunk.clone(), total);
        }
        let rest = (total - body.len()) as usize;
        body.push(chunk.slice(..rest), total);
        let Body::Many(ref v) = body else {
            panic!("a multi-frame body")
        };
        assert_eq!(v.capacity() as u64, total, "no slack kept past completion");
        assert_eq!(body.freeze().len() as u64, total);

        // A small single-frame body does not pin the buffer it was read into.
        let read = Bytes::from(vec![1u8; 65_536]);
        let mut small = Body::Empty;
        small.push(read.slice(10..110), 100);
        let frozen = small.freeze();
        assert_eq!(frozen.len(), 100);
        assert!(!read.as_ptr_range().contains(&frozen.as_ptr()));
    }
}
