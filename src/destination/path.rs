//! A request path as a vendor counts it, for picking its group: RFC 3986's normalisation
//! (section 6.2.2), so that `//search/x`, `/%73earch/x`, `/./search/x`, `/a/../search/x` and
//! `/%2e/search/x` all fall in the group of `/search/`, as the vendor's own bucket counts them.
//! Matching stays case-sensitive, and the upstream still gets the path the client sent.

use std::borrow::Cow;

/// `path` normalised: percent-encoded unreserved characters decoded (and the hex digits of
/// the other encodings upper-cased), repeated slashes merged, dot segments removed. Borrowed
/// as it is where there is nothing to do, as for most paths.
pub fn normalise(path: &str) -> Cow<'_, str> {
    let b = path.as_bytes();
    let plain = !b.contains(&b'%')
        && !b.windows(2).any(|w| w == b"//" || w == b"/.")
        && !path.starts_with('.');
    if plain {
        return Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(path);
    let merged = merge_slashes(&decoded);
    Cow::Owned(remove_dot_segments(&merged))
}

/// Whether `c` is unreserved (RFC 3986 section 2.3): its percent-encoding means the same.
fn unreserved(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~')
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn decode_unreserved(path: &str) -> String {
    let b = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                let c = h * 16 + l;
                if unreserved(c) {
                    out.push(char::from(c));
                } else {
                    out.push('%');
                    out.push(char::from(b[i + 1]).to_ascii_uppercase());
                    out.push(char::from(b[i + 2]).to_ascii_uppercase());
                }
                i += 3;
                continue;
            }
        }
        // A byte of a UTF-8 sequence is pushed with the rest of its character.
        let ch = path[i..].chars().next().unwrap_or('\u{fffd}');
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

fn merge_slashes(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut last_slash = false;
    for c in path.chars() {
        if c == '/' && last_slash {
            continue;
        }
        last_slash = c == '/';
        out.push(c);
    }
    out
}

/// RFC 3986 section 5.2.4, on segments: `.` goes, `..` takes the one before it with it
/// (never above the root), and a path that ended in one ends with a slash.
fn remove_dot_segments(path: &str) -> String {
    let absolute = path.starts_with('/');
    let mut kept: Vec<&str> = Vec::new();
    let segments: Vec<&str> = path.split('/').collect();
    let mut trailing = false;
    for (i, seg) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        match *seg {
            "." => trailing = last,
            ".." => {
                kept.pop();
                trailing = last;
            }
            "" if i == 0 && absolute => {}
            s => {
                kept.push(s);
                trailing = false;
            }
        }
    }
    let mut out = String::with_capacity(path.len());
    if absolute {
        out.push('/');
    }
    out.push_str(&kept.join("/"));
    if trailing && !out.ends_with('/') {
        out.push('/');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::normalise;

    #[test]
    fn every_way_to_write_a_path_reads_as_the_vendor_reads_it() {
        for (written, read) in [
            ("/search/x", "/search/x"),
            ("//search/x", "/search/x"),
            ("/%73earch/x", "/search/x"),
            ("/%73EARCH/x", "/sEARCH/x"),
            ("/./search/x", "/search/x"),
            ("/a/../search/x", "/search/x"),
            ("/%2e/search/x", "/search/x"),
            ("/%2E%2E/search/x", "/search/x"),
            ("/../../search/x", "/search/x"),
            ("/search/./x/..", "/search/"),
            ("/search/.", "/search/"),
            ("/search//x//", "/search/x/"),
            ("/a%2fb", "/a%2Fb"),
            ("/a%2Fb/%7euser", "/a%2Fb/~user"),
            ("/100%", "/100%"),
            ("/%zz/x", "/%zz/x"),
            ("/caf%C3%A9/é", "/caf%C3%A9/é"),
            ("/", "/"),
            ("", ""),
            ("/.well-known/x", "/.well-known/x"),
            ("/..hidden", "/..hidden"),
        ] {
            assert_eq!(normalise(written), read, "{written}");
        }
    }

    #[test]
    fn a_plain_path_is_borrowed() {
        assert!(matches!(
            normalise("/search/repositories"),
            std::borrow::Cow::Borrowed(_)
        ));
    }
}
