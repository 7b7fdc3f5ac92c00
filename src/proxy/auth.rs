//! Basic proxy authentication.

use base64::Engine;
use http::header::{HeaderMap, PROXY_AUTHORIZATION};

use subtle::ConstantTimeEq;

use crate::config::{AuthConfig, User};

/// The user name and password of `Proxy-Authorization: Basic` credentials, as sent.
pub fn basic_credentials(headers: &HeaderMap) -> Option<(Vec<u8>, Vec<u8>)> {
    let value = headers.get(PROXY_AUTHORIZATION)?.to_str().ok()?;
    let (scheme, encoded) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let colon = decoded.iter().position(|b| *b == b':')?;
    Some((decoded[..colon].to_vec(), decoded[colon + 1..].to_vec()))
}

/// Whether `credentials` (a request's, [`basic_credentials`], decoded once) are a configured
/// user's.
pub(super) fn authorized(auth: &AuthConfig, credentials: Option<&(Vec<u8>, Vec<u8>)>) -> bool {
    let Some((name, password)) = credentials else {
        return false;
    };
    let offered = User::digest(password);
    auth.users
        .iter()
        .find(|u| u.name.as_bytes() == name)
        .is_some_and(|u| bool::from(u.password_sha256[..].ct_eq(&offered[..])))
}

/// The user name of `credentials`, where it is text (the password is not checked here).
pub(super) fn user_name(credentials: (Vec<u8>, Vec<u8>)) -> Option<String> {
    String::from_utf8(credentials.0).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::User;

    fn auth() -> AuthConfig {
        AuthConfig {
            realm: "pacegate".into(),
            users: vec![User {
                name: "worker".into(),
                password_env: None,
                password_sha256_hex: None,
                password_sha256: User::digest(b"pw:with:colons"),
                classes: None,
            }],
        }
    }

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(PROXY_AUTHORIZATION, value.parse().unwrap());
        h
    }

    fn authorized(auth: &AuthConfig, headers: &HeaderMap) -> bool {
        super::authorized(auth, basic_credentials(headers).as_ref())
    }

    fn basic(creds: &str) -> String {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(creds)
        )
    }

    #[test]
    fn accepts_a_configured_user() {
        assert!(authorized(
            &auth(),
            &headers(&basic("worker:pw:with:colons"))
        ));
        assert!(authorized(
            &auth(),
            &headers(&basic("worker:pw:with:colons").replace("Basic", "basic"))
        ));
    }

    #[test]
    fn rejects_everything_else() {
        assert!(!authorized(&auth(), &HeaderMap::new()));
        assert!(!authorized(&auth(), &headers(&basic("worker:wrong"))));
        assert!(!authorized(
            &auth(),
            &headers(&basic("other:pw:with:colons"))
        ));
        assert!(!authorized(&auth(), &headers("Bearer xyz")));
        assert!(!authorized(&auth(), &headers("Basic !!!notbase64")));
        assert!(!authorized(&auth(), &headers(&basic("nocolon"))));
    }
}
