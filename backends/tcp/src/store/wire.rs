//! The TCPStore wire format: command codes, reply codes, and the encoders
//! and decoders that the client and the server share.

use tokio::io::{AsyncRead, AsyncReadExt};

/// The magic number a client sends in its first message (VALIDATE).
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// Command bytes (torch's `QueryType`).
pub(crate) mod cmd {
    pub(crate) const VALIDATE: u8 = 0;
    pub(crate) const SET: u8 = 1;
    pub(crate) const COMPARE_SET: u8 = 2;
    pub(crate) const GET: u8 = 3;
    pub(crate) const ADD: u8 = 4;
    pub(crate) const CHECK: u8 = 5;
    pub(crate) const WAIT: u8 = 6;
    pub(crate) const GETNUMKEYS: u8 = 7;
    pub(crate) const DELETE_KEY: u8 = 8;
    pub(crate) const APPEND: u8 = 9;
    pub(crate) const MULTI_GET: u8 = 10;
    pub(crate) const MULTI_SET: u8 = 11;
    pub(crate) const CANCEL_WAIT: u8 = 12;
    pub(crate) const PING: u8 = 13;
    pub(crate) const QUEUE_PUSH: u8 = 14;
    pub(crate) const QUEUE_POP: u8 = 15;
    pub(crate) const QUEUE_LEN: u8 = 16;
    pub(crate) const LIST_KEYS: u8 = 17;
    pub(crate) const BARRIER: u8 = 18;
}

/// CHECK replies (torch's `CheckResponseType`).
pub(crate) const CHECK_READY: u8 = 0;
pub(crate) const CHECK_NOT_READY: u8 = 1;
/// WAIT and CANCEL_WAIT replies (torch's `WaitResponseType`).
pub(crate) const STOP_WAITING: u8 = 0;
pub(crate) const WAIT_CANCELED: u8 = 1;

/// Appends a length-prefixed byte string.
pub(crate) fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u64).to_le_bytes());
    buf.extend_from_slice(b);
}

/// Appends a count followed by length-prefixed keys.
pub(crate) fn put_keys<K: AsRef<[u8]>>(buf: &mut Vec<u8>, keys: &[K]) {
    buf.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for k in keys {
        put_bytes(buf, k.as_ref());
    }
}

/// Why a peer's bytes were refused.
#[derive(Debug)]
pub(crate) enum ReadError {
    Io(std::io::Error),
    TooLarge {
        what: &'static str,
        len: u64,
        max: u64,
    },
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        ReadError::Io(e)
    }
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::TooLarge { what, len, max } => {
                write!(f, "{what} of {len} bytes is over the limit of {max}")
            }
        }
    }
}

/// Reads a length-prefixed byte string of at most `max` bytes, refusing
/// larger ones before allocating.
pub(crate) async fn read_bytes<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u64,
    what: &'static str,
) -> Result<Vec<u8>, ReadError> {
    let len = r.read_u64_le().await?;
    if len > max {
        return Err(ReadError::TooLarge { what, len, max });
    }
    let mut v = vec![0u8; len as usize];
    r.read_exact(&mut v).await?;
    Ok(v)
}
