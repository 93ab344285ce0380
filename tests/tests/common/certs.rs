//! Certificates made at test time with rcgen: a certificate authority per test, and server and
//! client certificates it signs.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A certificate authority made for one test.
pub struct Ca {
    /// Its own certificate, PEM.
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate (PEM and DER) and its key (PEM).
pub struct Identity {
    pub cert: String,
    pub der: Vec<u8>,
    pub key: String,
}

impl Ca {
    /// A self-signed authority called `name`.
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("CA key");
        let cert = params.self_signed(&key).expect("self-signed CA");
        Ca {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A server certificate for 127.0.0.1 and localhost.
    pub fn server(&self) -> Identity {
        self.issue(
            &["127.0.0.1", "localhost"],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A client certificate named `name`.
    pub fn client(&self, name: &str) -> Identity {
        self.issue(&[name], ExtendedKeyUsagePurpose::ClientAuth)
    }

    /// A certificate for `names` (the first is also its common name), for `usage`.
    pub fn issue(&self, names: &[&str], usage: ExtendedKeyUsagePurpose) -> Identity {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names.clone()).expect("params");
        params
            .distinguished_name
            .push(DnType::CommonName, &names[0]);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        Identity {
            cert: cert.pem(),
            der: cert.der().to_vec(),
            key: key.serialize_pem(),
        }
    }
}
