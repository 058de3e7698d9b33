//! The names a client certificate (X.509, DER) gives for a login: its subject's common
//! name and its first usable subject alternative name, as RabbitMQ's `ssl_cert_login_from`
//! and Mosquitto's `use_identity_as_username` take them. The TLS listeners verified the
//! certificate before; this only reads it, bounds-checked (malformed input is `None`, never
//! a panic).

/// One DER element: its tag, its contents and what follows it.
fn der(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const OID: u8 = 0x06;
/// 2.5.4.3, id-at-commonName.
const COMMON_NAME: &[u8] = &[0x55, 0x04, 0x03];

/// The subject's common name of an X.509 certificate (DER), as RabbitMQ's
/// `ssl_cert_login_from = common_name` and Mosquitto's `use_identity_as_username` take it.
/// `None` when there is none or the certificate is malformed (it was verified by then, so
/// only an exotic encoding gets here).
pub fn subject_cn(cert: &[u8]) -> Option<String> {
    let (SEQUENCE, cert, _) = der(cert)? else {
        return None;
    };
    let (SEQUENCE, tbs, _) = der(cert)? else {
        return None;
    };
    let mut rest = tbs;
    // [0] version (optional), serial, signature algorithm, issuer, validity, then subject.
    let (tag, _, after) = der(rest)?;
    if tag == 0xa0 {
        rest = after;
    }
    for _ in 0..4 {
        rest = der(rest)?.2;
    }
    let (SEQUENCE, mut names, _) = der(rest)? else {
        return None;
    };
    while !names.is_empty() {
        let (SET, mut set, next) = der(names)? else {
            return None;
        };
        names = next;
        while !set.is_empty() {
            let (SEQUENCE, attribute, next) = der(set)? else {
                return None;
            };
            set = next;
            let (OID, oid, value) = der(attribute)? else {
                return None;
            };
            if oid == COMMON_NAME {
                let (_, value, _) = der(value)?;
                return std::str::from_utf8(value).ok().map(str::to_string);
            }
        }
    }
    None
}

/// 2.5.29.17, id-ce-subjectAltName.
const SUBJECT_ALT_NAME: &[u8] = &[0x55, 0x1d, 0x11];

/// The first subject alternative name of an X.509 certificate (DER) that is a DNS name, an
/// email address (rfc822Name) or a URI, as RabbitMQ's `ssl_cert_login_from =
/// subject_alternative_name` takes it. `None` without one or when malformed.
pub fn subject_alt_name(cert: &[u8]) -> Option<String> {
    let (SEQUENCE, cert, _) = der(cert)? else {
        return None;
    };
    let (SEQUENCE, tbs, _) = der(cert)? else {
        return None;
    };
    // The extensions are the [3] element after the fixed fields (any [1]/[2] unique ids
    // are skipped on the way).
    let mut rest = tbs;
    let mut extensions = None;
    while !rest.is_empty() {
        let (tag, value, next) = der(rest)?;
        if tag == 0xa3 {
            extensions = Some(value);
            break;
        }
        rest = next;
    }
    let (SEQUENCE, mut list, _) = der(extensions?)? else {
        return None;
    };
    while !list.is_empty() {
        let (SEQUENCE, extension, next) = der(list)? else {
            return None;
        };
        list = next;
        let (OID, oid, mut value) = der(extension)? else {
            return None;
        };
        if oid != SUBJECT_ALT_NAME {
            continue;
        }
        // An optional `critical` BOOLEAN, then the OCTET STRING holding GeneralNames.
        let (mut tag, mut octets, after) = der(value)?;
        if tag == 0x01 {
            value = after;
            (tag, octets, _) = der(value)?;
        }
        if tag != 0x04 {
            return None;
        }
        let (SEQUENCE, mut names, _) = der(octets)? else {
            return None;
        };
        while !names.is_empty() {
            let (tag, name, next) = der(names)?;
            names = next;
            // [1] rfc822Name, [2] dNSName, [6] uniformResourceIdentifier: IA5Strings.
            if matches!(tag, 0x81 | 0x82 | 0x86) {
                return std::str::from_utf8(name).ok().map(str::to_string);
            }
        }
        return None;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subject_cn_of_generated_certificates() {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".into()]).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "Warren");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "device-42");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("cert");
        assert_eq!(subject_cn(cert.der()).as_deref(), Some("device-42"));

        let params = rcgen::CertificateParams::new(vec!["localhost".into()]).expect("params");
        let mut params = params;
        params.distinguished_name = rcgen::DistinguishedName::new();
        let cert = params.self_signed(&key).expect("cert");
        assert_eq!(subject_cn(cert.der()), None);
    }

    #[test]
    fn subject_alt_name_of_generated_certificates() {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params =
            rcgen::CertificateParams::new(vec!["sensor-7.devices".into()]).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "not-this");
        let cert = params.self_signed(&key).expect("cert");
        assert_eq!(
            subject_alt_name(cert.der()).as_deref(),
            Some("sensor-7.devices")
        );
        // An IP address first: skipped for the next usable name.
        let mut params = rcgen::CertificateParams::new(Vec::new()).expect("params");
        params.subject_alt_names = vec![
            rcgen::SanType::IpAddress([127, 0, 0, 1].into()),
            rcgen::SanType::Rfc822Name("ops@example.com".try_into().expect("email")),
        ];
        let cert = params.self_signed(&key).expect("cert");
        assert_eq!(
            subject_alt_name(cert.der()).as_deref(),
            Some("ops@example.com")
        );
        let params = rcgen::CertificateParams::new(Vec::new()).expect("params");
        let cert = params.self_signed(&key).expect("cert");
        assert_eq!(subject_alt_name(cert.der()), None);
        for input in [&b""[..], b"\x30", b"\x30\x03\x30\x01"] {
            assert_eq!(subject_alt_name(input), None);
        }
    }

    #[test]
    fn subject_cn_of_garbage_is_none() {
        for input in [
            &b""[..],
            b"\x30",
            b"\x30\x84\xff\xff\xff\xff",
            b"\x30\x03\x30\x01",
        ] {
            assert_eq!(subject_cn(input), None);
        }
    }
}
