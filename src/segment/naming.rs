//! Segment names: which names are allowed (one file name in `/dev/shm`), and the names this
//! package generates (`mmc_<creator pid>_<random>`, so `prune` can judge a segment of
//! another version by its creator's pid).

use std::ffi::CString;

use super::os::{SHM_DIR, current_pid, random_bytes};
use crate::error::{Error, Result};

/// Prefix of every segment name this package generates.
pub const NAME_PREFIX: &str = "mmc_";

/// A segment name without its optional leading '/': one path component of `/dev/shm`.
pub fn validate_name(name: &str) -> Result<&str> {
    let bare = name.strip_prefix('/').unwrap_or(name);
    if bare.is_empty()
        || bare == "."
        || bare == ".."
        || bare.contains('/')
        || bare.contains('\0')
        || bare.len() > 255
    {
        return Err(Error::InvalidArgument(format!(
            "invalid shared-memory segment name {name:?}: a segment name is one file name in \
             {SHM_DIR} (no '/', not '.' or '..', at most 255 bytes)"
        )));
    }
    Ok(bare)
}

/// The name as `shm_open` and `shm_unlink` take it (`/<name>`).
pub(super) fn c_name(name: &str) -> Result<CString> {
    let bare = validate_name(name)?;
    CString::new(format!("/{bare}"))
        .map_err(|_| Error::InvalidArgument(format!("segment name {name:?} contains a NUL byte")))
}

/// The segment's file (`/dev/shm/<name>`).
pub(super) fn c_path(name: &str) -> Result<CString> {
    let bare = validate_name(name)?;
    CString::new(format!("{SHM_DIR}/{bare}"))
        .map_err(|_| Error::InvalidArgument(format!("segment name {name:?} contains a NUL byte")))
}

fn to_base36(mut n: u64) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut digits = Vec::new();
    loop {
        digits.push(char::from(DIGITS[(n % 36) as usize]));
        n /= 36;
        if n == 0 {
            break;
        }
    }
    digits.iter().rev().collect()
}

/// A fresh segment name: `mmc_<pid>_<random>`, at most 22 characters (macOS allows 30).
pub fn generate_name() -> Result<String> {
    let random = u64::from_le_bytes(random_bytes::<8>()?) % 36u64.pow(8);
    Ok(format!(
        "{NAME_PREFIX}{}_{:0>8}",
        to_base36(current_pid() as u64),
        to_base36(random)
    ))
}

/// The creator pid a generated name carries (in the creator's PID namespace).
pub fn pid_in_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix(NAME_PREFIX)?.split('_').next()?;
    u32::try_from(u64::from_str_radix(digits, 36).ok()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::{Access, Segment};

    #[test]
    fn names_outside_dev_shm_are_refused() {
        for bad in ["", "/", ".", "..", "../etc/passwd", "a/b", "a\0b"] {
            assert!(
                matches!(validate_name(bad), Err(Error::InvalidArgument(_))),
                "{bad:?} accepted"
            );
            assert!(Segment::open(bad, Access::ReadOnly).is_err());
        }
        assert_eq!(validate_name("/mmc_x").unwrap(), "mmc_x");
    }

    #[test]
    fn generated_names_are_valid_short_and_carry_the_creator_pid() {
        let name = generate_name().unwrap();
        assert_eq!(validate_name(&name).unwrap(), name);
        assert!(name.starts_with(NAME_PREFIX) && name.len() <= 22, "{name}");
        assert_eq!(pid_in_name(&name), Some(current_pid()));
        assert_ne!(generate_name().unwrap(), name);
        assert_eq!(to_base36(0), "0");
        assert_eq!(to_base36(36 * 36 - 1), "zz");
        assert_eq!(
            pid_in_name(&format!("{NAME_PREFIX}{}_x", to_base36(u64::MAX))),
            None
        );
        assert_eq!(pid_in_name("other_1_2"), None);
    }
}
