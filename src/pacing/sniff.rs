//! A look at the start of a response body, for a throttle marker or a bot wall's page in a
//! lockout status, without changing a byte of what the client receives.

use std::collections::VecDeque;
use std::io::Read;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::CONTENT_ENCODING;
use http::Response;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;

use crate::pacing::verdict::BODY_SNIFF_BYTES;
use crate::upstream::{BoxError, ProxyBody};

/// How long the start of a body may take to arrive. A body slower than this is not looked
/// at (the response keeps its verdict by status and headers) and still reaches the client.
const SNIFF_WAIT: Duration = Duration::from_secs(5);

/// Reads up to [`BODY_SNIFF_BYTES`] of `response`'s body and returns them decoded as its
/// `Content-Encoding` says (gzip, deflate, br). The response comes back with its body whole:
/// the bytes read, then the rest.
pub(super) async fn sniff(response: Response<ProxyBody>) -> (Response<ProxyBody>, Vec<u8>) {
    let (parts, mut body) = response.into_parts();
    let mut read: VecDeque<Frame<Bytes>> = VecDeque::new();
    let mut start: Vec<u8> = Vec::new();
    let mut failed: Option<BoxError> = None;
    let reading = async {
        while start.len() < BODY_SNIFF_BYTES {
            match body.frame().await {
                None => break,
                Some(Err(e)) => {
                    failed = Some(e);
                    break;
                }
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        start.extend_from_slice(data);
                    }
                    read.push_back(frame);
                }
            }
        }
    };
    // Out of time, the frames read so far are still handed on, then the rest.
    let _ = tokio::time::timeout(SNIFF_WAIT, reading).await;
    let encoding = parts
        .headers
        .get(CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let text = decoded(encoding, &start);
    let body = Prefixed {
        read,
        failed,
        rest: body,
    };
    (Response::from_parts(parts, body.boxed()), text)
}

/// The start of a body as text, decoded; an encoding not understood (or a stack of several)
/// leaves the bytes as they are. A prefix of a compressed stream decodes as far as it goes.
pub(super) fn decoded(encoding: &str, raw: &[u8]) -> Vec<u8> {
    let encoding = encoding.trim().to_ascii_lowercase();
    match encoding.as_str() {
        "gzip" | "x-gzip" => drain(flate2::read::MultiGzDecoder::new(raw)),
        // "deflate" is zlib-wrapped by the spec, and raw deflate from some servers.
        "deflate" => {
            let out = drain(flate2::read::ZlibDecoder::new(raw));
            if out.is_empty() {
                drain(flate2::read::DeflateDecoder::new(raw))
            } else {
                out
            }
        }
        "br" => drain(brotli_decompressor::Decompressor::new(raw, 4096)),
        _ => raw[..raw.len().min(BODY_SNIFF_BYTES)].to_vec(),
    }
}

/// What a decoder yields, up to [`BODY_SNIFF_BYTES`]. A truncated stream ends in an error
/// after the bytes it could decode; those are kept.
fn drain(reader: impl Read) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = reader.take(BODY_SNIFF_BYTES as u64).read_to_end(&mut out);
    out
}

/// A body whose first frames were already read: those, then an error met while reading them
/// if any, then the rest.
struct Prefixed {
    read: VecDeque<Frame<Bytes>>,
    failed: Option<BoxError>,
    rest: ProxyBody,
}

impl Body for Prefixed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(frame) = self.read.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if let Some(e) = self.failed.take() {
            return Poll::Ready(Some(Err(e)));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_empty() && self.failed.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let held: u64 = self
            .read
            .iter()
            .filter_map(|f| f.data_ref())
            .map(|d| d.len() as u64)
            .sum();
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + held);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + held);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pacing::verdict::body_has_marker;
    use http_body_util::{Full, StreamBody};
    use std::io::Write;

    const MARKER: &str = "You have exceeded a secondary rate limit";

    fn gzip(text: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(text).unwrap();
        e.finish().unwrap()
    }

    fn response(encoding: Option<&str>, chunks: Vec<Vec<u8>>) -> Response<ProxyBody> {
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, BoxError>(Frame::data(Bytes::from(c))));
        let body = StreamBody::new(futures_util::stream::iter(frames)).boxed();
        let mut r = Response::new(body);
        if let Some(e) = encoding {
            r.headers_mut().insert(CONTENT_ENCODING, e.parse().unwrap());
        }
        r
    }

    async fn all(r: Response<ProxyBody>) -> Vec<u8> {
        r.into_body().collect().await.unwrap().to_bytes().to_vec()
    }

    /// Sniffs `r`, and tells whether its start carries "rate limit".
    async fn marked(r: Response<ProxyBody>) -> (Response<ProxyBody>, bool) {
        let (r, text) = sniff(r).await;
        (r, body_has_marker(&text, &["rate limit".into()]))
    }

    #[tokio::test]
    async fn a_gzip_body_is_read_decoded_and_handed_on_unchanged() {
        let mut text = MARKER.as_bytes().to_vec();
        text.extend(std::iter::repeat_n(b'x', 100_000));
        let compressed = gzip(&text);
        let chunks: Vec<Vec<u8>> = compressed.chunks(1000).map(<[u8]>::to_vec).collect();
        let (r, marked) = marked(response(Some("gzip"), chunks)).await;
        assert!(marked);
        assert_eq!(all(r).await, compressed, "byte for byte");
    }

    #[tokio::test]
    async fn a_marker_past_the_first_8_kib_is_not_looked_for() {
        let mut text = vec![b'x'; 9000];
        text.extend_from_slice(MARKER.as_bytes());
        let (r, marked) = marked(response(None, vec![text.clone()])).await;
        assert!(!marked);
        assert_eq!(all(r).await, text);
    }

    #[tokio::test]
    async fn a_plain_body_without_a_marker_is_not_a_throttle() {
        let body = b"Resource not accessible by integration".to_vec();
        let (r, marked) = marked(response(None, vec![body.clone()])).await;
        assert!(!marked);
        assert_eq!(all(r).await, body);
    }

    #[tokio::test]
    async fn an_empty_body_stays_empty_and_keeps_its_size() {
        let body = Full::new(Bytes::new()).map_err(|n| match n {}).boxed();
        let (r, marked) = marked(Response::new(body)).await;
        assert!(!marked);
        assert!(r.body().is_end_stream());
        assert_eq!(r.body().size_hint().exact(), Some(0));
    }

    #[tokio::test]
    async fn an_error_in_the_body_still_reaches_the_client() {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
            Ok(Frame::data(Bytes::from_static(b"partial"))),
            Err("upstream reset".into()),
        ];
        let body = StreamBody::new(futures_util::stream::iter(frames)).boxed();
        let (r, _) = marked(Response::new(body)).await;
        let mut body = r.into_body();
        assert_eq!(
            body.frame().await.unwrap().unwrap().into_data().unwrap(),
            "partial"
        );
        assert!(body.frame().await.unwrap().is_err());
    }

    #[test]
    fn every_encoding_decodes_even_when_cut_short() {
        let text = format!("{MARKER}{}", "y".repeat(50_000));
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(text.as_bytes()).unwrap();
        let zlib = z.finish().unwrap();
        let mut d = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
        d.write_all(text.as_bytes()).unwrap();
        let raw_deflate = d.finish().unwrap();
        let mut br = Vec::new();
        {
            let mut w = brotli::CompressorWriter::new(&mut br, 4096, 5, 22);
            w.write_all(text.as_bytes()).unwrap();
        }
        for (encoding, bytes) in [
            ("gzip", gzip(text.as_bytes())),
            ("deflate", zlib),
            ("deflate", raw_deflate),
            ("br", br),
        ] {
            let cut = &bytes[..bytes.len().min(200)];
            let out = decoded(encoding, cut);
            assert!(out.starts_with(MARKER.as_bytes()), "{encoding}");
            assert!(out.len() <= BODY_SNIFF_BYTES, "{encoding}");
        }
        assert_eq!(decoded("gzip", b"not gzip at all"), b"");
        assert_eq!(decoded("zstd", b"as is"), b"as is");
    }
}
