//! TLS: the local certificate authority, leaf certificates minted per CONNECT host (and cached),
//! the CA's files (`ca_files`) and the roots upstream servers are verified against
//! (`roots`).
//!
//! Every rustls config here is built with the ring provider explicitly, so the library never
//! depends on a process-wide default provider having been installed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair,
    KeyUsagePurpose, PublicKeyData, SerialNumber,
};
use rustls::crypto::CryptoProvider;
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use time::OffsetDateTime;

use crate::config::TlsConfig;

mod ca_files;
mod constraints;
mod roots;

use ca_files::{check_key_permissions, read};
pub use ca_files::{write_new_ca, write_new_ca_for};
pub use roots::{bundle_with_system_roots, upstream_client_config, upstream_roots};

/// Why a TLS component could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The CA files are unusable (bad PEM, mismatched key, unsafe permissions, ...).
    #[error("CA {path}: {reason}")]
    BadCa {
        /// The offending file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// Certificate generation failed.
    #[error("cannot create certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// rustls refused a certificate or config.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The ring provider, shared by every config pacegate builds.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The local CA that signs intercepted sessions' leaf certificates.
pub struct Authority {
    issuer: Issuer<'static, KeyPair>,
    cert_der: CertificateDer<'static>,
    cert_pem: String,
    leaf_validity: Duration,
    leaves: quick_cache::sync::Cache<String, Leaf>,
}

#[derive(Clone)]
struct Leaf {
    config: Arc<ServerConfig>,
    /// When the cached leaf should be replaced: half its validity, well before clients would
    /// see it expire.
    refresh_at: Instant,
}

/// Where a leaf came from, for the certificate cache metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeafSource {
    /// Served from the cache.
    Cached,
    /// Minted now.
    Minted,
}

impl Authority {
    /// Loads the CA named by the config, creating it first when `generate_ca` is set and both
    /// files are missing. Returns whether it was created.
    pub fn load_or_create(cfg: &TlsConfig) -> Result<(Self, bool), TlsError> {
        let created = if cfg.generate_ca && !cfg.ca_cert.exists() && !cfg.ca_key.exists() {
            write_new_ca(&cfg.ca_cert, &cfg.ca_key)?;
            true
        } else {
            false
        };
        Ok((
            Self::load(&cfg.ca_cert, &cfg.ca_key, cfg.leaf_validity)?,
            created,
        ))
    }

    /// Loads a CA from PEM files. The key must not be readable by group or others.
    pub fn load(
        cert_path: &Path,
        key_path: &Path,
        leaf_validity: Duration,
    ) -> Result<Self, TlsError> {
        check_key_permissions(key_path)?;
        let cert_pem = read(cert_path)?;
        let key_pem = read(key_path)?;
        let bad = |path: &Path, reason: String| TlsError::BadCa {
            path: path.to_owned(),
            reason,
        };
        let key = KeyPair::from_pem(&key_pem)
            .map_err(|e| bad(key_path, format!("not a usable private key: {e}")))?;
        let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| bad(cert_path, format!("not a PEM certificate: {e}")))?;
        let (_, parsed) = x509_parser::parse_x509_certificate(&cert_der)
            .map_err(|e| bad(cert_path, format!("not a valid certificate: {e}")))?;
        if parsed.tbs_certificate.subject_pki.raw != key.subject_public_key_info().as_slice() {
            return Err(bad(
                key_path,
                format!("does not belong to the certificate {}", cert_path.display()),
            ));
        }
        if !parsed.is_ca() {
            return Err(bad(
                cert_path,
                "is not a CA certificate (basicConstraints CA:TRUE missing)".into(),
            ));
        }
        if !parsed.validity().is_valid() {
            return Err(bad(
                cert_path,
                "is expired or not yet valid; create a new CA with `pacegate ca init`".into(),
            ));
        }
        let issuer = Issuer::from_ca_cert_der(&cert_der, key)
            .map_err(|e| bad(cert_path, format!("cannot be used as issuer: {e}")))?;
        Ok(Self {
            issuer,
            cert_der,
            cert_pem,
            leaf_validity,
            leaves: quick_cache::sync::Cache::new(10_000),
        })
    }

    /// Of `hosts`, those this CA's name constraints do not permit: clients refuse the leaves
    /// minted for them. Empty for a CA without constraints.
    pub fn outside_constraints<'a>(&self, hosts: &[&'a str]) -> Vec<&'a str> {
        let Ok((_, parsed)) = x509_parser::parse_x509_certificate(&self.cert_der) else {
            return Vec::new();
        };
        match parsed.name_constraints() {
            Ok(Some(ext)) => hosts
                .iter()
                .copied()
                .filter(|h| !constraints::permits(ext.value, h))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The CA certificate in PEM form, for clients to trust.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Leaf certificates currently cached.
    pub fn cached_leaves(&self) -> usize {
        self.leaves.len()
    }

    /// A TLS server config presenting a leaf for `host` (a normalised DNS name or IP literal),
    /// taken from the cache or minted now. `host` is always the CONNECT target, never the SNI
    /// the client sends, so a client cannot obtain a certificate for a host it is not routed to.
    pub fn server_config(&self, host: &str) -> Result<(Arc<ServerConfig>, LeafSource), TlsError> {
        if let Some(leaf) = self.leaves.get(host) {
            if leaf.refresh_at > Instant::now() {
                return Ok((leaf.config, LeafSource::Cached));
            }
        }
        let config = Arc::new(self.mint(host)?);
        self.leaves.insert(
            host.to_owned(),
            Leaf {
                config: config.clone(),
                refresh_at: Instant::now() + self.leaf_validity / 2,
            },
        );
        Ok((config, LeafSource::Minted))
    }

    fn mint(&self, host: &str) -> Result<ServerConfig, TlsError> {
        let (cert, key) = self.mint_leaf(host)?;
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(vec![cert, self.cert_der.clone()], key)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }

    /// A new leaf certificate and key for `host`: random serial, validity from an hour back
    /// (client clock skew) to `leaf_validity` ahead, authority key identifier, server-auth only.
    fn mint_leaf(
        &self,
        host: &str,
    ) -> Result<(CertificateDer<'static>, PrivateKeyDer<'static>), TlsError> {
        // `new` turns an IP literal into an IP SAN and anything else into a DNS SAN.
        let mut params = CertificateParams::new(vec![host.to_owned()])?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host);
        params.distinguished_name = dn;
        params.serial_number = Some(random_serial());
        let now = OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + self.leaf_validity;
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        Ok((cert.der().clone(), key_der))
    }
}

/// A random positive 128-bit serial (RFC 5280 allows up to 20 octets; the top bit is cleared
/// so that the DER integer stays positive).
fn random_serial() -> SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    bytes[0] &= 0x7f;
    SerialNumber::from_slice(&bytes)
}

#[cfg(test)]
mod tests {
    use std::fs;

    use rustls::RootCertStore;

    use super::*;

    fn new_ca(dir: &Path) -> Authority {
        let (cert, key) = (dir.join("ca.pem"), dir.join("ca-key.pem"));
        write_new_ca(&cert, &key).unwrap();
        Authority::load(&cert, &key, Duration::from_secs(3600 * 24)).unwrap()
    }

    #[test]
    fn leaves_have_random_serials_aki_and_short_validity() {
        use x509_parser::extensions::{GeneralName, ParsedExtension};
        let dir = tempfile::tempdir().unwrap();
        let ca = new_ca(dir.path());
        let (a, _) = ca.mint_leaf("img.example.com").unwrap();
        let (b, _) = ca.mint_leaf("img.example.com").unwrap();
        let (_, a) = x509_parser::parse_x509_certificate(&a).unwrap();
        let (_, b) = x509_parser::parse_x509_certificate(&b).unwrap();
        assert_ne!(a.serial, b.serial);
        let lifetime = a.validity().not_after.timestamp() - a.validity().not_before.timestamp();
        assert_eq!(lifetime, 25 * 3600);
        let exts: Vec<_> = a
            .extensions()
            .iter()
            .map(|e| e.parsed_extension().clone())
            .collect();
        assert!(exts
            .iter()
            .any(|e| matches!(e, ParsedExtension::AuthorityKeyIdentifier(_))));
        let san = a.subject_alternative_name().unwrap().unwrap();
        assert_eq!(
            san.value.general_names,
            vec![GeneralName::DNSName("img.example.com")]
        );
        let (ip, _) = ca.mint_leaf("127.0.0.1").unwrap();
        let (_, ip) = x509_parser::parse_x509_certificate(&ip).unwrap();
        let san = ip.subject_alternative_name().unwrap().unwrap();
        assert_eq!(
            san.value.general_names,
            vec![GeneralName::IPAddress(&[127, 0, 0, 1])]
        );
    }

    #[test]
    fn ca_key_is_created_private_and_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        new_ca(dir.path());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(dir.path().join("ca-key.pem"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let again = write_new_ca(&dir.path().join("ca.pem"), &dir.path().join("ca-key.pem"));
        assert!(matches!(again, Err(TlsError::BadCa { .. })));
    }

    #[cfg(unix)]
    #[test]
    fn world_readable_key_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        new_ca(dir.path());
        let key = dir.path().join("ca-key.pem");
        fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).unwrap();
        let err = Authority::load(&dir.path().join("ca.pem"), &key, Duration::from_secs(3600))
            .err()
            .unwrap();
        assert!(err.to_string().contains("chmod 600"), "{err}");
    }

    #[test]
    fn mismatched_key_is_refused() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        new_ca(a.path());
        new_ca(b.path());
        let err = Authority::load(
            &a.path().join("ca.pem"),
            &b.path().join("ca-key.pem"),
            Duration::from_secs(3600),
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("does not belong"), "{err}");
    }

    #[test]
    fn leaves_are_cached_per_host() {
        let dir = tempfile::tempdir().unwrap();
        let ca = new_ca(dir.path());
        let (first, src) = ca.server_config("a.example.com").unwrap();
        assert_eq!(src, LeafSource::Minted);
        let (second, src) = ca.server_config("a.example.com").unwrap();
        assert_eq!(src, LeafSource::Cached);
        assert!(Arc::ptr_eq(&first, &second));
        assert_eq!(
            ca.server_config("b.example.com").unwrap().1,
            LeafSource::Minted
        );
        assert_eq!(ca.cached_leaves(), 2);
    }

    #[test]
    fn bundle_ends_with_the_ca() {
        let (bundle, _) = bundle_with_system_roots(
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----",
        );
        assert!(bundle.ends_with("-----END CERTIFICATE-----\n"));
        assert!(bundle.contains("AAAA"));
    }

    #[test]
    fn a_constrained_ca_signs_for_its_hosts_alone() {
        use rustls::client::danger::ServerCertVerifier;
        use rustls_pki_types::{ServerName, UnixTime};
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("ca.pem"), dir.path().join("ca-key.pem"));
        let names = ["api.example.com", "example.net", "192.0.2.7"];
        write_new_ca_for(&cert, &key, Some(&names)).unwrap();
        let ca = Authority::load(&cert, &key, Duration::from_secs(3600)).unwrap();
        let mut roots = RootCertStore::empty();
        roots.add(ca.cert_der.clone()).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            provider(),
        )
        .build()
        .unwrap();
        let verify = |host: &str| {
            let (leaf, _) = ca.mint_leaf(host).unwrap();
            let name = ServerName::try_from(host.to_owned()).unwrap();
            verifier.verify_server_cert(&leaf, &[], &name, &[], UnixTime::now())
        };
        for inside in [
            "api.example.com",
            "v2.api.example.com",
            "a.example.net",
            "192.0.2.7",
        ] {
            assert!(verify(inside).is_ok(), "{inside}: {:?}", verify(inside));
        }
        for outside in [
            "example.com",
            "bank.example",
            "192.0.2.8",
            "127.0.0.1",
            "::1",
        ] {
            let refused = verify(outside).unwrap_err();
            assert!(
                format!("{refused:?}").contains("NameConstraint"),
                "{outside}: {refused:?}"
            );
        }
        assert_eq!(
            ca.outside_constraints(&[
                "api.example.com",
                "x.example.net",
                "other.org",
                "192.0.2.7",
                "10.0.0.1"
            ]),
            ["other.org", "10.0.0.1"]
        );
        // Without an address among the names, every address is excluded.
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("ca.pem"), dir.path().join("ca-key.pem"));
        write_new_ca_for(&cert, &key, Some(&["localhost"])).unwrap();
        let ca = Authority::load(&cert, &key, Duration::from_secs(3600)).unwrap();
        assert_eq!(
            ca.outside_constraints(&["localhost", "127.0.0.1", "[::1]"]),
            ["127.0.0.1", "[::1]"]
        );
        // And a CA without constraints signs for anything.
        assert!(new_ca(dir.path().join("free").as_path())
            .outside_constraints(&["a", "10.0.0.1"])
            .is_empty());
    }
}
