//! Which upstream a request goes to, as the connections' table keys it: the scheme and the
//! authority with its port, read from the request's URI without a copy on the request path.

use http::uri::Authority;
use http::Uri;

/// An upstream as the table keys its connections: whether https, and the authority with its port.
/// Compared and hashed as the bytes it is written in, in one piece: pacegate writes every
/// upstream's host normalised (see `proxy::forward::prepare`), and the table looks up the
/// authority the request names. (`Authority`'s own hash lowercases it a byte at a time, on
/// every lookup.)
#[derive(Clone, Debug)]
pub(super) struct Key {
    pub(super) https: bool,
    authority: Authority,
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.https == other.https && self.authority.as_str() == other.authority.as_str()
    }
}

impl Eq for Key {}

impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.https.hash(state);
        self.authority.as_str().hash(state);
    }
}

pub(super) fn key_of(uri: &Uri) -> Option<Key> {
    let https = uri.scheme() == Some(&http::uri::Scheme::HTTPS);
    let authority = uri.authority()?;
    if has_port(authority.as_str()) {
        // Shares the URI's bytes: no copy on the request path, where the port is always
        // given (and written as pacegate writes it, see `proxy::forward::prepare`).
        return Some(Key {
            https,
            authority: authority.clone(),
        });
    }
    let port = if https { 443 } else { 80 };
    let authority = format!("{}:{port}", authority.host()).parse().ok()?;
    Some(Key { https, authority })
}

/// Whether an authority ends in `:` and digits, which `Authority::port_u16` would read as a
/// port: looked at from the end, where `port_u16` searches the whole text for a colon (a few
/// hundred instructions, on every request). `[::1]` has none; `[::1]:443` has one.
fn has_port(authority: &str) -> bool {
    let digits = authority
        .bytes()
        .rev()
        .take_while(u8::is_ascii_digit)
        .count();
    let (rest, port) = authority.split_at(authority.len() - digits);
    rest.ends_with(':') && port.parse::<u16>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_is_read_from_the_end_as_the_uri_would_read_it() {
        for authority in [
            "localhost:8080",
            "localhost:1",
            "[::1]:443",
            "a:65535",
            "user@host:80",
        ] {
            let uri: Uri = format!("http://{authority}/").parse().unwrap();
            assert!(has_port(authority), "{authority}");
            assert!(uri.authority().unwrap().port_u16().is_some(), "{authority}");
        }
        for authority in [
            "localhost",
            "host8080",
            "[::1]",
            "localhost:",
            "a:65536",
            "a:123456",
            "[::1]:x",
        ] {
            assert!(!has_port(authority), "{authority}");
            if let Ok(uri) = format!("http://{authority}/").parse::<Uri>() {
                assert!(uri.authority().unwrap().port_u16().is_none(), "{authority}");
            }
        }
    }
}
