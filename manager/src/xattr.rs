//! Extended attributes: the `user.regions.*` region attributes (validated)
//! and other `user.*` names (stored verbatim).

use crate::error::{ManagerError, Result};

/// Prefix of the region attributes.
pub const REGION_PREFIX: &str = "user.regions.";
/// Longest attribute name (XATTR_NAME_MAX).
pub const MAX_NAME_LEN: usize = 255;
/// Largest attribute value (XATTR_SIZE_MAX).
pub const MAX_VALUE_LEN: usize = 64 * 1024;
/// Most bytes of names and values one inode may hold.
pub const MAX_TOTAL_LEN: usize = 256 * 1024;

/// setxattr flag: fail if the attribute exists.
pub const XATTR_CREATE: u32 = 1;
/// setxattr flag: fail if the attribute does not exist.
pub const XATTR_REPLACE: u32 = 2;

/// A region attribute (Remote Regions paper §5.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionAttr {
    Persistent,
    Multihosted,
    Fixvaddr,
    Onewriter,
    Hostalloc,
    /// Read-only: the creating process.
    OwnerPid,
    /// Read-only: the fixed virtual address.
    Vaddr,
    /// Read-only: the hosts holding the region's data.
    Hosts,
}

impl RegionAttr {
    /// Attributes that can be set (on regions, and as directory defaults).
    pub const SETTABLE: [RegionAttr; 5] = [
        RegionAttr::Persistent,
        RegionAttr::Multihosted,
        RegionAttr::Fixvaddr,
        RegionAttr::Onewriter,
        RegionAttr::Hostalloc,
    ];
    /// Attributes only regions have, computed by the manager.
    pub const READ_ONLY: [RegionAttr; 3] =
        [RegionAttr::OwnerPid, RegionAttr::Vaddr, RegionAttr::Hosts];

    pub fn suffix(self) -> &'static str {
        match self {
            RegionAttr::Persistent => "persistent",
            RegionAttr::Multihosted => "multihosted",
            RegionAttr::Fixvaddr => "fixvaddr",
            RegionAttr::Onewriter => "onewriter",
            RegionAttr::Hostalloc => "hostalloc",
            RegionAttr::OwnerPid => "ownerpid",
            RegionAttr::Vaddr => "vaddr",
            RegionAttr::Hosts => "hosts",
        }
    }

    pub fn name(self) -> String {
        format!("{REGION_PREFIX}{}", self.suffix())
    }

    pub fn is_read_only(self) -> bool {
        RegionAttr::READ_ONLY.contains(&self)
    }
}

/// What an attribute name refers to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttrName {
    Region(RegionAttr),
    /// Any other `user.*` name, stored as given.
    User(String),
    /// A name outside `user.*` (security.*, trusted.*, system.*): none are kept.
    Foreign(String),
}

/// Classifies and checks an attribute name.
pub fn parse_name(name: &str) -> Result<AttrName> {
    if name.is_empty() || name.contains('\0') {
        return Err(ManagerError::Invalid(format!(
            "extended attribute name {name:?} is empty or contains NUL"
        )));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(ManagerError::AttrRange(format!(
            "name of {} bytes is over the limit of {MAX_NAME_LEN} bytes",
            name.len()
        )));
    }
    if let Some(suffix) = name.strip_prefix(REGION_PREFIX) {
        let all = RegionAttr::SETTABLE
            .iter()
            .chain(RegionAttr::READ_ONLY.iter());
        return all
            .copied()
            .find(|a| a.suffix() == suffix)
            .map(AttrName::Region)
            .ok_or_else(|| {
                ManagerError::Invalid(format!(
                    "unknown region attribute {name}; known: persistent, multihosted, fixvaddr, onewriter, hostalloc, ownerpid, vaddr, hosts"
                ))
            });
    }
    match name.strip_prefix("user.") {
        Some(rest) if !rest.is_empty() => Ok(AttrName::User(name.to_owned())),
        Some(_) => Err(ManagerError::Invalid(
            "extended attribute name \"user.\" has nothing after the namespace".into(),
        )),
        None => Ok(AttrName::Foreign(name.to_owned())),
    }
}

/// Strips what shell tools add around a value (`setfattr -v 1`, `echo 1`).
fn trimmed(value: &[u8]) -> Result<&str> {
    let text = std::str::from_utf8(value)
        .map_err(|_| ManagerError::Invalid("region attribute value is not UTF-8".into()))?;
    Ok(text.trim_matches(|c: char| c == '\0' || c.is_ascii_whitespace()))
}

/// A boolean attribute value: `0`/`1` (also `true`/`false`, `yes`/`no`).
pub fn parse_bool(attr: RegionAttr, value: &[u8]) -> Result<bool> {
    match trimmed(value)? {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        other => Err(ManagerError::Invalid(format!(
            "{} must be 0 or 1, not {other:?}",
            attr.name()
        ))),
    }
}

/// A HOSTALLOC value: comma-separated host ids (empty clears it).
pub fn parse_hostalloc(value: &[u8]) -> Result<Vec<u32>> {
    let text = trimmed(value)?;
    let mut hosts = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let id: u32 = part.parse().ok().filter(|id| *id > 0).ok_or_else(|| {
            ManagerError::Invalid(format!(
                "user.regions.hostalloc takes comma-separated host ids (positive integers), not {part:?}"
            ))
        })?;
        if !hosts.contains(&id) {
            hosts.push(id);
        }
    }
    Ok(hosts)
}

/// The textual form of a host list.
pub fn format_hosts(hosts: &[u32]) -> String {
    hosts
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Checks a value's size.
pub fn check_value_len(len: usize) -> Result<()> {
    if len > MAX_VALUE_LEN {
        Err(ManagerError::AttrTooBig(len, MAX_VALUE_LEN))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_classified() {
        assert_eq!(
            parse_name("user.regions.persistent").unwrap(),
            AttrName::Region(RegionAttr::Persistent)
        );
        assert_eq!(
            parse_name("user.regions.vaddr").unwrap(),
            AttrName::Region(RegionAttr::Vaddr)
        );
        assert_eq!(
            parse_name("user.note").unwrap(),
            AttrName::User("user.note".into())
        );
        assert_eq!(
            parse_name("security.capability").unwrap(),
            AttrName::Foreign("security.capability".into())
        );
        assert_eq!(
            parse_name("user.regions.colour").unwrap_err().errno(),
            libc::EINVAL
        );
        assert_eq!(parse_name("user.").unwrap_err().errno(), libc::EINVAL);
        assert_eq!(parse_name("").unwrap_err().errno(), libc::EINVAL);
        assert_eq!(parse_name("user.a\0b").unwrap_err().errno(), libc::EINVAL);
        let long = format!("user.{}", "x".repeat(251));
        assert_eq!(parse_name(&long).unwrap_err().errno(), libc::ERANGE);
        assert!(parse_name(&long[..255]).is_ok());
    }

    #[test]
    fn booleans_accept_shell_forms_and_refuse_others() {
        let a = RegionAttr::Persistent;
        assert!(parse_bool(a, b"1").unwrap());
        assert!(parse_bool(a, b"1\n").unwrap());
        assert!(parse_bool(a, b"true\0").unwrap());
        assert!(!parse_bool(a, b"0").unwrap());
        assert!(!parse_bool(a, b" no ").unwrap());
        for bad in [&b"2"[..], b"", b"maybe", b"\xff"] {
            assert_eq!(parse_bool(a, bad).unwrap_err().errno(), libc::EINVAL);
        }
    }

    #[test]
    fn hostalloc_lists() {
        assert_eq!(parse_hostalloc(b"1,2, 3").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_hostalloc(b"2,2,1\n").unwrap(), vec![2, 1]);
        assert!(parse_hostalloc(b"").unwrap().is_empty());
        for bad in [&b"0"[..], b"a", b"1;2", b"-1", b"99999999999"] {
            assert_eq!(parse_hostalloc(bad).unwrap_err().errno(), libc::EINVAL);
        }
        assert_eq!(format_hosts(&[3, 1]), "3,1");
    }

    #[test]
    fn value_limits() {
        assert!(check_value_len(MAX_VALUE_LEN).is_ok());
        assert_eq!(
            check_value_len(MAX_VALUE_LEN + 1).unwrap_err().errno(),
            libc::E2BIG
        );
    }
}
