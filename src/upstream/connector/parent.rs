//! A parent proxy: an upstream connection is a tunnel opened through it with HTTP CONNECT,
//! for http and https destinations alike. The parent itself is the operator's to choose, so
//! the address policy does not apply to it; it still applies to the final destination.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::ConnectError;
use crate::config::ParentProxy;

/// The longest response head accepted from the parent.
const MAX_HEAD: usize = 8 * 1024;

/// Opens a tunnel to `host:port` through `parent`.
pub(super) async fn tunnel(
    parent: &ParentProxy,
    host: &str,
    port: u16,
) -> Result<TcpStream, ConnectError> {
    let failed = |reason: String| ConnectError::Parent {
        parent: parent.to_string(),
        target: format!("{host}:{port}"),
        reason,
    };
    let mut stream = TcpStream::connect((parent.host.as_str(), parent.port))
        .await
        .map_err(|e| failed(format!("cannot connect to it: {e}")))?;
    let _ = stream.set_nodelay(true);
    let authority = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let mut request = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n");
    if let Some(credentials) = &parent.authorization {
        request.push_str(&format!("Proxy-Authorization: {credentials}\r\n"));
    }
    request.push_str("\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| failed(format!("the CONNECT could not be sent: {e}")))?;
    // Byte by byte: whatever follows the head belongs to the tunnel.
    let mut head = Vec::with_capacity(256);
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() >= MAX_HEAD {
            return Err(failed(format!(
                "its answer to CONNECT has a head over {MAX_HEAD} bytes"
            )));
        }
        let byte = stream.read_u8().await.map_err(|e| {
            failed(format!(
                "it closed the connection before answering CONNECT: {e}"
            ))
        })?;
        head.push(byte);
    }
    let status_line = String::from_utf8_lossy(&head)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    match status {
        200..=299 => Ok(stream),
        407 => Err(failed(format!(
            "it asks for credentials (`{status_line}`): put them in the URL, http://user:password@host:port"
        ))),
        _ => Err(failed(format!("it answered CONNECT with `{status_line}`"))),
    }
}
