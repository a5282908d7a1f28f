//! consort's wire frame header: the fixed 56-byte header that precedes every
//! payload a CPU backend sends, and its never-panicking decoder.
//!
//! This module owns the byte layout and its validation. It does not own
//! sockets, buffering or retries; a driver reads [`HEADER_LEN`] bytes, calls
//! [`FrameHeader::decode`], then reads `payload_len` bytes.
//!
//! # Layout (version 2, little-endian)
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `b"CSRT"` |
//! | 4 | 1 | version (2) |
//! | 5 | 1 | kind ([`FrameKind`]) |
//! | 6 | 2 | flags (none defined yet: must be 0) |
//! | 8 | 4 | group id |
//! | 12 | 4 | root |
//! | 16 | 8 | seq |
//! | 24 | 8 | count (elements in the call) |
//! | 32 | 1 | op ([`OpKind`] code) |
//! | 33 | 1 | dtype ([`DType`] code) |
//! | 34 | 1 | reduce op (c10d code, 0xFF for none) |
//! | 35 | 1 | reserved (must be 0) |
//! | 36 | 4 | tag (the schedule's step tag) |
//! | 40 | 8 | offset (first element of the payload in the call's buffer) |
//! | 48 | 8 | payload length in bytes |

use crate::{DType, Fingerprint, GroupId, OpKind, ReduceOp};

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"CSRT";
/// The header version this code writes and reads.
pub const VERSION: u8 = 2;
/// Size of the header in bytes.
pub const HEADER_LEN: usize = 56;
/// Largest payload of an [`FrameKind::Abort`] message.
pub const MAX_ABORT_MESSAGE: u64 = 64 * 1024;

const NO_REDUCE_OP: u8 = 0xFF;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Elements of a collective's buffer.
    Data = 0,
    /// The sender's group failed; the payload is its UTF-8 error message.
    Abort = 1,
    /// A stalled call asks the peer which call it is in (no payload); the
    /// fingerprint is the asker's call.
    Probe = 2,
    /// The answer to a [`FrameKind::Probe`] (no payload): the fingerprint
    /// of the call the peer is in at that group and seq, or op `NewGroup`
    /// when it is in none.
    ProbeReply = 3,
    /// Elements the receiver reads itself from the sender's memory (same
    /// host, CMA): instead of the payload, 8 bytes follow with its address
    /// in the sender's process; `payload_len` is the payload's length. The
    /// sender keeps those bytes unchanged until the receiver says it has
    /// read them.
    Pull = 4,
}

/// Limits the decoder enforces, so that a peer cannot make us allocate
/// without bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// The largest data payload accepted, in bytes.
    pub max_payload: u64,
}

impl Default for FrameLimits {
    /// 256 MiB: larger than any segment a schedule sends.
    fn default() -> Self {
        FrameLimits {
            max_payload: 256 << 20,
        }
    }
}

/// Why a header was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Fewer bytes than a header; read more and try again.
    #[error("truncated frame header: have {have} of {HEADER_LEN} bytes")]
    Truncated {
        /// Bytes available.
        have: usize,
    },
    /// The first four bytes are not [`MAGIC`].
    #[error("bad magic {0:02x?}: the peer is not speaking consort's frame protocol")]
    BadMagic([u8; 4]),
    /// A version this build does not read.
    #[error("frame version {0} is not supported (this build reads version {VERSION})")]
    UnsupportedVersion(u8),
    /// A field holds a value no version-1 sender writes.
    #[error("bad {field} field: {value}")]
    BadField {
        /// The field.
        field: &'static str,
        /// The raw value.
        value: u64,
    },
    /// The payload is larger than the configured limit.
    #[error("payload of {len} bytes exceeds the limit of {max} bytes")]
    PayloadTooLarge {
        /// Announced payload length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The lengths contradict each other.
    #[error("inconsistent lengths: {0}")]
    Inconsistent(&'static str),
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame carries.
    pub kind: FrameKind,
    /// The call this frame belongs to.
    pub fingerprint: Fingerprint,
    /// The schedule's step tag.
    pub tag: u32,
    /// First element of the payload within the call's buffer.
    pub offset: u64,
    /// Payload length in bytes.
    pub payload_len: u64,
    /// Flags (none are defined yet; a decoded header has 0).
    pub flags: u16,
}

impl FrameHeader {
    /// A data frame header for `payload_len` bytes on the stream.
    pub fn data(fingerprint: Fingerprint, tag: u32, offset: u64, payload_len: u64) -> Self {
        FrameHeader {
            kind: FrameKind::Data,
            fingerprint,
            tag,
            offset,
            payload_len,
            flags: 0,
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let f = &self.fingerprint;
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&f.group.0.to_le_bytes());
        b[12..16].copy_from_slice(&f.root.to_le_bytes());
        b[16..24].copy_from_slice(&f.seq.to_le_bytes());
        b[24..32].copy_from_slice(&f.count.to_le_bytes());
        b[32] = f.op.code();
        b[33] = f.dtype.code();
        b[34] = f.reduce_op.map_or(NO_REDUCE_OP, ReduceOp::code);
        // 35 reserved: zero
        b[36..40].copy_from_slice(&self.tag.to_le_bytes());
        b[40..48].copy_from_slice(&self.offset.to_le_bytes());
        b[48..56].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Decodes and validates a header from the start of `buf`. Never panics;
    /// every malformed input is an error.
    pub fn decode(buf: &[u8], limits: &FrameLimits) -> Result<FrameHeader, FrameError> {
        let Some(b) = buf.get(..HEADER_LEN) else {
            return Err(FrameError::Truncated { have: buf.len() });
        };
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if b[4] != VERSION {
            return Err(FrameError::UnsupportedVersion(b[4]));
        }
        let kind = match b[5] {
            0 => FrameKind::Data,
            1 => FrameKind::Abort,
            2 => FrameKind::Probe,
            3 => FrameKind::ProbeReply,
            4 => FrameKind::Pull,
            v => return Err(bad("kind", v.into())),
        };
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let flags = u16_at(6);
        if flags != 0 {
            return Err(bad("flags", flags.into()));
        }
        if b[35] != 0 {
            return Err(bad("reserved", b[35].into()));
        }
        let op = OpKind::from_code(b[32]).ok_or(bad("op", b[32].into()))?;
        let dtype = DType::from_code(b[33]).ok_or(bad("dtype", b[33].into()))?;
        let reduce_op = match b[34] {
            NO_REDUCE_OP => None,
            c => Some(ReduceOp::from_code(c).ok_or(bad("reduce_op", c.into()))?),
        };
        let count = u64_at(24);
        let offset = u64_at(40);
        let payload_len = u64_at(48);
        check_payload(kind, dtype, payload_len, limits)?;
        Ok(FrameHeader {
            kind,
            fingerprint: Fingerprint {
                group: GroupId(u32_at(8)),
                seq: u64_at(16),
                op,
                dtype,
                count,
                root: u32_at(12),
                reduce_op,
            },
            tag: u32_at(36),
            offset,
            payload_len,
            flags,
        })
    }
}

/// The payload length a header of `kind` may announce: within `limits`, a
/// whole number of `dtype` elements (data); none (probes); a bounded
/// message (aborts).
fn check_payload(
    kind: FrameKind,
    dtype: DType,
    payload_len: u64,
    limits: &FrameLimits,
) -> Result<(), FrameError> {
    match kind {
        FrameKind::Data | FrameKind::Pull => {
            if payload_len > limits.max_payload {
                return Err(FrameError::PayloadTooLarge {
                    len: payload_len,
                    max: limits.max_payload,
                });
            }
            let size = dtype.size_bytes() as u64;
            if !payload_len.is_multiple_of(size) {
                return Err(FrameError::Inconsistent(
                    "payload is not a whole number of elements",
                ));
            }
            // The receiver checks the length against the range it
            // posted (`count` is the fingerprint's; all_to_all leaves
            // it at 0).
        }
        FrameKind::Probe | FrameKind::ProbeReply => {
            if payload_len != 0 {
                return Err(FrameError::Inconsistent("a probe carries no payload"));
            }
        }
        FrameKind::Abort => {
            if payload_len > MAX_ABORT_MESSAGE {
                return Err(FrameError::PayloadTooLarge {
                    len: payload_len,
                    max: MAX_ABORT_MESSAGE,
                });
            }
        }
    }
    Ok(())
}

fn bad(field: &'static str, value: u64) -> FrameError {
    FrameError::BadField { field, value }
}

/// What a failed rank tells its peers in an [`FrameKind::Abort`] payload:
/// enough to rebuild the error's kind (so a mismatch is a `Mismatch`, a
/// lost peer a `PeerLost`, on every rank) plus its message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AbortInfo {
    /// The sender saw a mismatch with `remote` (called on `remote_rank`).
    Mismatch {
        /// The differing fingerprint.
        remote: Fingerprint,
        /// The rank that called it.
        remote_rank: u32,
        /// The sender's error message.
        message: String,
    },
    /// The sender lost `peer`.
    PeerLost {
        /// The lost rank.
        peer: u32,
        /// The sender's error message.
        message: String,
    },
    /// The sender timed out.
    Timeout {
        /// The sender's error message.
        message: String,
    },
    /// Anything else.
    Other {
        /// The sender's error message.
        message: String,
    },
}

impl AbortInfo {
    /// What the aborting rank said, as it said it.
    pub fn message(&self) -> &str {
        let (AbortInfo::Mismatch { message, .. }
        | AbortInfo::PeerLost { message, .. }
        | AbortInfo::Timeout { message }
        | AbortInfo::Other { message }) = self;
        message
    }

    /// Encodes as an abort payload (at most [`MAX_ABORT_MESSAGE`] bytes).
    pub fn encode(&self) -> Vec<u8> {
        let (kind, rank, fp, message) = match self {
            AbortInfo::Mismatch {
                remote,
                remote_rank,
                message,
            } => (1u8, *remote_rank, Some(remote), message),
            AbortInfo::PeerLost { peer, message } => (2, *peer, None, message),
            AbortInfo::Timeout { message } => (3, 0, None, message),
            AbortInfo::Other { message } => (0, 0, None, message),
        };
        let mut v = vec![kind];
        v.extend_from_slice(&rank.to_le_bytes());
        if let Some(fp) = fp {
            let h = FrameHeader {
                kind: FrameKind::Data,
                fingerprint: *fp,
                tag: 0,
                offset: 0,
                payload_len: 0,
                flags: 0,
            };
            v.extend_from_slice(&h.encode());
        }
        let room = MAX_ABORT_MESSAGE as usize - v.len();
        let mut end = message.len().min(room);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        v.extend_from_slice(&message.as_bytes()[..end]);
        v
    }

    /// Decodes an abort payload; never panics.
    pub fn decode(b: &[u8]) -> Result<AbortInfo, FrameError> {
        let (&kind, rest) = b.split_first().ok_or(FrameError::Truncated { have: 0 })?;
        let r = rest
            .get(..4)
            .ok_or(FrameError::Truncated { have: b.len() })?;
        let rank = u32::from_le_bytes([r[0], r[1], r[2], r[3]]);
        let rest = &rest[4..];
        let text = |t: &[u8]| String::from_utf8_lossy(t).into_owned();
        Ok(match kind {
            1 => {
                let h = FrameHeader::decode(rest, &FrameLimits { max_payload: 0 })?;
                AbortInfo::Mismatch {
                    remote: h.fingerprint,
                    remote_rank: rank,
                    message: text(&rest[HEADER_LEN..]),
                }
            }
            2 => AbortInfo::PeerLost {
                peer: rank,
                message: text(rest),
            },
            3 => AbortInfo::Timeout {
                message: text(rest),
            },
            0 => AbortInfo::Other {
                message: text(rest),
            },
            k => return Err(bad("abort kind", k.into())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header() -> impl Strategy<Value = FrameHeader> {
        (
            any::<u32>(),
            any::<u64>(),
            prop::sample::select(OpKind::ALL.to_vec()),
            prop::sample::select(DType::ALL.to_vec()),
            0u64..1 << 40,
            any::<u32>(),
            prop::option::of(prop::sample::select(ReduceOp::ALL.to_vec())),
            any::<u32>(),
            0u64..1 << 20,
        )
            .prop_map(|(group, seq, op, dtype, count, root, reduce_op, tag, n)| {
                let n = n.min(count);
                FrameHeader {
                    kind: FrameKind::Data,
                    fingerprint: Fingerprint {
                        group: GroupId(group),
                        seq,
                        op,
                        dtype,
                        count,
                        root,
                        reduce_op,
                    },
                    tag,
                    offset: count - n,
                    payload_len: n * dtype.size_bytes() as u64,
                    flags: 0,
                }
            })
    }

    proptest! {
        #[test]
        fn round_trips(h in header()) {
            let limits = FrameLimits { max_payload: u64::MAX };
            prop_assert_eq!(FrameHeader::decode(&h.encode(), &limits), Ok(h));
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = FrameHeader::decode(&bytes, &FrameLimits::default());
        }

        #[test]
        fn valid_prefix_with_random_tail_never_panics(
            tail in proptest::collection::vec(any::<u8>(), 0..60)
        ) {
            let mut bytes = MAGIC.to_vec();
            bytes.push(VERSION);
            bytes.extend(tail);
            let _ = FrameHeader::decode(&bytes, &FrameLimits::default());
        }

        #[test]
        fn every_truncation_is_an_error(h in header(), cut in 0usize..HEADER_LEN) {
            let bytes = h.encode();
            prop_assert_eq!(
                FrameHeader::decode(&bytes[..cut], &FrameLimits::default()),
                Err(FrameError::Truncated { have: cut })
            );
        }

        #[test]
        fn every_single_bit_flip_decodes_or_errors(h in header(), bit in 0usize..HEADER_LEN * 8) {
            let mut bytes = h.encode();
            bytes[bit / 8] ^= 1 << (bit % 8);
            let limits = FrameLimits { max_payload: u64::MAX };
            if let Ok(d) = FrameHeader::decode(&bytes, &limits) {
                prop_assert_eq!(d.encode(), bytes);
            }
        }
    }

    #[test]
    fn oversized_payloads_are_rejected_before_allocation() {
        let mut h = FrameHeader {
            kind: FrameKind::Data,
            fingerprint: Fingerprint {
                group: GroupId::WORLD,
                seq: 0,
                op: OpKind::AllReduce,
                dtype: DType::U8,
                count: u64::MAX,
                root: 0,
                reduce_op: Some(ReduceOp::Sum),
            },
            tag: 0,
            offset: 0,
            payload_len: 1 << 40,
            flags: 0,
        };
        let e = FrameHeader::decode(&h.encode(), &FrameLimits::default()).unwrap_err();
        assert!(matches!(e, FrameError::PayloadTooLarge { .. }), "{e}");
        h.kind = FrameKind::Abort;
        h.payload_len = MAX_ABORT_MESSAGE + 1;
        assert!(FrameHeader::decode(&h.encode(), &FrameLimits::default()).is_err());
    }

    #[test]
    fn partial_elements_are_rejected() {
        let mut h = FrameHeader {
            kind: FrameKind::Data,
            fingerprint: Fingerprint {
                group: GroupId::WORLD,
                seq: 0,
                op: OpKind::Broadcast,
                dtype: DType::F32,
                count: 4,
                root: 0,
                reduce_op: None,
            },
            tag: 0,
            offset: 2,
            payload_len: 6,
            flags: 0,
        };
        let l = FrameLimits::default();
        assert_eq!(
            FrameHeader::decode(&h.encode(), &l),
            Err(FrameError::Inconsistent(
                "payload is not a whole number of elements"
            ))
        );
        h.payload_len = 8;
        assert!(FrameHeader::decode(&h.encode(), &l).is_ok());
    }
    #[test]
    fn abort_info_round_trips_and_never_panics() {
        let fp = Fingerprint {
            group: GroupId(7),
            seq: 9,
            op: OpKind::AllGather,
            dtype: DType::BF16,
            count: 3,
            root: 0,
            reduce_op: None,
        };
        for a in [
            AbortInfo::Mismatch {
                remote: fp,
                remote_rank: 4,
                message: "m".into(),
            },
            AbortInfo::PeerLost {
                peer: 2,
                message: "gone".into(),
            },
            AbortInfo::Timeout {
                message: "slow".into(),
            },
        ] {
            assert_eq!(AbortInfo::decode(&a.encode()).unwrap(), a);
        }
        let long = AbortInfo::Other {
            message: "é".repeat(70_000),
        };
        assert!(long.encode().len() as u64 <= MAX_ABORT_MESSAGE);
        assert!(AbortInfo::decode(&long.encode()).is_ok());
        for cut in 0..8 {
            let _ = AbortInfo::decode(&[1, 0, 0, 0, 0, 0, 0, 0][..cut]);
        }
        assert!(AbortInfo::decode(&[9, 0, 0, 0, 0]).is_err());
    }
}
