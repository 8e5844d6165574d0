//! The frame every zeropp TCP message travels in: a fixed 40-byte header
//! (magic, version, kind, source rank, tag, payload length, header checksum)
//! and the payload. Decoding checks every field and never allocates more
//! than the bytes that actually arrive.

use std::io::{Read, Write};
use std::sync::Arc;

use super::pool::{BufferPool, PooledBuf};
use super::{CommError, Tag};

/// Why a connection's hello was refused: the first frame a rank (or a
/// rank meeting the rendezvous) sends says who it is and which job.
#[derive(Debug, thiserror::Error)]
pub enum HelloError {
    /// Reading or setting up the socket failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The frame could not be read.
    #[error("{0}")]
    Frame(#[from] CommError),
    #[error("closed before saying hello")]
    Closed,
    #[error("first frame is not a hello")]
    NotHello,
    #[error("unreadable hello: {0}")]
    Unreadable(#[from] serde_json::Error),
    #[error("wrong job token")]
    WrongToken,
    #[error("rank {rank} believes the world has {theirs} ranks, this rank {ours}")]
    WorldSize {
        rank: usize,
        theirs: usize,
        ours: usize,
    },
}

pub const MAGIC: u32 = 0x5A50_5031; // "ZPP1"
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 40;
/// The largest payload a frame may announce (1 TiB): a bound against a
/// corrupt length, not a practical limit.
pub const MAX_PAYLOAD: u64 = 1 << 40;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A tagged message for the receiver's mailbox.
    Data = 0,
    /// The first frame on a connection: who is calling, with the job token.
    Hello = 1,
    /// A rank closing its connections on purpose.
    Goodbye = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub source: u32,
    pub tag: Tag,
    pub len: u64,
}

fn checksum(bytes: &[u8]) -> u32 {
    // FNV-1a over the header's first 36 bytes: catches corruption and
    // misaligned streams, not an adversary (the token does that).
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4..6].copy_from_slice(&VERSION.to_le_bytes());
        h[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        h[8..12].copy_from_slice(&self.source.to_le_bytes());
        // 12..16 reserved, zero
        h[16..24].copy_from_slice(&self.tag.to_le_bytes());
        h[24..32].copy_from_slice(&self.len.to_le_bytes());
        // 32..36 reserved, zero
        let sum = checksum(&h[..36]);
        h[36..40].copy_from_slice(&sum.to_le_bytes());
        h
    }

    pub fn decode(h: &[u8; HEADER_LEN]) -> Result<Header, CommError> {
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(CommError::Malformed(format!(
                "bad magic {magic:#010x} (expected {MAGIC:#010x}): the peer is not a zeropp \
                 rank, or the stream is out of step"
            )));
        }
        let version = u16::from_le_bytes([h[4], h[5]]);
        if version != VERSION {
            return Err(CommError::Malformed(format!(
                "wire version {version}, this build speaks {VERSION}: run the same zeropp \
                 build on every rank"
            )));
        }
        if checksum(&h[..36]) != u32_at(36) {
            return Err(CommError::Malformed("header checksum mismatch".into()));
        }
        let kind = match u16::from_le_bytes([h[6], h[7]]) {
            0 => Kind::Data,
            1 => Kind::Hello,
            2 => Kind::Goodbye,
            k => return Err(CommError::Malformed(format!("unknown frame kind {k}"))),
        };
        let len = u64_at(24);
        if len > MAX_PAYLOAD {
            return Err(CommError::Malformed(format!(
                "payload length {len} exceeds the limit {MAX_PAYLOAD}"
            )));
        }
        Ok(Header {
            kind,
            source: u32_at(8),
            tag: u64_at(16),
            len,
        })
    }
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, header: &Header, payload: &[u8]) -> std::io::Result<()> {
    debug_assert_eq!(header.len, payload.len() as u64);
    w.write_all(&header.encode())?;
    w.write_all(payload)?;
    w.flush()
}

/// The outcome of reading one frame.
pub enum ReadFrame {
    Frame(Header, Vec<u8>),
    /// The stream ended cleanly between frames.
    End,
}

/// Fills `buf` from `r` unless the stream ends first; returns how many
/// bytes arrived (less than `buf.len()` only at the end of the stream).
fn read_full(r: &mut impl Read, buf: &mut [u8], from: &str) -> Result<usize, CommError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(CommError::Io {
                    what: from.into(),
                    source: e,
                });
            }
        }
    }
    Ok(got)
}

/// Reads a frame's header; `None` when the stream ended cleanly before it.
fn read_header(r: &mut impl Read) -> Result<Option<Header>, CommError> {
    let mut h = [0u8; HEADER_LEN];
    match read_full(r, &mut h, "a peer")? {
        0 => Ok(None),
        HEADER_LEN => Header::decode(&h).map(Some),
        got => Err(CommError::Malformed(format!(
            "truncated message: the stream ended after {got} of {HEADER_LEN} header bytes"
        ))),
    }
}

/// Payloads up to this size are read into a buffer of their announced
/// length at once; longer ones grow with what arrives, so a lying length
/// cannot make the reader allocate it.
const ALLOCATE_UP_FRONT: u64 = 64 << 20;

fn truncated(header: &Header, read: u64) -> CommError {
    CommError::Malformed(format!(
        "truncated message from rank {}: {read} of {} payload bytes arrived",
        header.source, header.len
    ))
}

fn read_growing(r: &mut impl Read, header: &Header) -> Result<Vec<u8>, CommError> {
    let mut payload = Vec::with_capacity(header.len.min(ALLOCATE_UP_FRONT) as usize);
    let read = r
        .take(header.len)
        .read_to_end(&mut payload)
        .map_err(|e| CommError::Io {
            what: format!("rank {}", header.source),
            source: e,
        })?;
    if (read as u64) < header.len {
        return Err(truncated(header, read as u64));
    }
    Ok(payload)
}

/// Reads one frame. A stream that ends inside a frame is a `Malformed`
/// error that says how much was missing.
pub fn read_frame(r: &mut impl Read) -> Result<ReadFrame, CommError> {
    let Some(header) = read_header(r)? else {
        return Ok(ReadFrame::End);
    };
    let payload = read_growing(r, &header)?;
    Ok(ReadFrame::Frame(header, payload))
}

/// [`read_frame`] for bulk data: the payload lands in a buffer from `pool`
/// (no page faults for a buffer reused from an earlier message; comm/pool.rs).
/// `None` when the stream ended cleanly between frames.
pub fn read_frame_pooled(
    r: &mut impl Read,
    pool: &Arc<BufferPool>,
) -> Result<Option<(Header, PooledBuf)>, CommError> {
    let Some(header) = read_header(r)? else {
        return Ok(None);
    };
    if header.len > ALLOCATE_UP_FRONT {
        let payload = read_growing(r, &header)?;
        return Ok(Some((header, PooledBuf::unpooled(payload))));
    }
    let mut buf = pool.take(header.len as usize);
    let got = read_full(r, buf.as_mut_slice(), &format!("rank {}", header.source))?;
    if got < buf.len() {
        return Err(truncated(&header, got as u64));
    }
    Ok(Some((header, buf)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let h = Header {
            kind: Kind::Data,
            source: 3,
            tag: 0xdead_beef,
            len: payload.len() as u64,
        };
        write_frame(&mut out, &h, payload).unwrap();
        out
    }

    #[test]
    fn frames_round_trip() {
        let bytes = frame(b"hello");
        let mut r = &bytes[..];
        match read_frame(&mut r).unwrap() {
            ReadFrame::Frame(h, p) => {
                assert_eq!((h.source, h.tag, h.kind), (3, 0xdead_beef, Kind::Data));
                assert_eq!(p, b"hello");
            }
            ReadFrame::End => panic!("expected a frame"),
        }
        assert!(matches!(read_frame(&mut r).unwrap(), ReadFrame::End));
    }

    #[test]
    fn pooled_frames_round_trip_and_truncation_is_an_error() {
        let pool = BufferPool::new(16 << 20);
        let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let mut bytes = frame(&big);
        bytes.extend(frame(b"small"));
        let mut r = &bytes[..];
        let (h, p) = read_frame_pooled(&mut r, &pool).unwrap().expect("a frame");
        assert_eq!((h.source, h.tag), (3, 0xdead_beef));
        assert_eq!(p.as_ref(), &big[..]);
        drop(p);
        assert!(
            pool.held() > 0,
            "the big payload's buffer went back to the pool"
        );
        let (_, p) = read_frame_pooled(&mut r, &pool).unwrap().expect("a frame");
        assert_eq!(p.as_ref(), b"small");
        assert!(read_frame_pooled(&mut r, &pool).unwrap().is_none());
        // A reused buffer holds the last message: a truncated one must fail,
        // not deliver stale bytes.
        let short = &bytes[..HEADER_LEN + 1000];
        let err = read_frame_pooled(&mut &short[..], &pool)
            .err()
            .expect("an error");
        assert!(
            err.to_string().contains("1000 of 200000 payload bytes"),
            "{err}"
        );
    }

    #[test]
    fn truncated_and_corrupt_frames_are_errors() {
        let bytes = frame(&[7u8; 100]);
        for cut in [1, 20, HEADER_LEN, HEADER_LEN + 50, bytes.len() - 1] {
            let err = read_frame(&mut &bytes[..cut]).err().expect("an error");
            assert!(err.to_string().contains("truncated"), "cut {cut}: {err}");
        }
        for i in 0..HEADER_LEN {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(read_frame(&mut &bad[..]).is_err(), "flipped byte {i}");
        }
    }

    #[test]
    fn any_bytes_decode_without_panic_or_huge_allocation() {
        let mut s = 1u64;
        for _ in 0..20_000 {
            let mut buf = [0u8; 64];
            for b in buf.iter_mut() {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                *b = (s >> 56) as u8;
            }
            // Make many headers valid so the payload path is exercised too.
            if s.is_multiple_of(2) {
                let h = Header {
                    kind: Kind::Data,
                    source: 1,
                    tag: 2,
                    len: s >> 20,
                };
                buf[..HEADER_LEN].copy_from_slice(&h.encode());
            }
            let _ = read_frame(&mut &buf[..]);
        }
    }
}

/// The frame reader (also the rendezvous' framing) fed arbitrary and
/// mutated frames: it never panics and never trusts a length it has not
/// checked.
#[cfg(test)]
mod fuzz {
    use std::io::Cursor;

    use proptest::prelude::*;

    use super::{self as wire, Header, Kind, ReadFrame};
    use crate::fuzzing::{apply, cases, edit};

    proptest! {
        #![proptest_config(cases(2000))]

        #[test]
        fn wire_frames_from_arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut r = Cursor::new(&bytes[..]);
            // Read frames until the end or the first error.
            for _ in 0..8 {
                match wire::read_frame(&mut r) {
                    Ok(ReadFrame::Frame(h, p)) => prop_assert_eq!(p.len() as u64, h.len),
                    Ok(ReadFrame::End) | Err(_) => break,
                }
            }
        }

        #[test]
        fn mutated_valid_frames_are_read_or_refused(
            tag in any::<u64>(),
            payload in proptest::collection::vec(any::<u8>(), 0..128),
            edits in proptest::collection::vec(edit(), 1..4),
        ) {
            let h = Header { kind: Kind::Data, source: 3, tag, len: payload.len() as u64 };
            let mut bytes = Vec::new();
            wire::write_frame(&mut bytes, &h, &payload).unwrap();
            apply(&mut bytes, &edits);
            match wire::read_frame(&mut Cursor::new(&bytes[..])) {
                Ok(ReadFrame::Frame(h, p)) => {
                    // Anything accepted passed the header checksum and arrived whole.
                    prop_assert_eq!(p.len() as u64, h.len);
                    prop_assert!(h.len <= bytes.len() as u64);
                }
                Ok(ReadFrame::End) => prop_assert!(bytes.is_empty()),
                Err(_) => {}
            }
        }
    }
}
