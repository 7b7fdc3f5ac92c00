//! Bot walls: a response that is a bot-management product's challenge, not the vendor's
//! refusal. pacegate intercepts TLS, so every client behind it shows pacegate's TLS
//! fingerprint, and products that score fingerprints answer some of them with a challenge,
//! often as a 403. Waiting does not get past one, and an operator's unlock would not either:
//! it is its own verdict, neither a throttle nor a lockout. Each product says so precisely
//! (sources in `docs/vendor-signals.md`); a header that merely names a product (a
//! `Content-Security-Policy` listing its script host) says nothing.

use std::fmt;

use http::header::{HeaderMap, HeaderName, SERVER};

/// A bot-management product whose challenge a response is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Wall {
    /// `cf-mitigated: challenge`, on any status.
    Cloudflare,
    /// `x-amzn-waf-action: challenge` (a 202) or `captcha` (a 405).
    AwsWaf,
    /// `x-datadome: protected` with `x-dd-b: 1` or `2` (a challenge or a block page).
    DataDome,
    /// HUMAN (PerimeterX): a 403 whose JSON body has `blockScript` and `appId`.
    PerimeterX,
    /// Akamai Bot Manager: a 403 from `Server: AkamaiGHost` whose body has `Reference #18.`
    /// (often written with HTML entities: `Reference&#32;&#35;18&#46;`).
    Akamai,
    /// A `header:NAME=VALUE` of the destination's `challenges`.
    Other,
}

impl Wall {
    /// Every product recognised by name, in config order.
    pub const KNOWN: [Wall; 5] = [
        Wall::Cloudflare,
        Wall::AwsWaf,
        Wall::DataDome,
        Wall::PerimeterX,
        Wall::Akamai,
    ];

    /// The name in config, in the `vendor` label and in the log.
    pub fn as_str(self) -> &'static str {
        match self {
            Wall::Cloudflare => "cloudflare",
            Wall::AwsWaf => "aws-waf",
            Wall::DataDome => "datadome",
            Wall::PerimeterX => "perimeterx",
            Wall::Akamai => "akamai",
            Wall::Other => "other",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl fmt::Display for Wall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The walls a destination recognises (`challenges`): products by name, and headers of its
/// own (`header:NAME=VALUE`). Default: every product.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walls {
    known: u8,
    /// A header and a value it must contain (lower case), each an [`Wall::Other`].
    headers: Vec<(HeaderName, String)>,
}

impl Default for Walls {
    fn default() -> Self {
        Self::of(&Wall::KNOWN)
    }
}

impl Walls {
    /// None: every 403 is a lockout, as before walls were told apart.
    pub const NONE: Walls = Walls {
        known: 0,
        headers: Vec::new(),
    };

    /// Whether none is recognised.
    pub fn is_none(&self) -> bool {
        self.known == 0 && self.headers.is_empty()
    }

    /// These products, and no header of its own.
    pub fn of(walls: &[Wall]) -> Self {
        Self {
            known: walls.iter().fold(0, |bits, w| bits | w.bit()),
            headers: Vec::new(),
        }
    }

    fn knows(&self, wall: Wall) -> bool {
        self.known & wall.bit() != 0
    }

    /// Reads one entry of `challenges`: a product's name, or `header:NAME=VALUE`.
    pub fn add(&mut self, entry: &str) -> Result<(), String> {
        if let Some(wall) = Wall::KNOWN.into_iter().find(|w| w.as_str() == entry) {
            self.known |= wall.bit();
            return Ok(());
        }
        let Some(rule) = entry.strip_prefix("header:") else {
            let names: Vec<&str> = Wall::KNOWN.iter().map(|w| w.as_str()).collect();
            return Err(format!(
                "`{entry}` is not a bot wall: expected one of {}, or \"header:NAME=VALUE\"",
                names.join(", ")
            ));
        };
        let (name, value) = rule.split_once('=').unwrap_or((rule, ""));
        let name = HeaderName::try_from(name.trim())
            .map_err(|_| format!("`{name}` is not a header name: write \"header:NAME=VALUE\""))?;
        let value = value.trim().to_ascii_lowercase();
        if value.is_empty() {
            return Err(format!(
                "`{entry}` has no value: write \"header:{name}=VALUE\", the value (or a part of it) that marks a challenge"
            ));
        }
        self.headers.push((name, value));
        Ok(())
    }

    /// As written in config.
    pub fn entries(&self) -> Vec<String> {
        Wall::KNOWN
            .iter()
            .filter(|w| self.knows(**w))
            .map(|w| w.as_str().to_owned())
            .chain(
                self.headers
                    .iter()
                    .map(|(name, value)| format!("header:{name}={value}")),
            )
            .collect()
    }

    /// The wall a response's headers say it is, if any.
    pub fn by_headers(&self, headers: &HeaderMap) -> Option<Wall> {
        if self.is_none() {
            return None;
        }
        let has = |name: &str, want: &[&str]| {
            headers.get_all(name).iter().any(|v| {
                v.to_str()
                    .is_ok_and(|v| want.iter().any(|w| v.trim().eq_ignore_ascii_case(w)))
            })
        };
        if self.knows(Wall::Cloudflare) && has("cf-mitigated", &["challenge"]) {
            return Some(Wall::Cloudflare);
        }
        if self.knows(Wall::AwsWaf) && has("x-amzn-waf-action", &["challenge", "captcha"]) {
            return Some(Wall::AwsWaf);
        }
        if self.knows(Wall::DataDome)
            && has("x-datadome", &["protected"])
            && has("x-dd-b", &["1", "2"])
        {
            return Some(Wall::DataDome);
        }
        let marked = self.headers.iter().any(|(name, value)| {
            headers.get_all(name).iter().any(|v| {
                v.to_str()
                    .is_ok_and(|v| v.to_ascii_lowercase().contains(value.as_str()))
            })
        });
        marked.then_some(Wall::Other)
    }

    /// Whether the body of a response with `status` and `headers` may say it is a wall: a
    /// 403, where HUMAN's or Akamai's is recognised (Akamai's only from its own server).
    pub fn body_may_tell(&self, status: u16, headers: &HeaderMap) -> bool {
        status == 403
            && (self.knows(Wall::PerimeterX) || self.knows(Wall::Akamai) && from_akamai(headers))
    }

    /// The wall the start of a body (decoded) says a response is, if any (see
    /// [`Walls::body_may_tell`]).
    pub fn by_body(&self, headers: &HeaderMap, body: &[u8]) -> Option<Wall> {
        let text = String::from_utf8_lossy(body);
        if self.knows(Wall::PerimeterX)
            && text.contains("\"blockScript\"")
            && text.contains("\"appId\"")
        {
            return Some(Wall::PerimeterX);
        }
        let reference = ["Reference #18.", "Reference&#32;&#35;18&#46;"];
        if self.knows(Wall::Akamai)
            && from_akamai(headers)
            && reference.iter().any(|r| text.contains(r))
        {
            return Some(Wall::Akamai);
        }
        None
    }
}

impl serde::Serialize for Walls {
    /// As written in config: the list of entries.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.entries())
    }
}

/// `Server: AkamaiGHost` (its edge servers' name).
fn from_akamai(headers: &HeaderMap) -> bool {
    headers
        .get(SERVER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("AkamaiGHost"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(n, v)| {
                (
                    HeaderName::try_from(*n).unwrap(),
                    http::HeaderValue::from_str(v).unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn each_product_is_known_by_its_own_signal() {
        let all = Walls::default();
        for (pairs, wall) in [
            (vec![("cf-mitigated", "challenge")], Wall::Cloudflare),
            (vec![("x-amzn-waf-action", "challenge")], Wall::AwsWaf),
            (vec![("x-amzn-waf-action", "CAPTCHA")], Wall::AwsWaf),
            (
                vec![("x-datadome", "protected"), ("x-dd-b", "2")],
                Wall::DataDome,
            ),
        ] {
            assert_eq!(all.by_headers(&headers(&pairs)), Some(wall), "{pairs:?}");
        }
        let human = br#"{"appId":"PXabc123","jsClientSrc":"/abc/init.js","blockScript":"/abc/captcha/captcha.js"}"#;
        let plain = headers(&[("content-type", "application/json")]);
        assert!(all.body_may_tell(403, &plain));
        assert_eq!(all.by_body(&plain, human), Some(Wall::PerimeterX));
        let akamai = headers(&[("server", "AkamaiGHost")]);
        let page = b"<HTML><BODY>Access Denied ... Reference&#32;&#35;18&#46;5c3e4b17&#46;1733500000</BODY></HTML>";
        assert_eq!(all.by_body(&akamai, page), Some(Wall::Akamai));
        assert_eq!(
            all.by_body(&akamai, b"Reference #18.2f1d..."),
            Some(Wall::Akamai)
        );
    }

    #[test]
    fn a_header_that_only_names_a_product_is_no_wall() {
        let all = Walls::default();
        let csp = headers(&[
            (
                "content-security-policy",
                "script-src 'self' https://js.datadome.co https://challenges.cloudflare.com",
            ),
            ("x-datadome", "protected"),
            ("cf-mitigated", "none"),
            ("x-amzn-waf-action", "allow"),
        ]);
        assert_eq!(all.by_headers(&csp), None);
        // Akamai's reference from another server, HUMAN's names outside a 403.
        assert_eq!(
            all.by_body(&headers(&[("server", "nginx")]), b"Reference #18.1"),
            None
        );
        assert!(!all.body_may_tell(200, &csp));
        assert_eq!(all.by_body(&csp, b"{\"appId\": 1}"), None);
    }

    #[test]
    fn the_walls_are_configurable_and_written_back_as_read() {
        let mut walls = Walls::NONE;
        walls.add("cloudflare").unwrap();
        walls.add("header:X-Bot-Check=Challenge").unwrap();
        assert_eq!(
            walls.entries(),
            ["cloudflare", "header:x-bot-check=challenge"]
        );
        assert_eq!(
            walls.by_headers(&headers(&[("x-bot-check", "js-challenge")])),
            Some(Wall::Other)
        );
        assert_eq!(
            walls.by_headers(&headers(&[("x-amzn-waf-action", "challenge")])),
            None,
            "not configured"
        );
        assert!(!walls.body_may_tell(403, &HeaderMap::new()));
        assert!(walls.add("imperva").unwrap_err().contains("akamai"));
        assert!(walls.add("header:x-bot").unwrap_err().contains("VALUE"));
        assert!(walls.add("header:bad name=x").is_err());
        assert_eq!(
            Walls::NONE.by_headers(&headers(&[("cf-mitigated", "challenge")])),
            None
        );
    }
}
