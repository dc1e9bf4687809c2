//! File names between the kernel (any bytes but `/` and NUL) and the
//! manager (UTF-8 strings): a reversible mapping. Valid UTF-8 passes
//! unchanged; each byte that is not part of valid UTF-8 (always 0x80 or
//! above) becomes the code point `U+10FF00 + byte`, at the end of the
//! supplementary private use area. Names that contain those code points
//! literally are refused, so the mapping stays one to one.

use std::borrow::Cow;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use crate::error::{FsError, FsResult};

/// The escape of byte `b` is `ESCAPE_BASE + b`.
const ESCAPE_BASE: u32 = 0x10_FF00;
/// Escapes cover bytes 0x80..=0xFF.
const ESCAPES: std::ops::RangeInclusive<u32> = (ESCAPE_BASE + 0x80)..=(ESCAPE_BASE + 0xFF);

fn is_escape(c: char) -> bool {
    ESCAPES.contains(&u32::from(c))
}

/// The manager's form of a kernel name.
pub fn to_wire(name: &OsStr) -> FsResult<Cow<'_, str>> {
    if let Some(s) = name.to_str() {
        if s.chars().any(is_escape) {
            return Err(FsError::Invalid(format!(
                "name {s:?} uses code points U+10FF80..U+10FFFF, which regions reserves for bytes that are not UTF-8"
            )));
        }
        return Ok(Cow::Borrowed(s));
    }
    let mut out = String::new();
    let mut rest = name.as_bytes();
    while !rest.is_empty() {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                if s.chars().any(is_escape) {
                    return Err(FsError::Invalid(
                        "name uses code points reserved for bytes that are not UTF-8".into(),
                    ));
                }
                out.push_str(s);
                break;
            }
            Err(e) => {
                let (good, bad) = rest.split_at(e.valid_up_to());
                // `good` is valid UTF-8 by construction.
                let good = std::str::from_utf8(good).unwrap_or_default();
                if good.chars().any(is_escape) {
                    return Err(FsError::Invalid(
                        "name uses code points reserved for bytes that are not UTF-8".into(),
                    ));
                }
                out.push_str(good);
                let n = e.error_len().unwrap_or(bad.len());
                for b in &bad[..n] {
                    out.extend(char::from_u32(ESCAPE_BASE + u32::from(*b)));
                }
                rest = &bad[n..];
            }
        }
    }
    Ok(Cow::Owned(out))
}

/// The kernel's form of a manager name.
pub fn from_wire(name: &str) -> OsString {
    if !name.chars().any(is_escape) {
        return OsString::from(name);
    }
    let mut out = Vec::with_capacity(name.len());
    let mut buf = [0u8; 4];
    for c in name.chars() {
        if is_escape(c) {
            out.push((u32::from(c) - ESCAPE_BASE) as u8);
        } else {
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
        }
    }
    OsString::from_vec(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        for raw in [
            &b"plain"[..],
            "caf\u{e9}".as_bytes(),
            b"bad\xffname",
            b"\x80\x81",
            b"half\xe2\x82",
            b"\xc3",
        ] {
            let name = OsStr::from_bytes(raw);
            let wire = to_wire(name).unwrap();
            assert!(std::str::from_utf8(wire.as_bytes()).is_ok());
            assert_eq!(from_wire(&wire).as_bytes(), raw, "{wire:?}");
        }
        assert!(matches!(
            to_wire(OsStr::new("plain")).unwrap(),
            Cow::Borrowed(_)
        ));
        assert_eq!(
            to_wire(OsStr::new("\u{10FF80}")).unwrap_err().errno(),
            libc::EINVAL
        );
        assert_eq!(from_wire("caf\u{e9}"), OsString::from("caf\u{e9}"));
    }
}
