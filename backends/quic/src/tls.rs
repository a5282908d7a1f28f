//! Per-job identities and pinned TLS 1.3 configurations.
//!
//! Every rank makes a fresh self-signed certificate (rcgen) when it joins
//! and publishes the certificate's SHA-256 fingerprint through the store.
//! Both ends of every connection then pin: a client accepts only the
//! server certificate whose fingerprint the expected rank published, and a
//! server requires a client certificate and accepts only the job's
//! fingerprints. No certificate authority is involved, and a peer without
//! a job certificate's private key cannot finish a handshake.

use std::{
    collections::HashSet,
    sync::{Arc, RwLock},
};

use rustls::{
    DigitallySignedStruct, DistinguishedName, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature},
    pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime},
    server::danger::{ClientCertVerified, ClientCertVerifier},
};

/// The ALPN protocol of consort's data connections.
pub const ALPN: &[u8] = b"consort/1";

/// SHA-256 of a certificate's DER bytes.
pub type Fingerprint = [u8; 32];

/// The fingerprint of `cert`.
pub fn fingerprint(cert: &[u8]) -> Fingerprint {
    let d = ring::digest::digest(&ring::digest::SHA256, cert);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Lower-case hex, as fingerprints travel through the store.
pub fn hex(fp: &Fingerprint) -> String {
    fp.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses [`hex`]'s output.
pub fn parse_hex(s: &str) -> Option<Fingerprint> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// This rank's certificate and key for one job.
pub struct Identity {
    /// The certificate (DER).
    pub cert: CertificateDer<'static>,
    key: Vec<u8>,
    /// Its fingerprint.
    pub fingerprint: Fingerprint,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("fingerprint", &hex(&self.fingerprint))
            .finish()
    }
}

impl Identity {
    /// A fresh self-signed certificate (ECDSA P-256) for this job.
    pub fn generate() -> Result<Self, String> {
        let ck = rcgen::generate_simple_self_signed(vec!["consort".to_string()])
            .map_err(|e| format!("generating the job certificate: {e}"))?;
        let cert = ck.cert.der().clone();
        Ok(Identity {
            fingerprint: fingerprint(&cert),
            key: ck.signing_key.serialize_der(),
            cert,
        })
    }

    fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key.clone()))
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The signature checks both verifiers share (the trait methods rustls
/// requires, answered from `self.provider`).
macro_rules! signature_checks {
    () => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls12_signature(
                message,
                cert,
                dss,
                &self.provider.signature_verification_algorithms,
            )
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls13_signature(
                message,
                cert,
                dss,
                &self.provider.signature_verification_algorithms,
            )
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.provider
                .signature_verification_algorithms
                .supported_schemes()
        }
    };
}

/// Client side: the server must present exactly this certificate.
#[derive(Debug)]
struct PinnedServer {
    want: Fingerprint,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if fingerprint(end_entity) == self.want {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "the server's certificate {} is not the one this rank published ({}): an \
                 impostor, or a rank of another job on a reused address",
                hex(&fingerprint(end_entity)),
                hex(&self.want)
            )))
        }
    }

    signature_checks!();
}

/// The client certificates a server accepts: the job's fingerprints, once
/// every rank's is known. Shared between the TLS verifier and the
/// backend's acceptor, which learns them after the endpoint is up.
#[derive(Clone, Debug, Default)]
pub struct JobCerts(Arc<RwLock<Option<HashSet<Fingerprint>>>>);

impl JobCerts {
    /// Certificates already known.
    pub fn known(allowed: HashSet<Fingerprint>) -> Self {
        let c = JobCerts::default();
        c.learn(allowed);
        c
    }

    /// Sets the job's fingerprints.
    pub fn learn(&self, allowed: HashSet<Fingerprint>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Some(allowed);
    }

    /// Whether `fp` is one of the job's, or `None` while they are unknown.
    pub fn check(&self, fp: &Fingerprint) -> Option<bool> {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|s| s.contains(fp))
    }
}

/// Server side: the client must present one of the job's certificates.
/// While they are unknown (the first moments of the rendezvous) a client
/// passes the handshake, and the acceptor checks its certificate once they
/// are, before it reads a byte from it.
#[derive(Debug)]
struct PinnedClients {
    allowed: JobCerts,
    provider: Arc<CryptoProvider>,
}

impl ClientCertVerifier for PinnedClients {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        if self.allowed.check(&fingerprint(end_entity)) != Some(false) {
            Ok(ClientCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "client certificate {} is not one of this job's",
                hex(&fingerprint(end_entity))
            )))
        }
    }

    signature_checks!();
}

/// The server configuration: this rank's certificate, TLS 1.3 only, and
/// client certificates restricted to `allowed`.
pub fn server_config(
    id: &Identity,
    allowed: HashSet<Fingerprint>,
) -> Result<rustls::ServerConfig, rustls::Error> {
    job_server_config(id, JobCerts::known(allowed))
}

/// [`server_config`] with the job's certificates learnt later.
pub fn job_server_config(
    id: &Identity,
    allowed: JobCerts,
) -> Result<rustls::ServerConfig, rustls::Error> {
    let provider = provider();
    let verifier = Arc::new(PinnedClients {
        allowed,
        provider: provider.clone(),
    });
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![id.cert.clone()], id.key())?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

/// The client configuration for dialing the rank whose certificate is
/// `server`: TLS 1.3 only, presenting this rank's certificate.
pub fn client_config(
    id: &Identity,
    server: Fingerprint,
) -> Result<rustls::ClientConfig, rustls::Error> {
    let provider = provider();
    let verifier = Arc::new(PinnedServer {
        want: server,
        provider: provider.clone(),
    });
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(vec![id.cert.clone()], id.key())?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}
