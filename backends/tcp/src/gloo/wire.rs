//! Gloo's TCP transport on the wire: the 48-byte preamble of every message,
//! a pair's address, the rank record a rank publishes in the store, and
//! which side of a pair dials.
//!
//! Gloo copies C structs onto the socket as they lie in memory (`size_t`
//! fields, a `sockaddr_storage`), so every integer here is in the host's
//! byte order and `size_t` is 8 bytes: a 64-bit host speaks to 64-bit
//! hosts of the same endianness, as Gloo itself does. Written from
//! gloo/transport/tcp/{pair.h,address.cc,context.cc,device.cc}.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Bytes of a message preamble: six `size_t`.
pub const PREAMBLE_BYTES: usize = 48;
/// Bytes of a `sockaddr_storage` on Linux.
const SOCKADDR_BYTES: usize = 128;
/// Bytes of an encoded [`Address`]: the `sockaddr_storage` and an `ssize_t`
/// sequence number.
pub const ADDRESS_BYTES: usize = SOCKADDR_BYTES + 8;
const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

/// What a message is (`Op::Opcode` in gloo's pair.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opcode {
    /// A bound buffer's payload (not used by the collectives we speak).
    SendBuffer = 0,
    /// The payload of an unbound-buffer send: `length` bytes follow.
    SendUnboundBuffer = 1,
    /// "I have posted a send of `length` bytes on `slot`."
    NotifySendReady = 2,
    /// "I have posted a receive of up to `length` bytes on `slot`."
    NotifyRecvReady = 3,
}

/// A message header, as gloo's `Op::preamble`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preamble {
    /// Bytes of the whole message, this preamble included.
    pub nbytes: u64,
    /// The [`Opcode`], as sent.
    pub opcode: u64,
    /// The slot the message belongs to (`consort_comm::algo::gloo::slot`).
    pub slot: u64,
    /// Unused by unbound buffers (bound buffers' offset).
    pub offset: u64,
    /// Payload bytes (data) or the posted size (notifications).
    pub length: u64,
    /// Unused by unbound buffers (bound buffers' remote offset).
    pub roffset: u64,
}

impl Preamble {
    /// A header for `opcode` on `slot` with `length`: payload bytes follow
    /// only for [`Opcode::SendUnboundBuffer`].
    pub fn new(opcode: Opcode, slot: u64, length: usize) -> Self {
        let payload = if opcode == Opcode::SendUnboundBuffer {
            length as u64
        } else {
            0
        };
        Preamble {
            nbytes: PREAMBLE_BYTES as u64 + payload,
            opcode: opcode as u64,
            slot,
            offset: 0,
            length: length as u64,
            roffset: 0,
        }
    }

    /// The header's bytes.
    pub fn encode(&self) -> [u8; PREAMBLE_BYTES] {
        let mut out = [0u8; PREAMBLE_BYTES];
        let fields = [
            self.nbytes,
            self.opcode,
            self.slot,
            self.offset,
            self.length,
            self.roffset,
        ];
        for (chunk, v) in out.chunks_exact_mut(8).zip(fields) {
            chunk.copy_from_slice(&v.to_ne_bytes());
        }
        out
    }

    /// Reads a header; [`Preamble::opcode`] says whether it names an op we
    /// know.
    pub fn decode(bytes: &[u8; PREAMBLE_BYTES]) -> Self {
        let f = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            u64::from_ne_bytes(b)
        };
        Preamble {
            nbytes: f(0),
            opcode: f(1),
            slot: f(2),
            offset: f(3),
            length: f(4),
            roffset: f(5),
        }
    }

    /// The opcode, or `None` for one Gloo does not define.
    pub fn opcode(&self) -> Option<Opcode> {
        Some(match self.opcode {
            0 => Opcode::SendBuffer,
            1 => Opcode::SendUnboundBuffer,
            2 => Opcode::NotifySendReady,
            3 => Opcode::NotifyRecvReady,
            _ => return None,
        })
    }
}

/// A pair's address: where its device listens, and the sequence number
/// that names the pair to the listener (gloo's `tcp::Address`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Address {
    /// The device's listening socket.
    pub addr: SocketAddr,
    /// The pair's sequence number; -1 for the device itself.
    pub seq: i64,
}

impl Address {
    /// The address's 136 bytes (`sockaddr_storage` then the sequence).
    pub fn encode(&self) -> [u8; ADDRESS_BYTES] {
        let mut out = [0u8; ADDRESS_BYTES];
        match self.addr {
            SocketAddr::V4(a) => {
                out[0..2].copy_from_slice(&AF_INET.to_ne_bytes());
                out[2..4].copy_from_slice(&a.port().to_be_bytes());
                out[4..8].copy_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                out[0..2].copy_from_slice(&AF_INET6.to_ne_bytes());
                out[2..4].copy_from_slice(&a.port().to_be_bytes());
                out[4..8].copy_from_slice(&a.flowinfo().to_be_bytes());
                out[8..24].copy_from_slice(&a.ip().octets());
                out[24..28].copy_from_slice(&a.scope_id().to_ne_bytes());
            }
        }
        out[SOCKADDR_BYTES..].copy_from_slice(&self.seq.to_ne_bytes());
        out
    }

    /// Reads an address; `None` unless it is 136 bytes of IPv4 or IPv6.
    pub fn decode(bytes: &[u8]) -> Option<Address> {
        if bytes.len() != ADDRESS_BYTES {
            return None;
        }
        let family = u16::from_ne_bytes([bytes[0], bytes[1]]);
        let port = u16::from_be_bytes([bytes[2], bytes[3]]);
        let ip = match family {
            AF_INET => IpAddr::V4(Ipv4Addr::new(bytes[4], bytes[5], bytes[6], bytes[7])),
            AF_INET6 => {
                let mut o = [0u8; 16];
                o.copy_from_slice(&bytes[8..24]);
                IpAddr::V6(Ipv6Addr::from(o))
            }
            _ => return None,
        };
        let mut addr = SocketAddr::new(ip, port);
        if let SocketAddr::V6(a) = &mut addr {
            // A link-local address is only reachable through its scope.
            a.set_flowinfo(u32::from_be_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]));
            a.set_scope_id(u32::from_ne_bytes([
                bytes[24], bytes[25], bytes[26], bytes[27],
            ]));
        }
        let mut seq = [0u8; 8];
        seq.copy_from_slice(&bytes[SOCKADDR_BYTES..]);
        Some(Address {
            addr,
            seq: i64::from_ne_bytes(seq),
        })
    }
}

/// Whether the side at `local` dials `remote` (gloo's
/// `Device::isInitiator`): it compares the IP bytes, then the ports as the
/// host reads their network-order bytes, then the sequence numbers; the
/// greater side dials. `None` when the two are one address (a pair to
/// itself) or of different families.
pub fn is_initiator(local: &Address, remote: &Address) -> Option<bool> {
    let port = |a: &SocketAddr| i32::from(u16::from_ne_bytes(a.port().to_be_bytes()));
    let ord = match (local.addr.ip(), remote.addr.ip()) {
        (IpAddr::V4(a), IpAddr::V4(b)) => a.octets().cmp(&b.octets()),
        (IpAddr::V6(a), IpAddr::V6(b)) => a.octets().cmp(&b.octets()),
        _ => return None,
    };
    let rv = match ord {
        std::cmp::Ordering::Greater => 1,
        std::cmp::Ordering::Less => -1,
        std::cmp::Ordering::Equal => {
            let p = port(&local.addr) - port(&remote.addr);
            if p != 0 {
                i64::from(p)
            } else {
                // The peer's number: compared, never subtracted.
                local.seq.cmp(&remote.seq) as i64
            }
        }
    };
    (rv != 0).then_some(rv > 0)
}

/// What a rank publishes under its rank in the store (gloo's `tcp::Rank`):
/// its hostname, its device's address, and the sequence number of its pair
/// for each rank (one per rank, itself included).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankInfo {
    /// `gethostname()`.
    pub hostname: String,
    /// The device's listening address (sequence -1).
    pub device: Address,
    /// `pair_ids[r]`: the sequence number rank `r` must write when it
    /// dials this rank. Empty when ranks are their own sequence numbers
    /// (`GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER`).
    pub pair_ids: Vec<i64>,
}

impl RankInfo {
    /// The record's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let host = self.hostname.as_bytes();
        let mut out = Vec::with_capacity(16 + host.len() + ADDRESS_BYTES + 8 * self.pair_ids.len());
        out.extend_from_slice(&(host.len() as u64).to_ne_bytes());
        out.extend_from_slice(host);
        out.extend_from_slice(&(ADDRESS_BYTES as u64).to_ne_bytes());
        out.extend_from_slice(&self.device.encode());
        for id in &self.pair_ids {
            out.extend_from_slice(&id.to_ne_bytes());
        }
        out
    }

    /// Reads a record, or says what is wrong with it.
    pub fn decode(bytes: &[u8]) -> Result<RankInfo, String> {
        let mut at = 0usize;
        let mut take = |n: usize, what: &str| -> Result<&[u8], String> {
            let end = at
                .checked_add(n)
                .filter(|&e| e <= bytes.len())
                .ok_or_else(|| format!("the record ends inside its {what}"))?;
            let s = &bytes[at..end];
            at = end;
            Ok(s)
        };
        let len = |b: &[u8]| u64::from_ne_bytes(b.try_into().expect("8 bytes")) as usize;
        let host_len = len(take(8, "hostname length")?);
        let hostname = String::from_utf8_lossy(take(host_len, "hostname")?).into_owned();
        let addr_len = len(take(8, "address length")?);
        let device = Address::decode(take(addr_len, "address")?)
            .ok_or_else(|| format!("its address ({addr_len} bytes) is not an IPv4 or IPv6 one"))?;
        let rest = &bytes[at..];
        if !rest.len().is_multiple_of(8) {
            return Err(format!(
                "its {} bytes of pair numbers are not whole 8-byte numbers",
                rest.len()
            ));
        }
        let pair_ids = rest
            .chunks_exact(8)
            .map(|c| i64::from_ne_bytes(c.try_into().expect("8 bytes")))
            .collect();
        Ok(RankInfo {
            hostname,
            device,
            pair_ids,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_greater_address_dials() {
        let a = |ip: &str, port: u16, seq: i64| Address {
            addr: SocketAddr::new(ip.parse().unwrap(), port),
            seq,
        };
        // IP bytes first.
        assert_eq!(
            is_initiator(&a("10.0.0.2", 1, 0), &a("10.0.0.1", 9, 0)),
            Some(true)
        );
        // Then the port as the host reads its network-order bytes: on a
        // little-endian host 256 (bytes 01 00) reads as 1 and 1 (00 01) as
        // 256, so 1 > 256.
        if cfg!(target_endian = "little") {
            assert_eq!(
                is_initiator(&a("10.0.0.1", 1, 0), &a("10.0.0.1", 256, 0)),
                Some(true)
            );
        }
        // Then the sequence number.
        assert_eq!(is_initiator(&a("::1", 7, 2), &a("::1", 7, 1)), Some(true));
        assert_eq!(is_initiator(&a("::1", 7, 1), &a("::1", 7, 1)), None);
        assert_eq!(is_initiator(&a("::1", 7, 1), &a("127.0.0.1", 7, 1)), None);
        // Extreme sequence numbers from a peer do not overflow.
        assert_eq!(
            is_initiator(&a("::1", 7, i64::MIN), &a("::1", 7, i64::MAX)),
            Some(false)
        );
    }

    proptest! {
        #[test]
        fn records_round_trip(host in "[a-z0-9.-]{0,40}", v6 in any::<bool>(), port in any::<u16>(),
                              ids in proptest::collection::vec(any::<i64>(), 0..9)) {
            let ip: IpAddr = if v6 { "fe80::1".parse().unwrap() } else { "192.168.1.7".parse().unwrap() };
            let info = RankInfo {
                hostname: host,
                device: Address { addr: SocketAddr::new(ip, port), seq: -1 },
                pair_ids: ids,
            };
            prop_assert_eq!(RankInfo::decode(&info.encode()), Ok(info));
        }

        #[test]
        fn any_bytes_decode_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = RankInfo::decode(&bytes);
            if bytes.len() >= PREAMBLE_BYTES {
                let p = Preamble::decode(bytes[..PREAMBLE_BYTES].try_into().unwrap());
                prop_assert_eq!(Preamble::decode(&p.encode()), p);
            }
        }
    }
}
