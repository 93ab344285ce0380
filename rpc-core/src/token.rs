//! Shared-secret tokens, as the handshake, the admin endpoint and the gateway check them.
//!
//! A token check must not tell a caller how close it came: comparing the bytes directly stops
//! at the first difference, or at once on a length mismatch, and the time a refusal takes then
//! leaks the token's length and, byte by byte, the token. So both sides are hashed (SHA-256)
//! and the digests compared in constant time: every comparison covers 32 bytes, whatever was
//! sent.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The SHA-256 digest of a token: what [`same`] compares.
pub fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Whether `given` is the `expected` token: their digests compared in constant time, so
/// neither the time taken nor an early exit on a length mismatch tells a caller how long the
/// token is or how much of it was right.
pub fn same(given: &str, expected: &str) -> bool {
    digest(given).ct_eq(&digest(expected)).into()
}

/// The token of an `Authorization` header value of the `Bearer` scheme, whose name is
/// case-insensitive (RFC 9110 section 11.1) and followed by one or more spaces; `None` for
/// another scheme or no token.
pub fn bearer(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.split_once(' ')?;
    let token = token.trim_start_matches(' ');
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Why `token` could never be sent in an `Authorization: Bearer` header and read back as
/// itself, if so: a header value carries visible ASCII and spaces only, and the spaces around
/// it are not part of it. A check that takes such a token would refuse every request.
pub fn unsendable_in_header(token: &str) -> Option<String> {
    if let Some((at, c)) = token
        .char_indices()
        .find(|&(_, c)| !(c.is_ascii_graphic() || c == ' '))
    {
        return Some(format!(
            "it holds {c:?} at byte {at}, and an HTTP header carries only visible ASCII \
             characters and spaces"
        ));
    }
    (token.starts_with(' ') || token.ends_with(' '))
        .then(|| "it starts or ends with a space, which an HTTP header does not keep".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_a_header_cannot_carry_is_told_why() {
        for fit in ["s3cret", "a b", "~!@#$%^&*()_+{}|:<>?"] {
            assert_eq!(unsendable_in_header(fit), None, "{fit:?}");
        }
        for (unfit, why) in [
            ("pässwort", "'ä' at byte 1"),
            ("tab\there", "'\\t' at byte 3"),
            ("new\nline", "'\\n' at byte 3"),
            (" lead", "starts or ends with a space"),
            ("trail ", "starts or ends with a space"),
            ("   ", "starts or ends with a space"),
        ] {
            let said = unsendable_in_header(unfit).unwrap_or_else(|| panic!("{unfit:?} taken"));
            assert!(said.contains(why), "{unfit:?}: {said}");
        }
    }

    #[test]
    fn the_digest_is_sha256() {
        // FIPS 180-2 test vector: SHA-256("abc").
        let abc = [
            0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40, 0xde, 0x5d, 0xae,
            0x22, 0x23, 0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17, 0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61,
            0xf2, 0x00, 0x15, 0xad,
        ];
        assert_eq!(digest("abc"), abc);
    }

    #[test]
    fn only_the_same_token_matches_whatever_its_length() {
        let secret = "s3cret-token";
        assert!(same(secret, secret));
        for wrong in [
            "",
            "s",
            "s3cret-toke",
            "s3cret-tokem",
            "s3cret-token ",
            "S3cret-token",
            &secret.repeat(100),
        ] {
            assert!(!same(wrong, secret), "{wrong:?} matched");
        }
        assert!(same("", ""));
    }

    #[test]
    fn the_bearer_scheme_is_named_in_any_case_before_one_or_more_spaces() {
        for value in ["Bearer t0k", "bearer t0k", "BEARER t0k", "Bearer   t0k"] {
            assert_eq!(bearer(value), Some("t0k"), "{value:?}");
        }
        for value in ["Basic t0k", "Bearert0k", "Bearer", "Bearer ", "t0k", ""] {
            assert_eq!(bearer(value), None, "{value:?}");
        }
    }
}
