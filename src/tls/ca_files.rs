//! The CA on disk: a new one created (key first, mode 0600, never over an existing file), its
//! files read back, and a key that others may read refused.

use std::fs;
use std::io::Write;
use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use time::OffsetDateTime;

use super::{constraints, random_serial, TlsError};

/// Creates a new CA: the key is written first, with mode 0600, and neither file may exist.
pub fn write_new_ca(cert_path: &Path, key_path: &Path) -> Result<(), TlsError> {
    write_new_ca_for(cert_path, key_path, None)
}

/// [`write_new_ca`], constrained to sign for `names` alone when given (hosts, `*.suffix`
/// patterns as their suffix, or IP addresses; see `tls::constraints`).
pub fn write_new_ca_for(
    cert_path: &Path,
    key_path: &Path,
    names: Option<&[&str]>,
) -> Result<(), TlsError> {
    for p in [cert_path, key_path] {
        if p.exists() {
            return Err(TlsError::BadCa {
                path: p.to_owned(),
                reason: "already exists; refusing to overwrite a CA that clients may trust".into(),
            });
        }
    }
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "pacegate");
    dn.push(
        DnType::CommonName,
        format!("pacegate local CA {:08x}", rand::random::<u32>()),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.serial_number = Some(random_serial());
    params.name_constraints = names.map(constraints::permitting);
    let now = OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(3650);
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    for p in [cert_path, key_path] {
        if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir).map_err(|source| TlsError::Io {
                action: "cannot create directory",
                path: dir.to_owned(),
                source,
            })?;
        }
    }
    write_private(key_path, key.serialize_pem().as_bytes())?;
    write_file(cert_path, cert.pem().as_bytes(), 0o644)
}

fn write_private(path: &Path, data: &[u8]) -> Result<(), TlsError> {
    write_file(path, data, 0o600)
}

fn write_file(path: &Path, data: &[u8], mode: u32) -> Result<(), TlsError> {
    let io = |source| TlsError::Io {
        action: "cannot write",
        path: path.to_owned(),
        source,
    };
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // The mode is applied at creation, so the key is never readable by others, not even
        // for an instant.
        opts.mode(mode);
    }
    #[cfg(not(unix))]
    let _ = mode;
    let mut f = opts.open(path).map_err(io)?;
    f.write_all(data).map_err(io)?;
    f.sync_all().map_err(io)
}

pub(super) fn read(path: &Path) -> Result<String, TlsError> {
    fs::read_to_string(path).map_err(|source| TlsError::Io {
        action: "cannot read",
        path: path.to_owned(),
        source,
    })
}

pub(super) fn check_key_permissions(path: &Path) -> Result<(), TlsError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let meta = fs::metadata(path).map_err(|source| TlsError::Io {
            action: "cannot read",
            path: path.to_owned(),
            source,
        })?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(TlsError::BadCa {
                path: path.to_owned(),
                reason: format!(
                    "private key is readable by other users (mode {mode:04o}); run `chmod 600 {}`",
                    path.display()
                ),
            });
        }
    }
    Ok(())
}
