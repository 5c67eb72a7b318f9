//! What pauses and resumes of each tag check with digests (Note [Skipping unchanged memory]
//! in `digests.rs`), and the key of this process's digests.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::driver::digest::{self, Digest};
use crate::error::{Error, ErrorKind, Result};

/// What pauses and resumes of a tag check with digests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Checks {
    /// A pause copies only the pieces that changed since its retained host backup took them.
    pub skip_unchanged: bool,
    /// A resume digests what it restored and fails if it differs from the backup.
    pub verify: bool,
}

/// The checks of every tag: a default, and the tags set otherwise.
pub(super) struct Policy {
    default: Mutex<Checks>,
    tags: Mutex<BTreeMap<String, Checks>>,
    /// A random key for this process's digests (Note [Skipping unchanged memory]).
    seed: u64,
    /// The driver said once that it cannot digest.
    unsupported_said: AtomicBool,
    /// A digest failed once already (said in the log at warning level; later ones at debug).
    failure_said: AtomicBool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            default: Mutex::default(),
            tags: Mutex::default(),
            seed: random_seed(),
            unsupported_said: AtomicBool::new(false),
            failure_said: AtomicBool::new(false),
        }
    }
}

/// A key nobody outside the process knows, so contents cannot be built to collide.
fn random_seed() -> u64 {
    let mut b = [0u8; 8];
    if crate::os::random_bytes(&mut b).is_err() {
        // Without the kernel's randomness: time and address, still unknown in advance.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        return digest::fmix64(t ^ (&b as *const _ as u64));
    }
    u64::from_le_bytes(b)
}

impl Policy {
    /// Set the checks of `tag` (`None`: the default, for every tag not set on its own).
    pub(super) fn set(&self, tag: Option<&str>, checks: Checks) {
        match tag {
            None => *self.default.lock() = checks,
            Some(t) => {
                self.tags.lock().insert(t.to_string(), checks);
            }
        }
    }

    /// The checks of `tag`.
    pub(super) fn of(&self, tag: &str) -> Checks {
        self.tags
            .lock()
            .get(tag)
            .copied()
            .unwrap_or_else(|| *self.default.lock())
    }

    /// The key of this process's digests.
    pub(super) fn seed(&self) -> u64 {
        self.seed
    }

    /// A pause could not digest and copies everything: `what` in the log, at warning level
    /// the first time only (a kernel that cannot load would otherwise say so at every pause).
    pub(super) fn digest_failed(&self, what: impl FnOnce() -> String) {
        if self.failure_said.swap(true, Ordering::Relaxed) {
            tracing::debug!("{}", what());
        } else {
            tracing::warn!(
                "{} (further such failures are logged at debug level)",
                what()
            );
        }
    }

    /// A digest failed: `Ok(None)` where the driver cannot digest (said once in the log), so
    /// the caller copies everything; any other failure is the caller's error.
    pub(super) fn unsupported_or(&self, e: Error) -> Result<Option<Vec<Digest>>> {
        if !matches!(e.kind(), ErrorKind::Unsupported) {
            return Err(e);
        }
        if !self.unsupported_said.swap(true, Ordering::Relaxed) {
            tracing::warn!("{e}: pauses copy all memory, and resumes are not verified");
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_of_its_own_overrides_the_default() {
        let p = Policy::default();
        assert_eq!(p.of("kv"), Checks::default());
        let on = Checks {
            skip_unchanged: true,
            verify: false,
        };
        p.set(None, on);
        assert_eq!(p.of("kv"), on);
        p.set(Some("kv"), Checks::default());
        assert_eq!((p.of("kv"), p.of("weights")), (Checks::default(), on));
        assert_ne!(
            Policy::default().seed(),
            p.seed(),
            "a key of its own per engine"
        );
    }

    #[test]
    fn unsupported_is_quiet_other_errors_are_not() {
        let p = Policy::default();
        let r = p.unsupported_or(Error::unsupported("no digests here"));
        assert!(matches!(r, Ok(None)));
        let r = p.unsupported_or(Error::invalid_argument("bad"));
        assert!(matches!(r.unwrap_err().kind(), ErrorKind::InvalidArgument));
    }
}
