//! What a client speaks inside a CONNECT tunnel: TLS (a handshake record first) or plain
//! HTTP. Clients that tunnel every request through their proxy, `http://` ones included
//! (undici's `ProxyAgent`, which Node's `EnvHttpProxyAgent` uses), send plain HTTP after
//! CONNECT; intercepting those as TLS would fail them.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

/// A stream with its first byte read ahead and handed back first.
pub(super) struct Peeked<T> {
    first: Option<u8>,
    inner: T,
}

impl<T: AsyncRead + Unpin> Peeked<T> {
    /// Reads the first byte the client sends.
    pub(super) async fn read(mut inner: T) -> io::Result<Self> {
        let first = inner.read_u8().await?;
        Ok(Self {
            first: Some(first),
            inner,
        })
    }

    /// Whether the client opened with a TLS handshake.
    pub(super) fn is_tls(&self) -> bool {
        self.first == Some(TLS_HANDSHAKE)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Peeked<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(byte) = self.first.take() {
            buf.put_slice(&[byte]);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Peeked<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn the_first_byte_is_read_ahead_and_handed_back() {
        let (mut client, server) = tokio::io::duplex(64);
        client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        let mut peeked = Peeked::read(server).await.unwrap();
        assert!(!peeked.is_tls());
        let mut line = vec![0; 16];
        peeked.read_exact(&mut line).await.unwrap();
        assert_eq!(line, b"GET / HTTP/1.1\r\n");

        let (mut client, server) = tokio::io::duplex(64);
        client.write_all(&[0x16, 0x03, 0x01]).await.unwrap();
        assert!(Peeked::read(server).await.unwrap().is_tls());
    }
}
