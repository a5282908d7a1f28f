//! [`TcpWrite`]: a stream's write half whose shutdown is a graceful close.
//!
//! A call ends once its last frame is in the kernel's send buffer, not once
//! the peer has it. Closing a socket then is safe only while nothing comes
//! in: a closed socket answers any later segment (a probe, an abort, the
//! peer's next call) with a reset, and a reset throws away what its send
//! buffer still held, so the peer, still reading, would lose the end of
//! that frame. Shutting down through [`TcpWrite`] therefore sends the FIN
//! after the data and then waits until the peer has acknowledged every
//! byte of it; the driver keeps reading meanwhile, and closes after.

use std::{
    io::IoSlice,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};

use tokio::{io::AsyncWrite, net::tcp::OwnedWriteHalf};

/// How often a shutdown looks at the send queue.
const POLL_EVERY: Duration = Duration::from_millis(1);

/// A TCP write half whose `poll_shutdown` sends the FIN and then resolves
/// only once the peer has acknowledged everything written (or the
/// connection is gone).
pub(crate) struct TcpWrite {
    w: OwnedWriteHalf,
    fin_sent: bool,
    tick: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl TcpWrite {
    pub(crate) fn new(w: OwnedWriteHalf) -> Self {
        TcpWrite {
            w,
            fin_sent: false,
            tick: None,
        }
    }
}

impl AsyncWrite for TcpWrite {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.w).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.w).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.w.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.w).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let me = &mut *self;
        if !me.fin_sent {
            ready!(Pin::new(&mut me.w).poll_shutdown(cx))?;
            me.fin_sent = true;
        }
        loop {
            if unacknowledged(&me.w)? == 0 {
                return Poll::Ready(Ok(()));
            }
            let tick = me
                .tick
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(POLL_EVERY)));
            ready!(tick.as_mut().poll(cx));
            me.tick = None;
        }
    }
}

/// Bytes written to `w` that the peer has not yet acknowledged (0 once the
/// connection is closed or reset: nothing more will be acknowledged).
#[cfg(target_os = "linux")]
fn unacknowledged(w: &OwnedWriteHalf) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let fd = w.as_ref().as_raw_fd();
    // SAFETY: `fd` is this stream's open socket for the call; TCP_INFO fills
    // at most `len` bytes of `info`, and SIOCOUTQ writes one c_int.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let got = libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        );
        if got != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // TCP_CLOSE: reset, or closed both ways; nothing is owed.
        if info.tcpi_state == 7 {
            return Ok(0);
        }
        let mut queued: libc::c_int = 0;
        if libc::ioctl(fd, libc::TIOCOUTQ, &mut queued) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(queued.max(0) as usize)
    }
}

/// Elsewhere the FIN is all a shutdown waits for.
#[cfg(not(target_os = "linux"))]
fn unacknowledged(_: &OwnedWriteHalf) -> std::io::Result<usize> {
    Ok(0)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
    };

    use super::TcpWrite;

    /// Shutdown waits while the peer reads nothing, and ends once it has
    /// read everything (real sockets on loopback, small buffers).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shutdown_waits_until_the_peer_has_acknowledged_every_byte() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (client, server) = tokio::join!(TcpStream::connect(addr), l.accept());
        let (client, (mut server, _)) = (client.unwrap(), server.unwrap());
        socket2::SockRef::from(&server)
            .set_recv_buffer_size(64 << 10)
            .unwrap();
        let (_r, w) = client.into_split();
        let mut w = TcpWrite::new(w);
        // More than the peer's receive window: some of it stays queued here.
        let data = vec![7u8; 16 << 20];
        let mut sent = 0;
        while sent < data.len() {
            match tokio::time::timeout(Duration::from_millis(50), w.write(&data[sent..])).await {
                Ok(n) => sent += n.unwrap(),
                Err(_) => break,
            }
        }
        assert!(sent > 0);
        let early = tokio::time::timeout(Duration::from_millis(200), w.shutdown()).await;
        assert!(
            early.is_err(),
            "shutdown ended with the peer reading nothing"
        );
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            server.read_to_end(&mut got).await.map(|_| got.len())
        });
        tokio::time::timeout(Duration::from_secs(10), w.shutdown())
            .await
            .expect("shutdown once the peer reads")
            .unwrap();
        assert_eq!(reader.await.unwrap().unwrap(), sent);
    }
}
