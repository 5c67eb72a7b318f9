//! Host memory as the operating system gives it: anonymous mappings, the page size, and how much
//! more the process may take before the kernel's out-of-memory killer steps in; and the shared
//! objects the loader has in the process.

use crate::error::{Error, Result};

/// Alignment of host buffers that ask for transparent huge pages: the PMD size of kernels with
/// 4 KiB pages (x86-64, most arm64). Kernels with 64 KiB pages (common on Grace) have 512 MiB
/// PMD pages; 2 MiB is a multiple of their page size too, so this stays correct there, and the
/// advice still lets the kernel use huge pages wherever a large buffer covers an aligned 512 MiB
/// (and its smaller multi-size huge pages where enabled).
pub(crate) const HUGE_PAGE: u64 = 2 << 20;

/// Fill `buf` with the kernel's random bytes (`getrandom`).
pub fn random_bytes(buf: &mut [u8]) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: writes at most `buf.len() - done` bytes into `buf` past `done`, all ours.
        let n = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("getrandom", e));
        }
        done += n as usize;
    }
    Ok(())
}

/// Whether `len` bytes at `addr` of this process can be read: a copy through
/// `process_vm_readv`, which reports an address with no memory (EFAULT) instead of faulting.
/// Where the call is refused (a seccomp filter, say), the answer is yes: unknown is not bad.
pub fn readable(addr: usize, len: usize) -> bool {
    let mut buf = vec![0u8; len];
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: the kernel writes at most `len` bytes into `buf`, which has them; the remote
    // range is only read, by the kernel, which checks it.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    n == len as isize
        || (n < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EFAULT))
}

/// The system's page size (4 KiB on x86-64; 4, 16 or 64 KiB on arm64 kernels). Host memory
/// handed to the kernel or the driver in whole pages (page-locking, `madvise`, chunk and slot
/// sizes) is sized and aligned by it, never by a constant.
pub fn page_size() -> u64 {
    #[cfg(test)]
    if let Some(p) = test_page::get() {
        return p;
    }
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// Unit tests pretend a larger page size than the machine's, on their own thread: a multiple
/// of the real one, so what is sized by it is still valid for the kernel.
#[cfg(test)]
pub(crate) mod test_page {
    use std::cell::Cell;

    thread_local! {
        static PAGE: Cell<Option<u64>> = const { Cell::new(None) };
    }

    pub(super) fn get() -> Option<u64> {
        PAGE.with(Cell::get)
    }

    /// Run `f` with [`super::page_size`] answering `page` on this thread.
    pub(crate) fn with<R>(page: u64, f: impl FnOnce() -> R) -> R {
        struct Reset(Option<u64>);
        impl Drop for Reset {
            fn drop(&mut self) {
                PAGE.with(|p| p.set(self.0));
            }
        }
        let _reset = Reset(PAGE.with(|p| p.replace(Some(page))));
        f()
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
            return Err(Error::out_of_memory(format!(
                "mmap of {len} bytes of host memory: {err}"
            )));
        }
        return Err(Error::io(
            format!("mmap of {len} bytes of host memory"),
            err,
        ));
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

/// Paths of the shared objects loaded in this process whose path contains `part`, in the
/// loader's order (a runtime a library loaded into a local scope is found here, where
/// `dlsym(RTLD_DEFAULT)` does not see it).
pub(crate) fn loaded_objects(part: &[u8]) -> Vec<std::ffi::CString> {
    struct Search<'a> {
        part: &'a [u8],
        found: Vec<std::ffi::CString>,
    }
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: the loader passes a valid info record; data is the Search passed below.
        let (info, s) = unsafe { (&*info, &mut *(data as *mut Search<'_>)) };
        if !info.dlpi_name.is_null() {
            // SAFETY: dlpi_name is a NUL-terminated path owned by the loader.
            let n = unsafe { std::ffi::CStr::from_ptr(info.dlpi_name) };
            if !s.part.is_empty() && n.to_bytes().windows(s.part.len()).any(|w| w == s.part) {
                s.found.push(n.to_owned());
            }
        }
        0
    }
    let mut s = Search {
        part,
        found: Vec::new(),
    };
    // SAFETY: visit only reads the loader's records and pushes to the Search we own.
    unsafe { libc::dl_iterate_phdr(Some(visit), (&mut s as *mut Search<'_>).cast()) };
    s.found
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

// ---------------------------------------------------------------------------------------------
// Files removed when the process ends
//
// # Note [Removal at exit and on a termination signal]
//
// Files the library leaves in shared folders (disk backups, the control socket) must go when
// their process goes, including when it is stopped by SIGTERM (how SLURM and Kubernetes stop
// jobs) or SIGINT. They are recorded in a fixed table of slots: the signal handler may only do
// async-signal-safe work, so it cannot take a lock or allocate; it reads the slots with atomics
// and calls `unlinkat`. Each slot keeps the folder's fd and the file's name (the disk backup
// files; the control socket, its folder held open for it), or an absolute path where the folder
// could not be held: a relative folder and a later `chdir` cannot misdirect the removal, nor
// can a rename of a folder held, and a socket path of any length fits. Each slot also keeps
// the pid that recorded it: a fork child inherits the table, the `atexit` handler and the
// signal handlers, and must never remove its parent's live files. A slot may also keep the
// file's identity (device and inode): the control socket, whose name anyone of our user can
// take over while the process runs (the file moved or removed, another put in its place), is
// removed only while it is still the file the process made.
//
// The signal handlers go in only once the library has started (never at load time), and only
// for a signal whose disposition is still the default: a host that installed its own handler
// (Python's SIGINT handler, which raises KeyboardInterrupt and may carry on) or ignores the
// signal keeps it, and our files are then removed at exit, or by the next sweep or `tmsctl
// clean`. A handler the host installs after ours replaces ours, and works as it would without
// us. Ours removes the files, puts the default action back and raises the signal again, so the
// process ends as it would have (its exit status says the signal killed it).

/// Files that can be recorded at once; more are removed at free, or by the next sweep.
const EXIT_SLOTS: usize = 4096;
/// Longest name (or path) a slot holds, its NUL included.
const EXIT_NAME: usize = 128;

const FREE: u8 = 0;
const BUSY: u8 = 1;
const READY: u8 = 2;

struct ExitSlot {
    state: std::sync::atomic::AtomicU8,
    /// Bumped at each recording, so a reader can tell a slot reused while it read it.
    generation: std::sync::atomic::AtomicU32,
    pid: std::sync::atomic::AtomicI32,
    dirfd: std::sync::atomic::AtomicI32,
    /// Removed only while the file is still this one (`dev`, `ino`).
    checked: std::sync::atomic::AtomicBool,
    dev: std::sync::atomic::AtomicU64,
    ino: std::sync::atomic::AtomicU64,
    name: [std::sync::atomic::AtomicU8; EXIT_NAME],
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_SLOT: ExitSlot = ExitSlot {
    state: std::sync::atomic::AtomicU8::new(FREE),
    generation: std::sync::atomic::AtomicU32::new(0),
    pid: std::sync::atomic::AtomicI32::new(0),
    dirfd: std::sync::atomic::AtomicI32::new(-1),
    checked: std::sync::atomic::AtomicBool::new(false),
    dev: std::sync::atomic::AtomicU64::new(0),
    ino: std::sync::atomic::AtomicU64::new(0),
    name: [const { std::sync::atomic::AtomicU8::new(0) }; EXIT_NAME],
};

static EXIT_TABLE: [ExitSlot; EXIT_SLOTS] = [EMPTY_SLOT; EXIT_SLOTS];
static AT_EXIT: std::sync::Once = std::sync::Once::new();
static SIGNALS: std::sync::Once = std::sync::Once::new();

fn getpid() -> i32 {
    nix::unistd::getpid().as_raw()
}

/// A file removed at exit and on a termination signal, in this process only, until dropped.
#[derive(Debug)]
pub struct ExitRemoval {
    slot: usize,
}

impl ExitRemoval {
    /// Record `name` in the folder `dirfd` (`libc::AT_FDCWD` with a path). The caller keeps
    /// `dirfd` open as long as this lives. `None` when the name is too long or every slot is
    /// taken: the file is then not removed at exit.
    pub fn register(dirfd: i32, name: &[u8]) -> Option<ExitRemoval> {
        Self::register_file(dirfd, name, None)
    }

    /// [`register`](Self::register), the file removed only while it is still `file` (its
    /// device and inode, from `lstat`), when given.
    pub fn register_file(dirfd: i32, name: &[u8], file: Option<(u64, u64)>) -> Option<ExitRemoval> {
        use std::sync::atomic::Ordering::SeqCst;
        if name.is_empty() || name.len() >= EXIT_NAME || name.contains(&0) {
            return None;
        }
        AT_EXIT.call_once(|| {
            // SAFETY: registers a function without arguments that never unwinds and only makes
            // async-signal-safe calls.
            unsafe { libc::atexit(remove_recorded_at_exit) };
        });
        let slot = EXIT_TABLE
            .iter()
            .position(|s| s.state.compare_exchange(FREE, BUSY, SeqCst, SeqCst).is_ok())?;
        let s = &EXIT_TABLE[slot];
        s.generation.fetch_add(1, SeqCst);
        s.pid.store(getpid(), SeqCst);
        s.dirfd.store(dirfd, SeqCst);
        s.checked.store(file.is_some(), SeqCst);
        let (dev, ino) = file.unwrap_or_default();
        s.dev.store(dev, SeqCst);
        s.ino.store(ino, SeqCst);
        for (i, b) in s.name.iter().enumerate() {
            b.store(name.get(i).copied().unwrap_or(0), SeqCst);
        }
        s.state.store(READY, SeqCst);
        Some(ExitRemoval { slot })
    }
}

impl Drop for ExitRemoval {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::SeqCst;
        let s = &EXIT_TABLE[self.slot];
        s.state.store(BUSY, SeqCst);
        s.generation.fetch_add(1, SeqCst);
        s.state.store(FREE, SeqCst);
    }
}

/// Remove every file this process recorded. Async-signal-safe: atomics, `getpid`, `unlinkat`.
fn remove_recorded() {
    use std::sync::atomic::Ordering::SeqCst;
    let me = getpid();
    for s in EXIT_TABLE.iter() {
        if s.state.load(SeqCst) != READY {
            continue;
        }
        let generation = s.generation.load(SeqCst);
        let pid = s.pid.load(SeqCst);
        let dirfd = s.dirfd.load(SeqCst);
        let file = s
            .checked
            .load(SeqCst)
            .then(|| (s.dev.load(SeqCst), s.ino.load(SeqCst)));
        let mut name = [0u8; EXIT_NAME];
        for (d, b) in name.iter_mut().zip(s.name.iter()) {
            *d = b.load(SeqCst);
        }
        // Changed while read (freed, or reused for another file): not ours to judge now.
        if s.state.load(SeqCst) != READY || s.generation.load(SeqCst) != generation {
            continue;
        }
        if pid != me {
            continue;
        }
        name[EXIT_NAME - 1] = 0;
        if let Some(file) = file {
            // SAFETY: `name` is NUL-terminated and outlives the call, `st` is ours to write;
            // fstatat is async-signal-safe.
            let same = unsafe {
                let mut st: libc::stat = std::mem::zeroed();
                libc::fstatat(
                    dirfd,
                    name.as_ptr().cast(),
                    &mut st,
                    libc::AT_SYMLINK_NOFOLLOW,
                ) == 0
                    && (st.st_dev as u64, st.st_ino as u64) == file
            };
            if !same {
                continue;
            }
        }
        // SAFETY: `name` is NUL-terminated and outlives the call; unlinkat is async-signal-safe
        // and only reads it.
        unsafe { libc::unlinkat(dirfd, name.as_ptr().cast(), 0) };
    }
}

extern "C" fn remove_recorded_at_exit() {
    remove_recorded();
}

extern "C" fn on_termination_signal(sig: libc::c_int) {
    remove_recorded();
    // SAFETY: sigaction, sigemptyset and raise are async-signal-safe; the struct is ours and
    // zeroed (SIG_DFL, no flags) before use. The signal stays blocked until this handler
    // returns, and then ends the process by its default action.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut dfl.sa_mask);
        libc::sigaction(sig, &dfl, std::ptr::null_mut());
        libc::raise(sig);
    }
}

/// Remove the recorded files on SIGTERM and SIGINT (Note [Removal at exit and on a
/// termination signal]): once, where the host left the default action in place.
pub fn remove_files_on_termination_signals() {
    SIGNALS.call_once(|| {
        for sig in [libc::SIGTERM, libc::SIGINT] {
            let _ = handle_if_default(sig);
        }
    });
}

/// Install the removal handler for `sig` if its disposition is the default; true if it did.
fn handle_if_default(sig: libc::c_int) -> bool {
    // SAFETY: sigaction with a null new action only reads the disposition into `old`; the new
    // one is a zeroed struct given a handler that never unwinds and an empty mask.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(sig, std::ptr::null(), &mut old) != 0
            || old.sa_sigaction != libc::SIG_DFL
        {
            return false;
        }
        let mut new: libc::sigaction = std::mem::zeroed();
        new.sa_sigaction = on_termination_signal as extern "C" fn(libc::c_int) as usize;
        new.sa_flags = libc::SA_RESTART | libc::SA_ONSTACK;
        libc::sigemptyset(&mut new.sa_mask);
        libc::sigaction(sig, &new, std::ptr::null_mut()) == 0
    }
}

/// Copy `n` bytes from `src` to `dst` with stores that go around the CPU caches (on x86-64;
/// elsewhere an ordinary copy): for host memory written once and read later by a device or a
/// later resume, where caching the destination only evicts what other threads use, and fresh
/// destination lines need not be read first.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: both ranges valid for `n` bytes, not overlapping.
pub(crate) unsafe fn copy_streaming(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = dst.align_offset(16).min(n);
        // SAFETY: the caller's contract; head <= n.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let (mut s, mut d, mut left) = (src.wrapping_add(head), dst.wrapping_add(head), n - head);
        while left >= 64 {
            // SAFETY: s..s+64 and d..d+64 lie inside the caller's ranges (left >= 64); d is
            // 16-byte aligned (head above, then steps of 64); SSE2 is part of x86-64.
            unsafe {
                let a = _mm_loadu_si128(s.cast::<__m128i>());
                let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
                let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
                let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
                _mm_stream_si128(d.cast::<__m128i>(), a);
                _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
                _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
                _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
                s = s.add(64);
                d = d.add(64);
            }
            left -= 64;
        }
        // SAFETY: streaming stores are weakly ordered: fence them before anyone else (a DMA
        // queued next, another thread) may read the destination. The tail is inside the ranges.
        unsafe {
            _mm_sfence();
            std::ptr::copy_nonoverlapping(s, d, left);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, n)
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn streaming_copies_equal_plain_ones_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0, 1, 15, 16, 63, 64, 65, 200, 511, 900] {
            for (so, d_off) in [(0, 0), (1, 0), (0, 1), (3, 13), (17, 5)] {
                let mut dst = vec![0xAAu8; 1000];
                // SAFETY: both ranges lie inside their vectors, which do not overlap.
                unsafe { copy_streaming(src.as_ptr().add(so), dst.as_mut_ptr().add(d_off), len) };
                assert_eq!(
                    &dst[d_off..d_off + len],
                    &src[so..so + len],
                    "{len} {so} {d_off}"
                );
                assert!(
                    dst[..d_off].iter().all(|&b| b == 0xAA),
                    "before, {len} {so} {d_off}"
                );
                assert!(dst[d_off + len..].iter().all(|&b| b == 0xAA), "after");
            }
        }
    }

    fn disposition(sig: libc::c_int) -> usize {
        // SAFETY: a null new action only reads the disposition.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            assert_eq!(libc::sigaction(sig, std::ptr::null(), &mut old), 0);
            old.sa_sigaction
        }
    }

    fn set_disposition(sig: libc::c_int, handler: usize) {
        // SAFETY: a zeroed action with an empty mask and a handler that does nothing (or
        // SIG_DFL / SIG_IGN); SIGUSR1 and SIGUSR2 are used by nothing else in these tests.
        unsafe {
            let mut a: libc::sigaction = std::mem::zeroed();
            a.sa_sigaction = handler;
            libc::sigemptyset(&mut a.sa_mask);
            assert_eq!(libc::sigaction(sig, &a, std::ptr::null_mut()), 0);
        }
    }

    extern "C" fn hosts_handler(_: libc::c_int) {}

    #[test]
    fn the_removal_handler_goes_only_where_the_host_left_the_default_action() {
        let host = hosts_handler as extern "C" fn(libc::c_int) as usize;
        let ours = on_termination_signal as extern "C" fn(libc::c_int) as usize;
        set_disposition(libc::SIGUSR1, host);
        assert!(!handle_if_default(libc::SIGUSR1));
        assert_eq!(disposition(libc::SIGUSR1), host, "the host's handler stays");
        set_disposition(libc::SIGUSR1, libc::SIG_IGN);
        assert!(!handle_if_default(libc::SIGUSR1));
        assert_eq!(
            disposition(libc::SIGUSR1),
            libc::SIG_IGN,
            "an ignored signal stays so"
        );
        set_disposition(libc::SIGUSR1, libc::SIG_DFL);
        set_disposition(libc::SIGUSR2, libc::SIG_DFL);
        assert!(handle_if_default(libc::SIGUSR2));
        assert_eq!(disposition(libc::SIGUSR2), ours);
        set_disposition(libc::SIGUSR2, libc::SIG_DFL);
    }

    #[test]
    fn exit_removals_take_and_free_slots() {
        let a = ExitRemoval::register(libc::AT_FDCWD, b"/nonexistent/tms-a").unwrap();
        let b = ExitRemoval::register(libc::AT_FDCWD, b"/nonexistent/tms-b").unwrap();
        assert_ne!(a.slot, b.slot);
        assert!(ExitRemoval::register(libc::AT_FDCWD, &[b'x'; EXIT_NAME]).is_none());
        assert!(ExitRemoval::register(libc::AT_FDCWD, b"a\0b").is_none());
        let slot = a.slot;
        drop(a);
        assert_eq!(
            EXIT_TABLE[slot]
                .state
                .load(std::sync::atomic::Ordering::SeqCst),
            FREE
        );
        drop(b);
    }

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
