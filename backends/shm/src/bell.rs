//! Bells: how one process wakes another that sleeps on its queues.
//!
//! Each mesh has one datagram socket in the abstract namespace (no file,
//! gone with the process). A peer rings it with one byte, only when the
//! sleeper armed its queue, so a busy pair sends no datagrams at all. A
//! task receives the rings and wakes the mesh's sleeping calls.

use std::{
    io,
    os::{linux::net::SocketAddrExt, unix::net::SocketAddr},
    sync::Arc,
};

use tokio::{net::UnixDatagram, sync::Notify, task::JoinHandle};

/// This mesh's bell: the socket peers ring, and the task that listens.
pub(crate) struct Bell {
    name: String,
    /// An unbound socket the rings go out on (non-blocking).
    out: std::os::unix::net::UnixDatagram,
    task: JoinHandle<()>,
}

impl Drop for Bell {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Bell {
    /// Binds a bell with a fresh name; rings wake `wake`.
    pub(crate) fn bind(wake: Arc<Notify>) -> io::Result<Bell> {
        let mut nonce = [0u8; 8];
        getrandom::fill(&mut nonce).map_err(|e| io::Error::other(e.to_string()))?;
        let name = format!(
            "consort-bell-{}-{:016x}",
            std::process::id(),
            u64::from_le_bytes(nonce)
        );
        let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
        let std = std::os::unix::net::UnixDatagram::bind_addr(&addr)?;
        std.set_nonblocking(true)?;
        let rx = UnixDatagram::from_std(std)?;
        let out = std::os::unix::net::UnixDatagram::unbound()?;
        out.set_nonblocking(true)?;
        let task = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            while rx.recv(&mut buf).await.is_ok() {
                wake.notify_waiters();
            }
        });
        Ok(Bell { name, out, task })
    }

    /// The name peers ring.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Rings the peer bell `to` (best effort: a full socket already holds
    /// a ring the peer has yet to take).
    pub(crate) fn ring(&self, to: &SocketAddr) {
        let _ = self.out.send_to_addr(&[1], to);
    }
}

/// The address of a peer's bell from its name.
pub(crate) fn address(name: &str) -> io::Result<SocketAddr> {
    if !name.starts_with("consort-bell-") || name.len() > 100 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{name:?} is not a bell name"),
        ));
    }
    SocketAddr::from_abstract_name(name.as_bytes())
}
