//! `CONSORT_SECRET`: mutual HMAC-SHA256 challenge-response at the start of
//! every connection, data and store alike.
//!
//! Without a secret, the ports are open to anyone who can reach them, as
//! with torch: anyone can read the store and inject frames. With one, a
//! peer must prove it knows the secret before a single frame or store
//! request is read from it, and it learns that we know it too.
//!
//! The exchange, after the TCP connection is up (`A` accepts, `C` dials):
//!
//! 1. `A → C`: 32 random bytes `na`.
//! 2. `C → A`: 32 random bytes `nc`, then `HMAC(k, "consort-c" ‖ na ‖ nc)`.
//! 3. `A` checks it (in constant time), then `A → C`:
//!    `HMAC(k, "consort-a" ‖ nc ‖ na)`, which `C` checks.

use std::{fmt, io, time::Duration};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const NONCE: usize = 32;
const TAG: usize = 32;
/// How long a handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A shared secret. Its `Debug` output never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// A secret from bytes (any length; an empty secret is refused).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Option<Self> {
        let b = bytes.into();
        (!b.is_empty()).then_some(Secret(b))
    }

    /// `CONSORT_SECRET`, if set and non-empty.
    pub fn from_env() -> Option<Self> {
        std::env::var("CONSORT_SECRET")
            .ok()
            .and_then(|s| Secret::new(s.into_bytes()))
    }

    fn tag(&self, label: &[u8], first: &[u8], second: &[u8]) -> Hmac<Sha256> {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(label);
        m.update(first);
        m.update(second);
        m
    }
}

fn nonce() -> io::Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n)
        .map_err(|e| io::Error::other(format!("no randomness for the handshake: {e}")))?;
    Ok(n)
}

fn refused() -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        "authentication failed: the peer does not know CONSORT_SECRET (or uses another one)",
    )
}

/// The accepting side of the handshake.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &Secret,
) -> io::Result<()> {
    let na = nonce()?;
    s.write_all(&na).await?;
    let mut msg = [0u8; NONCE + TAG];
    s.read_exact(&mut msg).await?;
    let (nc, tag) = msg.split_at(NONCE);
    secret
        .tag(b"consort-c", &na, nc)
        .verify_slice(tag)
        .map_err(|_| refused())?;
    let reply = secret.tag(b"consort-a", nc, &na).finalize().into_bytes();
    s.write_all(&reply).await
}

/// The dialing side of the handshake.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &Secret,
) -> io::Result<()> {
    let mut na = [0u8; NONCE];
    s.read_exact(&mut na).await?;
    let nc = nonce()?;
    let tag = secret.tag(b"consort-c", &na, &nc).finalize().into_bytes();
    let mut msg = Vec::with_capacity(NONCE + TAG);
    msg.extend_from_slice(&nc);
    msg.extend_from_slice(&tag);
    s.write_all(&msg).await?;
    let mut reply = [0u8; TAG];
    s.read_exact(&mut reply).await?;
    secret
        .tag(b"consort-a", &nc, &na)
        .verify_slice(&reply)
        .map_err(|_| refused())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair(a: Option<Secret>, c: Option<Secret>) -> (io::Result<()>, io::Result<()>) {
        let (mut x, mut y) = tokio::io::duplex(256);
        let sa = a.clone();
        let acc = tokio::spawn(async move {
            match sa {
                Some(s) => accept(&mut x, &s).await,
                None => Ok(()),
            }
        });
        let con = match c {
            Some(s) => tokio::time::timeout(Duration::from_secs(2), connect(&mut y, &s))
                .await
                .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into())),
            None => {
                // No secret: behaves like a stranger that sends junk.
                let _ = y.write_all(&[0u8; 64]).await;
                Ok(())
            }
        };
        drop(y);
        (acc.await.unwrap(), con)
    }

    #[tokio::test]
    async fn same_secret_passes_both_ways() {
        let s = Secret::new(b"hunter2".to_vec());
        let (a, c) = pair(s.clone(), s).await;
        a.unwrap();
        c.unwrap();
    }

    #[tokio::test]
    async fn a_wrong_or_missing_secret_is_refused() {
        let (a, _) = pair(
            Secret::new(b"right".to_vec()),
            Secret::new(b"wrong".to_vec()),
        )
        .await;
        assert_eq!(a.unwrap_err().kind(), io::ErrorKind::PermissionDenied);
        // A stranger that sends junk and hangs up is refused one way or
        // another (bad tag, or a broken pipe before it could be checked).
        let (a, _) = pair(Secret::new(b"right".to_vec()), None).await;
        assert!(a.is_err());
    }

    #[test]
    fn secrets_do_not_print_and_cannot_be_empty() {
        assert_eq!(
            format!("{:?}", Secret::new(b"x".to_vec()).unwrap()),
            "Secret(..)"
        );
        assert!(Secret::new(Vec::new()).is_none());
    }
}
