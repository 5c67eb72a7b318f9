//! Disk backups: each allocation's contents in a file of its own, written and read by the copy
//! pipeline through its page-locked staging slots (engine Note [The copy pipeline]).
//!
//! # Note [Disk backup files]
//!
//! - A file is made at an allocation's first disk-backed pause, in the directory set then
//!   (`set_disk_backup_dir`, else `TMS_DISK_BACKUP_DIR`, else the system's temporary directory),
//!   with mode `0600`, `O_CLOEXEC`, and `O_DIRECT` where the file system allows it: backups
//!   then neither fill the page cache nor sit in it unwritten when the pause returns (each file
//!   is also `fdatasync`ed before its device memory is released). Its whole length is reserved
//!   with `fallocate` up front, so a full disk fails the pause before anything is copied.
//! - It is reused by every later pause of the allocation (disk use stays constant) and removed
//!   when the allocation is freed, at process exit, and on SIGTERM or SIGINT where the host
//!   left their default action (Note [Removal at exit and on a termination signal] in `os.rs`).
//! - A process holds an exclusive `flock` on each of its files while they exist. A file in the
//!   directory whose lock can be taken belongs to a process that died: the first process to use
//!   the directory removes it. A live process's files are never touched (this holds across pid
//!   namespaces, where pids mean nothing). Files are made under a temporary name and renamed
//!   once locked, so no sweep can take a file between its creation and its lock.
//!
//! # Note [The disk backup folder]
//!
//! The directory may be one other users can write to (the system's temporary directory is the
//! default), and there they could plant anything under the names we use: a FIFO, whose
//! `open` blocks for ever; a symbolic link to a file of ours; a file of theirs. So:
//!
//! - The directory is resolved once, when set (a relative path against the current folder
//!   then), and held open: every file operation is `openat`/`renameat`/`unlinkat` on its fd,
//!   so a later `chdir`, or a rename or replacement of the path, changes nothing.
//! - Files go in the directory itself only when nobody else can make entries there: it belongs
//!   to us and neither group nor others may write to it. Otherwise (`/tmp`, a group folder, a
//!   folder of another user, one of mode 0777 with or without the sticky bit) they go in our
//!   subfolder `tms-backups-<uid>`, made with mode 0700 and refused unless it is a real folder
//!   (not a link), ours, closed to group and others. Another user can then at worst make that
//!   name first, which fails our disk-backed pauses with a message saying so.
//! - The sweep opens only regular files of ours: each candidate is checked with `fstatat`
//!   without following links, then opened with `O_NOFOLLOW | O_NONBLOCK` and checked again
//!   with `fstat`, so nothing in the folder can make it block, under the operation lock or
//!   elsewhere.
//! - Each chunk's contents carry an xxh3 checksum, computed as the chunk is written and checked
//!   as it is read back (a few percent of a core at disk speed): a file that changed on disk
//!   while paused (truncated, overwritten) fails the resume, which leaves the tag paused; it is
//!   never silently restored.
//! - Every file operation can be made to fail ([`arm_fault`], `TMS_DISK_FAULTS`), so the tests
//!   prove that no failure loses data: a pause that cannot write leaves the allocation active
//!   with its contents, a resume that cannot read leaves it paused with its file.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, Flock, FlockArg, OFlag};
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::UnlinkatFlags;
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::os::ExitRemoval;
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
            Error::invalid_argument(format!(
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
        return Error::out_of_memory(format!("{what}: {e} (the disk backup directory is full)"));
    }
    Error::io(what, e)
}

static SEQ: AtomicU64 = AtomicU64::new(0);

fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// The subfolder of ours made in a directory others can write to (Note [The disk backup
/// folder]).
pub fn private_subfolder_name(uid: u32) -> String {
    format!("tms-backups-{uid}")
}

fn errno_io(e: Errno) -> std::io::Error {
    std::io::Error::from(e)
}

/// A disk backup directory as chosen (`set_disk_backup_dir`, `TMS_DISK_BACKUP_DIR`, the
/// system's temporary directory), resolved once and held open (Note [The disk backup folder]).
#[derive(Debug)]
pub struct BackupDir {
    /// Its absolute path when it was resolved, for messages.
    shown: PathBuf,
    fd: OwnedFd,
    /// Where the files go, once prepared.
    files: Mutex<Option<Arc<FileDir>>>,
}

/// The folder the files are in: the chosen directory, or our private subfolder of it.
#[derive(Debug)]
pub struct FileDir {
    shown: PathBuf,
    fd: OwnedFd,
}

impl FileDir {
    /// Its path (as resolved; for messages).
    pub fn path(&self) -> &Path {
        &self.shown
    }
}

fn open_dir_at<P: ?Sized + nix::NixPath>(
    at: impl AsFd,
    path: &P,
    follow: bool,
) -> nix::Result<OwnedFd> {
    let mut flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
    if !follow {
        flags |= OFlag::O_NOFOLLOW;
    }
    nix::fcntl::openat(at, path, flags, Mode::empty())
}

impl BackupDir {
    /// Resolve `path` (an existing directory; relative to the current folder) and hold it open.
    pub fn open(path: &Path) -> Result<Arc<BackupDir>> {
        let bad = |why: String| {
            Error::invalid_argument(format!("disk backup directory {}: {why}", path.display()))
        };
        if path.as_os_str().is_empty() {
            return Err(bad("an empty path".into()));
        }
        let shown = std::path::absolute(path).map_err(|e| bad(e.to_string()))?;
        // The path is the user's choice: links in it are followed (only the subfolder we make
        // in it, if any, must not be one).
        let fd = open_dir_at(nix::fcntl::AT_FDCWD, path, true).map_err(|e| match e {
            Errno::ENOTDIR => bad("not a directory".into()),
            e => bad(errno_io(e).to_string()),
        })?;
        Ok(Arc::new(BackupDir {
            shown,
            fd,
            files: Mutex::new(None),
        }))
    }

    /// Its path as resolved.
    pub fn path(&self) -> &Path {
        &self.shown
    }

    /// The folder the files go in, made and checked on first use; the first use in this
    /// process also sweeps it of the files of processes that died.
    pub fn files(&self) -> Result<Arc<FileDir>> {
        let mut g = self.files.lock();
        if let Some(f) = &*g {
            return Ok(f.clone());
        }
        let f = Arc::new(self.prepare()?);
        *g = Some(f.clone());
        drop(g);
        sweep_once(&f);
        Ok(f)
    }

    fn prepare(&self) -> Result<FileDir> {
        let me = euid();
        let base = &self.shown;
        let st = nix::sys::stat::fstat(&self.fd).map_err(|e| {
            io_err(
                format!("disk backup directory {}", base.display()),
                e.into(),
            )
        })?;
        if st.st_uid == me && st.st_mode & 0o022 == 0 {
            // Nobody else can make, rename or remove entries here: the files go right in it.
            let fd = open_dir_at(&self.fd, ".", true).map_err(|e| {
                io_err(
                    format!("disk backup directory {}", base.display()),
                    e.into(),
                )
            })?;
            return Ok(FileDir {
                shown: base.clone(),
                fd,
            });
        }
        let name = private_subfolder_name(me);
        let shown = base.join(&name);
        let refuse = |why: String| {
            Error::invalid_state(format!(
                "disk backup directory {}: others can write to it, so backups go to its \
                 subfolder {}, which {why}: refused (remove it, or choose a directory of yours \
                 with set_disk_backup_dir or TMS_DISK_BACKUP_DIR)",
                base.display(),
                shown.display()
            ))
        };
        match nix::sys::stat::mkdirat(&self.fd, name.as_str(), Mode::S_IRWXU) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(io_err(format!("creating {}", shown.display()), e.into())),
        }
        let fd = open_dir_at(&self.fd, name.as_str(), false).map_err(|e| match e {
            Errno::ELOOP | Errno::ENOTDIR => refuse("is a symbolic link or not a folder".into()),
            e => io_err(format!("opening {}", shown.display()), e.into()),
        })?;
        let st = nix::sys::stat::fstat(&fd)
            .map_err(|e| io_err(format!("inspecting {}", shown.display()), e.into()))?;
        if st.st_uid != me {
            return Err(refuse(format!("belongs to uid {}, not {me}", st.st_uid)));
        }
        let mode = st.st_mode & 0o777;
        if mode & 0o077 != 0 {
            return Err(refuse(format!(
                "has mode {mode:04o}: group or others have access (want 0700)"
            )));
        }
        if mode != 0o700 {
            // Ours and closed to others, but a umask such as 0777 left us without access.
            nix::sys::stat::fchmod(&fd, Mode::S_IRWXU)
                .map_err(|e| io_err(format!("giving {} mode 0700", shown.display()), e.into()))?;
        }
        Ok(FileDir { shown, fd })
    }

    /// Remove the backup files no live process holds from the folder the files go in; returns
    /// how many.
    pub fn sweep(&self) -> Result<usize> {
        let f = self.files()?;
        sweep(&f).map_err(|e| io_err(format!("sweeping {}", f.shown.display()), e))
    }
}

/// One allocation's backup file (Note [Disk backup files]).
pub struct DiskFile {
    file: Flock<File>,
    dir: Arc<FileDir>,
    name: CString,
    path: PathBuf,
    /// Removal at exit and on a termination signal (`None`: too many files to record).
    exit: Option<ExitRemoval>,
    len: u64,
    direct: bool,
    /// Unit of work and of checksums.
    chunk: u64,
    sums: Box<[AtomicU64]>,
}

impl DiskFile {
    /// Make a file of `len` bytes (> 0) in `dir`, its space reserved, to be written in chunks of
    /// `chunk` bytes (a multiple of [`DIRECT_ALIGN`]).
    pub fn create(dir: &BackupDir, len: u64, chunk: u64) -> Result<Self> {
        if len == 0 || chunk == 0 || chunk % DIRECT_ALIGN != 0 {
            return Err(Error::invalid_argument(format!(
                "disk backup of {len} bytes in chunks of {chunk}: expected a length above 0 and \
                 a chunk that is a positive multiple of {DIRECT_ALIGN}"
            )));
        }
        let files = dir.files()?;
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let stamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let base = format!("{}-{stamp:x}-{seq}.bin", std::process::id());
        let tmp_name = format!("{TMP_PREFIX}{base}");
        let name = format!("{PREFIX}{base}");
        let tmp = files.shown.join(&tmp_name);
        let path = files.shown.join(&name);
        let what = |op: &str| format!("{op} disk backup file {}", path.display());
        let direct = len % DIRECT_ALIGN == 0;
        let open = |direct: bool| -> std::io::Result<File> {
            if let Some(e) = injected(DiskOp::Create, &tmp) {
                return Err(e);
            }
            let mut flags = OFlag::O_RDWR
                | OFlag::O_CREAT
                | OFlag::O_EXCL
                | OFlag::O_NOFOLLOW
                | OFlag::O_CLOEXEC;
            if direct {
                flags |= OFlag::O_DIRECT;
            }
            let mode = Mode::S_IRUSR | Mode::S_IWUSR;
            nix::fcntl::openat(&files.fd, tmp_name.as_str(), flags, mode)
                .map(File::from)
                .map_err(errno_io)
        };
        let (file, direct) = match open(direct) {
            Ok(f) => (f, direct),
            // File systems without O_DIRECT (tmpfs, some FUSE) refuse it at open.
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::info!(
                    "{} does not allow O_DIRECT; writing through the page cache",
                    files.shown.display()
                );
                (open(false).map_err(|e| io_err(what("creating"), e))?, false)
            }
            Err(e) => return Err(io_err(what("creating"), e)),
        };
        let remove_tmp = || {
            let _ = nix::unistd::unlinkat(&files.fd, tmp_name.as_str(), UnlinkatFlags::NoRemoveDir);
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
        if let Err(e) = nix::fcntl::renameat(&files.fd, tmp_name.as_str(), &files.fd, name.as_str())
        {
            remove_tmp();
            return Err(io_err(what("naming"), e.into()));
        }
        let exit = ExitRemoval::register(files.fd.as_raw_fd(), name.as_bytes());
        if exit.is_none() {
            tracing::debug!(
                "{} is not removed at exit (too many files); it is at free, or by a later sweep",
                path.display()
            );
        }
        let chunks = len.div_ceil(chunk) as usize;
        Ok(DiskFile {
            file,
            dir: files,
            name: CString::new(name).expect("a name of ours has no NUL"),
            path,
            exit,
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
                return Error::invalid_state(format!(
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
        Err(Error::invalid_state(format!(
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
            return Err(Error::invalid_state(format!(
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
        // Forgotten before the removal: the slot may never name a file that is gone.
        drop(self.exit.take());
        match nix::unistd::unlinkat(
            &self.dir.fd,
            self.name.as_c_str(),
            UnlinkatFlags::NoRemoveDir,
        ) {
            Ok(()) | Err(Errno::ENOENT) => {}
            Err(e) => tracing::error!("removing disk backup file {}: {e}", self.path.display()),
        }
    }
}

/// Remove the backup files of processes that died, when a folder is first used (once per
/// `set_disk_backup_dir`: a folder's identity cannot be kept across them, as inode numbers are
/// reused at once on tmpfs).
fn sweep_once(dir: &FileDir) {
    match sweep(dir) {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            "removed {n} disk backup files left by processes that died in {}",
            dir.shown.display()
        ),
        Err(e) => tracing::warn!(
            "looking for stale disk backup files in {}: {e}",
            dir.shown.display()
        ),
    }
    if fd_is_ram_backed(&dir.fd) {
        tracing::warn!(
            "disk backups go to {}, which is in host RAM (tmpfs/ramfs): they take host memory \
             like CPU backups do",
            dir.shown.display()
        );
    }
}

/// Remove the backup files in `dir` no live process holds; returns how many. Opens nothing but
/// regular files of ours, never blocks (Note [The disk backup folder]).
pub fn sweep(dir: &FileDir) -> std::io::Result<usize> {
    let me = euid();
    let listing = nix::dir::Dir::openat(
        &dir.fd,
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(errno_io)?;
    let mut names: Vec<(CString, bool)> = Vec::new();
    let mut listing = listing;
    for entry in listing.iter() {
        let Ok(entry) = entry else { continue };
        let name: &CStr = entry.file_name();
        let bytes = name.to_bytes();
        let tmp = bytes.starts_with(TMP_PREFIX.as_bytes());
        if tmp || bytes.starts_with(PREFIX.as_bytes()) {
            names.push((name.to_owned(), tmp));
        }
    }
    drop(listing);
    let ours_and_regular = |st: &nix::sys::stat::FileStat| {
        SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFREG && st.st_uid == me
    };
    let mut removed = 0;
    for (name, tmp) in names {
        let Ok(before) =
            nix::sys::stat::fstatat(&dir.fd, name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
        else {
            continue;
        };
        if !ours_and_regular(&before) {
            continue;
        }
        if tmp {
            let modified =
                SystemTime::UNIX_EPOCH + Duration::from_secs(before.st_mtime.max(0) as u64);
            let young = modified.elapsed().map_or(true, |age| age < TMP_GRACE);
            if young {
                continue;
            }
        }
        // Checked again once open: the name may have changed hands since fstatat.
        let flags = OFlag::O_RDONLY
            | OFlag::O_NOFOLLOW
            | OFlag::O_NONBLOCK
            | OFlag::O_NOCTTY
            | OFlag::O_CLOEXEC;
        let Ok(fd) = nix::fcntl::openat(&dir.fd, name.as_c_str(), flags, Mode::empty()) else {
            continue;
        };
        match nix::sys::stat::fstat(&fd) {
            Ok(st) if ours_and_regular(&st) && st.st_ino == before.st_ino => {}
            _ => continue,
        }
        // Taking the lock proves no process holds it.
        if let Ok(locked) = Flock::lock(File::from(fd), FlockArg::LockExclusiveNonblock) {
            if nix::unistd::unlinkat(&dir.fd, name.as_c_str(), UnlinkatFlags::NoRemoveDir).is_ok() {
                removed += 1;
            }
            drop(locked);
        }
    }
    Ok(removed)
}

/// Bytes the file system of `dir` can still give an unprivileged writer.
pub fn free_space(dir: &BackupDir) -> Result<u64> {
    let s = nix::sys::statvfs::fstatvfs(&dir.fd).map_err(|e| {
        io_err(
            format!("disk backup directory {}", dir.shown.display()),
            std::io::Error::from(e),
        )
    })?;
    Ok(s.blocks_available() as u64 * s.fragment_size() as u64)
}

fn fd_is_ram_backed(fd: impl AsFd) -> bool {
    use nix::sys::statfs::{fstatfs, FsType, TMPFS_MAGIC};
    // ramfs has no constant in nix: its magic number from linux/magic.h.
    let ramfs = FsType(0x8584_58f6_u32 as _);
    fstatfs(fd).is_ok_and(|s| [TMPFS_MAGIC, ramfs].contains(&s.filesystem_type()))
}

/// True if `dir` is on tmpfs or ramfs.
pub fn is_ram_backed(dir: &Path) -> bool {
    use nix::sys::statfs::{statfs, FsType, TMPFS_MAGIC};
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
        let f = DiskFile::create(&BackupDir::open(&d).unwrap(), 3 * 4096, 8192).unwrap();
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
        let bd = BackupDir::open(&d).unwrap();
        let live = DiskFile::create(&bd, 4096, 4096).unwrap();
        // A dead process's file: same name pattern, no lock.
        let dead = d.join(format!("{PREFIX}999999-0-0.bin"));
        std::fs::write(&dead, b"old").unwrap();
        let young_tmp = d.join(format!("{TMP_PREFIX}1-0-0.bin"));
        std::fs::write(&young_tmp, b"new").unwrap();
        let other = d.join("unrelated.bin");
        std::fs::write(&other, b"keep").unwrap();
        assert_eq!(bd.sweep().unwrap(), 1);
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
        let bd = BackupDir::open(&d).unwrap();
        let f = DiskFile::create(&bd, 8192, 4096).unwrap();
        arm_fault(Some(&d), DiskOp::Write, 2, libc::ENOSPC);
        let page = Box::new(Page([1u8; 4096]));
        f.write_at(&page.0, 0).unwrap();
        let e = f.write_at(&page.0, 4096).unwrap_err();
        assert!(e.is_oom() && e.to_string().contains("full"), "{e}");
        f.write_at(&page.0, 4096).unwrap();
        arm_fault(Some(&d), DiskOp::Create, 1, libc::EROFS);
        let e = DiskFile::create(&bd, 4096, 4096).err().unwrap();
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
