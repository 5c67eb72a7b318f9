//! Host memory as the operating system gives it: anonymous mappings, the page size, and how much
//! more the process may take before the kernel's out-of-memory killer steps in.

use crate::error::{Error, Result};

/// Size of a transparent huge page on x86-64 and most arm64 kernels.
pub(crate) const HUGE_PAGE: u64 = 2 << 20;

/// The system's page size.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// `len` bytes of fresh anonymous memory aligned to a huge page and advised to use huge pages.
pub(crate) fn mmap_huge(len: u64) -> Result<*mut u8> {
    let span = len + HUGE_PAGE;
    let raw = mmap_anonymous(span)?;
    let start = raw as u64;
    let p = start.next_multiple_of(HUGE_PAGE);
    // SAFETY: both trimmed pieces lie inside the mapping just made and nothing uses them; the
    // advice concerns only our own range.
    unsafe {
        if p > start {
            libc::munmap(raw.cast(), (p - start) as usize);
        }
        let end = p + len;
        if start + span > end {
            libc::munmap(end as *mut libc::c_void, (start + span - end) as usize);
        }
        // Advice only: where huge pages are off, the memory is simply in small pages.
        libc::madvise(p as *mut libc::c_void, len as usize, libc::MADV_HUGEPAGE);
    }
    Ok(p as *mut u8)
}

/// Fresh pageable anonymous memory, not reserved against swap.
pub(crate) fn mmap_anonymous(len: u64) -> Result<*mut u8> {
    // SAFETY: a new private anonymous mapping; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENOMEM) {
            return Err(Error::OutOfMemory(format!(
                "mmap of {len} bytes of host memory: {err}"
            )));
        }
        return Err(Error::Io {
            context: format!("mmap of {len} bytes of host memory"),
            source: err,
        });
    }
    Ok(p.cast())
}

/// Unmap memory from [`mmap_anonymous`].
pub(crate) fn munmap(ptr: *mut u8, len: u64) -> Result<()> {
    // SAFETY: callers pass a mapping they own and no longer use.
    if unsafe { libc::munmap(ptr.cast(), len as usize) } != 0 {
        return Err(Error::last_os(format!("munmap of {len} bytes at {ptr:p}")));
    }
    Ok(())
}

/// How much more host memory the process can fill, and what bounds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostMemory {
    /// Bytes that can still be made resident without reclaiming others' memory or hitting a
    /// limit.
    pub available: u64,
    /// What bounds `available`: `MemAvailable` of `/proc/meminfo`, or a cgroup's `memory.max`.
    pub bound: String,
}

/// What the system and this process's cgroups let it fill now: the least of `MemAvailable` and,
/// for the process's cgroup (v2) and each above it, `memory.max - memory.current`. `None` where
/// neither can be read (not Linux, `/proc` not mounted): the caller then cannot check.
pub fn host_memory() -> Option<HostMemory> {
    let mut best: Option<HostMemory> = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| meminfo_available(&s))
        .map(|available| HostMemory {
            available,
            bound: "MemAvailable in /proc/meminfo".into(),
        });
    if let Ok(cg) = std::fs::read_to_string("/proc/self/cgroup") {
        if let Some(rel) = cg.lines().find_map(|l| l.strip_prefix("0::")) {
            let mut dir =
                std::path::PathBuf::from("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
            loop {
                if let Some(room) = cgroup_room(&dir) {
                    if best.as_ref().is_none_or(|b| room < b.available) {
                        best = Some(HostMemory {
                            available: room,
                            bound: format!("memory.max of cgroup {}", dir.display()),
                        });
                    }
                }
                if dir.as_os_str() == "/sys/fs/cgroup" || !dir.pop() {
                    break;
                }
            }
        }
    }
    best
}

/// `MemAvailable` from `/proc/meminfo` text, in bytes.
fn meminfo_available(s: &str) -> Option<u64> {
    let rest = s.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// `memory.max - memory.current` of one cgroup v2 directory; `None` without a limit.
fn cgroup_room(dir: &std::path::Path) -> Option<u64> {
    let max = std::fs::read_to_string(dir.join("memory.max")).ok()?;
    let max: u64 = max.trim().parse().ok()?; // "max" = no limit
    let cur: u64 = std::fs::read_to_string(dir.join("memory.current"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(max.saturating_sub(cur))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_is_parsed_in_bytes() {
        let s = "MemTotal:       131072 kB\nMemFree:  10 kB\nMemAvailable:    2048 kB\n";
        assert_eq!(meminfo_available(s), Some(2048 * 1024));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
        assert_eq!(meminfo_available("MemAvailable: lots\n"), None);
    }

    #[test]
    fn this_machine_reports_some_host_memory() {
        let m = host_memory().expect("Linux with /proc");
        assert!(m.available > 0, "{m:?}");
        assert!(!m.bound.is_empty());
    }

    #[test]
    fn a_cgroup_without_a_limit_bounds_nothing() {
        let d = std::env::temp_dir().join(format!("tms-cg-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("memory.max"), "max\n").unwrap();
        std::fs::write(d.join("memory.current"), "100\n").unwrap();
        assert_eq!(cgroup_room(&d), None);
        std::fs::write(d.join("memory.max"), "1000\n").unwrap();
        assert_eq!(cgroup_room(&d), Some(900));
        std::fs::write(d.join("memory.current"), "5000\n").unwrap();
        assert_eq!(cgroup_room(&d), Some(0));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
