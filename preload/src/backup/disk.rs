//! Disk backups: each allocation's contents in a file of its own, written and read by the copy
//! pipeline through its page-locked staging slots (engine Note [The copy pipeline]).
//!
//! # Note [Disk backup files]
//!
//! - A file is made at an allocation's first disk-backed pause, in the directory set then
//!   (`set_disk_backup_dir`, `TMS_DISK_BACKUP_DIR`, else the system's temporary directory),
//!   with mode `0600`, `O_CLOEXEC`, and `O_DIRECT` where the file system allows it: backups
//!   then neither fill the page cache nor sit in it unwritten when the pause returns (each file
//!   is also `fdatasync`ed before its device memory is released). Its whole length is reserved
//!   with `fallocate` up front, so a full disk fails the pause before anything is copied.
//! - It is reused by every later pause of the allocation (disk use stays constant) and removed
//!   when the allocation is freed, and at process exit.
//! - A process holds an exclusive `flock` on each of its files while they exist. A file in the
//!   directory whose lock can be taken belongs to a process that died: the first process to use
//!   the directory removes it. A live process's files are never touched (this holds across pid
//!   namespaces, where pids mean nothing). Files are made under a temporary name and renamed
//!   once locked, so no sweep can take a file between its creation and its lock.
//! - Each chunk's contents carry an xxh3 checksum, computed as the chunk is written and checked
//!   as it is read back (a few percent of a core at disk speed): a file that changed on disk
//!   while paused (truncated, overwritten) fails the resume, which leaves the tag paused; it is
//!   never silently restored.
//! - Every file operation can be made to fail ([`arm_fault`], `TMS_DISK_FAULTS`), so the tests
//!   prove that no failure loses data: a pause that cannot write leaves the allocation active
//!   with its contents, a resume that cannot read leaves it paused with its file.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use nix::fcntl::{Flock, FlockArg};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::units::human;

/// Prefix of finished backup files; temporary names start with a dot.
const PREFIX: &str = "tms-backup-";
const TMP_PREFIX: &str = ".tms-backup-new-";
/// A temporary file older than this whose lock is free was left by a process that died while
/// making it.
const TMP_GRACE: Duration = Duration::from_secs(60);
/// `O_DIRECT` transfers are aligned to this (the largest logical block size in common use).
pub const DIRECT_ALIGN: u64 = 4096;

/// A file operation, for fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DiskOp {
    /// Creating (opening) the file.
    Create,
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

/// Parse a file fault plan: `op:nth[:errno]` items separated by commas (`op` one of create,
/// allocate, write, read, sync; `errno` a number or ENOSPC, EIO, EROFS, ENOENT, EACCES; default
/// EIO), e.g. `write:3:ENOSPC,sync:1`.
pub fn parse_faults(s: &str) -> Result<Vec<(DiskOp, u64, i32)>> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "disk fault {item:?}: {why} (expected op:nth[:errno], e.g. write:3:ENOSPC)"
            ))
        };
        let mut parts = item.split(':');
        let op = match parts.next() {
            Some("create") => DiskOp::Create,
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
fn injected(op: DiskOp, path: &Path) -> Option<std::io::Error> {
    let mut f = FAULTS.lock();
    let i = f.iter_mut().position(|x| {
        if x.op == op && x.dir.as_deref().is_none_or(|d| path.starts_with(d)) {
            x.remaining -= 1;
            x.remaining == 0
        } else {
            false
        }
    })?;
    let e = f.remove(i);
    Some(std::io::Error::from_raw_os_error(e.errno))
}

fn io_err(what: String, e: std::io::Error) -> Error {
    if e.raw_os_error() == Some(libc::ENOSPC) {
        return Error::OutOfMemory(format!("{what}: {e} (the disk backup directory is full)"));
    }
    Error::Io {
        context: what,
        source: e,
    }
}

/// Files of this process, removed at exit if still there.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
/// Directories swept for files of dead processes already.
static SWEPT: Mutex<Option<HashSet<PathBuf>>> = Mutex::new(None);
static AT_EXIT: std::sync::Once = std::sync::Once::new();
static SEQ: AtomicU64 = AtomicU64::new(0);

extern "C" fn remove_live_files() {
    // Never unwind into libc; a lock poisoned or held by a thread that died is skipped.
    let _ = std::panic::catch_unwind(|| {
        if let Some(live) = LIVE.try_lock() {
            for p in live.iter() {
                let _ = std::fs::remove_file(p);
            }
        }
    });
}

/// One allocation's backup file (Note [Disk backup files]).
pub struct DiskFile {
    file: Flock<File>,
    path: PathBuf,
    len: u64,
    direct: bool,
    /// Unit of work and of checksums.
    chunk: u64,
    sums: Box<[AtomicU64]>,
}

impl DiskFile {
    /// Make a file of `len` bytes (> 0) in `dir`, its space reserved, to be written in chunks of
    /// `chunk` bytes (a multiple of [`DIRECT_ALIGN`]).
    pub fn create(dir: &Path, len: u64, chunk: u64) -> Result<Self> {
        if len == 0 || chunk == 0 || chunk % DIRECT_ALIGN != 0 {
            return Err(Error::InvalidArgument(format!(
                "disk backup of {len} bytes in chunks of {chunk}: expected a length above 0 and \
                 a chunk that is a positive multiple of {DIRECT_ALIGN}"
            )));
        }
        sweep_once(dir);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let stamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!("{}-{stamp:x}-{seq}.bin", std::process::id());
        let tmp = dir.join(format!("{TMP_PREFIX}{name}"));
        let path = dir.join(format!("{PREFIX}{name}"));
        let what = |op: &str| format!("{op} disk backup file {}", path.display());
        let direct = len % DIRECT_ALIGN == 0;
        let open = |direct: bool| -> std::io::Result<File> {
            if let Some(e) = injected(DiskOp::Create, &tmp) {
                return Err(e);
            }
            let mut o = OpenOptions::new();
            o.read(true).write(true).create_new(true).mode(0o600);
            o.custom_flags(libc::O_CLOEXEC | if direct { libc::O_DIRECT } else { 0 });
            o.open(&tmp)
        };
        let (file, direct) = match open(direct) {
            Ok(f) => (f, direct),
            // File systems without O_DIRECT (tmpfs, some FUSE) refuse it at open.
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::info!(
                    "{} does not allow O_DIRECT; writing through the page cache",
                    dir.display()
                );
                (open(false).map_err(|e| io_err(what("creating"), e))?, false)
            }
            Err(e) => return Err(io_err(what("creating"), e)),
        };
        let remove_tmp = || {
            let _ = std::fs::remove_file(&tmp);
        };
        // Held as long as the file exists: the sign that its process is alive.
        let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(f) => f,
            Err((_, e)) => {
                remove_tmp();
                return Err(io_err(what("locking"), std::io::Error::from(e)));
            }
        };
        let allocated = match injected(DiskOp::Allocate, &tmp) {
            Some(e) => Err(e),
            None => {
                nix::fcntl::fallocate(&*file, nix::fcntl::FallocateFlags::empty(), 0, len as i64)
                    .map_err(std::io::Error::from)
            }
        };
        match allocated {
            Ok(()) => {}
            // Not every file system reserves space; set the length and find out when writing.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                if let Err(e) = file.set_len(len) {
                    remove_tmp();
                    return Err(io_err(what("sizing"), e));
                }
            }
            Err(e) => {
                remove_tmp();
                return Err(io_err(
                    format!("{} ({} needed)", what("reserving space for"), human(len)),
                    e,
                ));
            }
        }
        if let Err(e) = std::fs::rename(&tmp, &path) {
            remove_tmp();
            return Err(io_err(what("naming"), e));
        }
        AT_EXIT.call_once(|| {
            // SAFETY: registering a plain extern "C" function without arguments.
            unsafe { libc::atexit(remove_live_files) };
        });
        LIVE.lock().push(path.clone());
        let chunks = len.div_ceil(chunk) as usize;
        Ok(DiskFile {
            file,
            path,
            len,
            direct,
            chunk,
            sums: (0..chunks).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes in the file.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never: files have a length above 0.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Written with `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Number of chunks.
    pub fn chunks(&self) -> usize {
        self.sums.len()
    }

    /// Offset and length of chunk `i`.
    pub fn chunk_span(&self, i: usize) -> (u64, u64) {
        let off = i as u64 * self.chunk;
        (off, self.chunk.min(self.len - off))
    }

    /// Write `buf` at `off` in full. With [`DiskFile::direct`], `buf`, `off` and the length are
    /// multiples of [`DIRECT_ALIGN`] (the pipeline's staging slots and chunks are).
    pub fn write_at(&self, buf: &[u8], off: u64) -> Result<()> {
        let r = match injected(DiskOp::Write, &self.path) {
            Some(e) => Err(e),
            None => self.file.write_all_at(buf, off),
        };
        r.map_err(|e| {
            io_err(
                format!(
                    "writing {} bytes at {off} of {}",
                    buf.len(),
                    self.path.display()
                ),
                e,
            )
        })
    }

    /// Read `buf.len()` bytes at `off`; a file cut short is an error.
    pub fn read_at(&self, buf: &mut [u8], off: u64) -> Result<()> {
        let r = match injected(DiskOp::Read, &self.path) {
            Some(e) => Err(e),
            None => self.file.read_exact_at(buf, off),
        };
        r.map_err(|e| {
            let what = format!(
                "reading {} bytes at {off} of {}",
                buf.len(),
                self.path.display()
            );
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                return Error::InvalidState(format!(
                    "{what}: the file is shorter than the backup it holds (it changed on disk \
                     while paused): not restored"
                ));
            }
            io_err(what, e)
        })
    }

    /// Make what was written durable.
    pub fn sync(&self) -> Result<()> {
        let r = match injected(DiskOp::Sync, &self.path) {
            Some(e) => Err(e),
            None => self.file.sync_data(),
        };
        r.map_err(|e| io_err(format!("syncing {}", self.path.display()), e))
    }

    /// Record chunk `i`'s checksum after writing it.
    pub fn set_sum(&self, i: usize, sum: u64) {
        self.sums[i].store(sum, Ordering::Release);
    }

    /// Check chunk `i`'s checksum after reading it.
    pub fn check_sum(&self, i: usize, sum: u64) -> Result<()> {
        let want = self.sums[i].load(Ordering::Acquire);
        if sum == want {
            return Ok(());
        }
        let (off, len) = self.chunk_span(i);
        Err(Error::InvalidState(format!(
            "disk backup file {}: bytes {off}..{} changed on disk while paused (checksum \
             {sum:#018x}, written {want:#018x}): not restored; the allocation stays paused",
            self.path.display(),
            off + len
        )))
    }

    /// Before reading: the file is still there at its length.
    pub fn check_present(&self) -> Result<()> {
        let meta = self
            .file
            .metadata()
            .map_err(|e| io_err(format!("checking {}", self.path.display()), e))?;
        if meta.len() < self.len {
            return Err(Error::InvalidState(format!(
                "disk backup file {} is {} bytes, not {}: it changed on disk while paused; not \
                 restored, the allocation stays paused",
                self.path.display(),
                meta.len(),
                self.len
            )));
        }
        Ok(())
    }
}

impl Drop for DiskFile {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::error!("removing disk backup file {}: {e}", self.path.display());
            }
        }
        LIVE.lock().retain(|p| p != &self.path);
    }
}

/// Remove, once per directory and process, the backup files of processes that died.
fn sweep_once(dir: &Path) {
    {
        let mut swept = SWEPT.lock();
        if !swept
            .get_or_insert_with(HashSet::new)
            .insert(dir.to_path_buf())
        {
            return;
        }
    }
    match sweep(dir) {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            "removed {n} disk backup files left by processes that died in {}",
            dir.display()
        ),
        Err(e) => tracing::warn!(
            "looking for stale disk backup files in {}: {e}",
            dir.display()
        ),
    }
    warn_if_ram(dir);
}

/// Remove the backup files in `dir` no live process holds; returns how many.
pub fn sweep(dir: &Path) -> std::io::Result<usize> {
    let mut removed = 0;
    for entry in std::fs::read_dir(dir)? {
        let Ok(entry) = entry else { continue };
        let name: OsString = entry.file_name();
        let bytes = name.as_bytes();
        let tmp = bytes.starts_with(TMP_PREFIX.as_bytes());
        if !(bytes.starts_with(PREFIX.as_bytes()) || tmp) {
            continue;
        }
        let path = entry.path();
        if tmp {
            let young = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_none_or(|age| age < TMP_GRACE);
            if young {
                continue;
            }
        }
        // Opened without following links, read-only: taking the lock proves no process holds it.
        let Ok(f) = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&path)
        else {
            continue;
        };
        if !f.metadata().is_ok_and(|m| m.is_file()) {
            continue;
        }
        if let Ok(locked) = Flock::lock(f, FlockArg::LockExclusiveNonblock) {
            if std::fs::remove_file(&path).is_ok() {
                removed += 1;
            }
            drop(locked);
        }
    }
    Ok(removed)
}

/// File systems whose contents are host memory (tmpfs, ramfs): allowed, but say so.
fn warn_if_ram(dir: &Path) {
    if is_ram_backed(dir) {
        tracing::warn!(
            "disk backups go to {}, which is in host RAM (tmpfs/ramfs): they take host memory \
             like CPU backups do",
            dir.display()
        );
    }
}

/// Bytes the file system of `dir` can still give an unprivileged writer.
pub fn free_space(dir: &Path) -> Result<u64> {
    let s = nix::sys::statvfs::statvfs(dir).map_err(|e| {
        io_err(
            format!("disk backup directory {}", dir.display()),
            std::io::Error::from(e),
        )
    })?;
    Ok(s.blocks_available() as u64 * s.fragment_size() as u64)
}

/// True if `dir` is on tmpfs or ramfs.
pub fn is_ram_backed(dir: &Path) -> bool {
    use nix::sys::statfs::{statfs, FsType, TMPFS_MAGIC};
    // ramfs has no constant in nix: its magic number from linux/magic.h.
    let ramfs = FsType(0x8584_58f6_u32 as _);
    statfs(dir).is_ok_and(|s| [TMPFS_MAGIC, ramfs].contains(&s.filesystem_type()))
}
#[cfg(test)]
mod tests {
    use super::*;

    /// A page-aligned buffer, as `O_DIRECT` needs (the pipeline's staging slots are).
    #[repr(align(4096))]
    struct Page([u8; 4096]);

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tms-disk-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_file_round_trips_and_goes_on_drop() {
        let d = dir("rt");
        let f = DiskFile::create(&d, 3 * 4096, 8192).unwrap();
        assert_eq!(
            (f.len(), f.chunks(), f.chunk_span(1)),
            (3 * 4096, 2, (8192, 4096))
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(f.path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let data = Box::new(Page([7u8; 4096]));
        f.write_at(&data.0, 4096).unwrap();
        let mut back = Box::new(Page([0u8; 4096]));
        f.read_at(&mut back.0, 4096).unwrap();
        assert_eq!(back.0, data.0);
        let p = f.path().to_path_buf();
        drop(f);
        assert!(!p.exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_sweep_removes_only_files_nobody_holds() {
        let d = dir("sweep");
        let live = DiskFile::create(&d, 4096, 4096).unwrap();
        // A dead process's file: same name pattern, no lock.
        let dead = d.join(format!("{PREFIX}999999-0-0.bin"));
        std::fs::write(&dead, b"old").unwrap();
        let young_tmp = d.join(format!("{TMP_PREFIX}1-0-0.bin"));
        std::fs::write(&young_tmp, b"new").unwrap();
        let other = d.join("unrelated.bin");
        std::fs::write(&other, b"keep").unwrap();
        assert_eq!(sweep(&d).unwrap(), 1);
        assert!(!dead.exists());
        assert!(live.path().exists(), "a live file stays");
        assert!(young_tmp.exists(), "a file being made stays");
        assert!(other.exists());
        drop(live);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn injected_faults_fire_once_at_the_nth_call() {
        let d = dir("faults");
        let f = DiskFile::create(&d, 8192, 4096).unwrap();
        arm_fault(Some(&d), DiskOp::Write, 2, libc::ENOSPC);
        let page = Box::new(Page([1u8; 4096]));
        f.write_at(&page.0, 0).unwrap();
        let e = f.write_at(&page.0, 4096).unwrap_err();
        assert!(e.is_oom() && e.to_string().contains("full"), "{e}");
        f.write_at(&page.0, 4096).unwrap();
        arm_fault(Some(&d), DiskOp::Create, 1, libc::EROFS);
        let e = DiskFile::create(&d, 4096, 4096).err().unwrap();
        assert!(e.to_string().contains("Read-only"), "{e}");
        assert_eq!(
            std::fs::read_dir(&d).unwrap().count(),
            1,
            "no file left behind"
        );
        drop(f);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn ram_backed_directories_are_recognised_as_the_mount_table_says() {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
        let fs_of = |p: &str| {
            mounts
                .lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    (f.len() > 2 && Path::new(p).starts_with(f[1])).then(|| (f[1].len(), f[2]))
                })
                .max()
                .map(|(_, t)| t.to_string())
        };
        for p in ["/dev/shm", "/proc", "/"] {
            if let Some(t) = fs_of(p) {
                let ram = t == "tmpfs" || t == "ramfs";
                assert_eq!(is_ram_backed(Path::new(p)), ram, "{p} is {t}");
            }
        }
    }

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
