//! Fault injection for disk backups (a testing aid): every file operation can be made to fail
//! ([`arm_fault`], `TMS_DISK_FAULTS`), so the tests prove that no failure loses data (Note [Disk
//! backup files] in `disk_file.rs`).

use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// A file operation, for fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DiskOp {
    /// Creating (opening) the file.
    Create,
    /// Setting the mode of the file just made (`fchmod`).
    Chmod,
    /// Reserving its length (`fallocate`).
    Allocate,
    /// A write.
    Write,
    /// A read.
    Read,
    /// `fdatasync`.
    Sync,
}

struct Fault {
    /// Files under this directory only (`None`: any).
    dir: Option<PathBuf>,
    op: DiskOp,
    remaining: u64,
    errno: i32,
}

static FAULTS: Mutex<Vec<Fault>> = Mutex::new(Vec::new());

/// Make the `nth` call (1 = the next) of `op` from now on, on files under `dir` (any file if
/// `None`), fail with `errno`.
pub fn arm_fault(dir: Option<&Path>, op: DiskOp, nth: u64, errno: i32) {
    FAULTS.lock().push(Fault {
        dir: dir.map(Path::to_path_buf),
        op,
        remaining: nth.max(1),
        errno,
    });
}

/// Disarm every file fault not yet fired for `dir` (every one if `None`).
pub fn clear_faults(dir: Option<&Path>) {
    FAULTS
        .lock()
        .retain(|f| dir.is_some_and(|d| f.dir.as_deref() != Some(d)));
}

/// File faults armed for `dir` (every one if `None`) and not yet fired.
pub fn pending_faults(dir: Option<&Path>) -> usize {
    FAULTS
        .lock()
        .iter()
        .filter(|f| dir.is_none() || f.dir.as_deref() == dir)
        .count()
}

/// Parse a file fault plan: `op:nth[:errno]` items separated by commas (`op` one of create, chmod,
/// allocate, write, read, sync; `errno` a number or ENOSPC, EIO, EROFS, ENOENT, EACCES; default
/// EIO), e.g. `write:3:ENOSPC,sync:1`.
pub fn parse_faults(s: &str) -> Result<Vec<(DiskOp, u64, i32)>> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let bad = |why: &str| {
            Error::invalid_argument(format!(
                "disk fault {item:?}: {why} (expected op:nth[:errno], e.g. write:3:ENOSPC)"
            ))
        };
        let mut parts = item.split(':');
        let op = match parts.next() {
            Some("create") => DiskOp::Create,
            Some("chmod") => DiskOp::Chmod,
            Some("allocate") => DiskOp::Allocate,
            Some("write") => DiskOp::Write,
            Some("read") => DiskOp::Read,
            Some("sync") => DiskOp::Sync,
            _ => return Err(bad("unknown operation")),
        };
        let nth = parts
            .next()
            .and_then(|n| n.parse::<u64>().ok())
            .filter(|n| *n > 0)
            .ok_or_else(|| bad("nth must be a positive number"))?;
        let errno = match parts.next() {
            None => libc::EIO,
            Some("ENOSPC") => libc::ENOSPC,
            Some("EIO") => libc::EIO,
            Some("EROFS") => libc::EROFS,
            Some("ENOENT") => libc::ENOENT,
            Some("EACCES") => libc::EACCES,
            Some(n) => n
                .parse::<i32>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| bad("unknown errno"))?,
        };
        if parts.next().is_some() {
            return Err(bad("too many fields"));
        }
        out.push((op, nth, errno));
    }
    Ok(out)
}

/// An injected failure of `op` on `path`, if one is due.
pub(super) fn injected(op: DiskOp, path: &Path) -> Option<std::io::Error> {
    let mut f = FAULTS.lock();
    // Every fault of `op` on `path` counts this call, not only those before the one that fires.
    let mut due = None;
    for (i, x) in f.iter_mut().enumerate() {
        if x.op == op && x.dir.as_deref().is_none_or(|d| path.starts_with(d)) {
            x.remaining = x.remaining.saturating_sub(1);
            if x.remaining == 0 && due.is_none() {
                due = Some(i);
            }
        }
    }
    let e = f.remove(due?);
    Some(std::io::Error::from_raw_os_error(e.errno))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_plans_parse_and_bad_ones_are_refused() {
        assert_eq!(
            parse_faults("write:3:ENOSPC, sync:1").unwrap(),
            vec![
                (DiskOp::Write, 3, libc::ENOSPC),
                (DiskOp::Sync, 1, libc::EIO)
            ]
        );
        for bad in ["fly:1", "write:0", "write:x", "read:1:EWHAT", "read:1:5:6"] {
            assert!(parse_faults(bad).is_err(), "{bad}");
        }
    }
}
