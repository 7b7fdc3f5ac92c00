//! Trust stores: the roots upstream servers are verified against, and the bundle handed to
//! clients whose CA variable replaces the system store.

use std::path::{Path, PathBuf};

use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

use super::{provider, TlsError};

/// The roots upstream servers are verified against: the system's (webpki-roots when the system
/// has none) plus every certificate in `extra` PEM files.
pub fn upstream_roots(extra: &[PathBuf]) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    let (added, _) =
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    if added == 0 {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    }
    for path in extra {
        for cert in read_certs(path)? {
            roots.add(cert)?;
        }
    }
    Ok(roots)
}

/// The rustls client config for upstream connections (ALPN is set by the connector).
pub fn upstream_client_config(roots: RootCertStore) -> Result<ClientConfig, TlsError> {
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |reason: String| TlsError::BadCa {
        path: path.to_owned(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(format!("cannot read certificates: {e}")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(bad("holds no certificate".into()));
    }
    Ok(certs)
}

/// A PEM bundle of the system roots followed by `ca_pem`, for clients whose CA-bundle variable
/// replaces the system store. Returns the bundle and how many system roots it holds.
pub fn bundle_with_system_roots(ca_pem: &str) -> (String, usize) {
    let system = rustls_native_certs::load_native_certs().certs;
    let mut out = String::new();
    for cert in &system {
        out.push_str(&pem_encode("CERTIFICATE", cert));
    }
    out.push_str(ca_pem.trim_end());
    out.push('\n');
    (out, system.len())
}

fn pem_encode(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}
