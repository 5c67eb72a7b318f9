//! One allocation's disk backup file: its format (chunks, `O_DIRECT` alignment, a checksum per
//! chunk) and how the copy pipeline moves it through its staging slots ([`Backing`]).
//!
//! # Note [Disk backup files]
//!
//! - A file is made at an allocation's first disk-backed pause, in the directory set then
//!   (`set_disk_backup_dir`, else `TMS_DISK_BACKUP_DIR`, else the system's temporary directory;
//!   the folder's rules are Note [The disk backup folder] in `disk.rs`), with mode `0600`,
//!   `O_CLOEXEC`, and `O_DIRECT` where the file system allows it: backups then neither fill the
//!   page cache nor sit in it unwritten when the pause returns (each file is also `fdatasync`ed
//!   before its device memory is released). Its whole length is reserved with `fallocate` up
//!   front, so a full disk fails the pause before anything is copied.
//! - It is reused by every later pause of the allocation (disk use stays constant) and removed
//!   when the allocation is freed, at process exit, and on SIGTERM or SIGINT where the host
//!   left their default action (Note [Removal at exit and on a termination signal] in `os.rs`).
//! - A process holds an exclusive `flock` on each of its files while they exist. A file in the
//!   directory whose lock can be taken belongs to a process that died: the first process to use
//!   the directory removes it. A live process's files are never touched (this holds across pid
//!   namespaces, where pids mean nothing). Files are made under a temporary name and renamed
//!   once locked, so no sweep can take a file between its creation and its lock (the names are
//!   `tms_disk_folder`'s, which `tmsctl clean` shares). This process's own sweeps (a folder used
//!   anew, chosen again) also leave alone every file it holds open, known by device and inode
//!   from before it is named (`disk.rs`'s `Held`): a lock proves nothing to the process holding
//!   it where a file system emulates `flock` with POSIX locks, which never set a process's own
//!   requests against each other.
//! - The file is cut in chunks of one size (a multiple of [`DIRECT_ALIGN`]) but the last, which
//!   divide the allocation's (engine Note [Chunked allocations]); the pipeline copies a file
//!   chunk whole, through the worker's page-locked staging slots, each slot-sized piece one
//!   `pwrite`/`pread`. Each chunk's contents carry an xxh3 checksum, computed here as the pieces
//!   pass ([`Backing::staged`]) when the chunk is written and checked as it is read back (a few
//!   percent of a core at disk speed): a file that changed on disk while paused (truncated,
//!   overwritten) fails the resume, which leaves the tag paused; it is never silently restored.
//!   Its length is checked before reading ([`DiskFile::check_present`]), and a read that fails
//!   on a file cut short meanwhile says so, whatever the kernel answered ([`DiskFile::read_at`]).
//! - Every file operation can be made to fail (`disk_faults.rs`, `TMS_DISK_FAULTS`), so the
//!   tests prove that no failure loses data: a pause that cannot write leaves the allocation
//!   active with its contents, a resume that cannot read leaves it paused with its file.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg, OFlag};
use nix::sys::stat::Mode;
use nix::unistd::UnlinkatFlags;
use xxhash_rust::xxh3::Xxh3;

use super::backing::{Backing, Dir, UnitIo};
use super::disk::{errno_io, io_err, BackupDir, FileDir, Held};
use super::disk_faults::{injected, DiskOp};
use super::BackupKind;
use crate::error::{Error, Result};
use crate::os::ExitRemoval;
use crate::units::human;

/// `O_DIRECT` transfers are aligned to this (the largest logical block size in common use).
pub const DIRECT_ALIGN: u64 = 4096;

/// Further attempts at a call a pending signal interrupted (EINTR, which SA_RESTART does not
/// restart for these) before its failure stands: a steady stream of signals must not make it
/// spin for ever.
const RETRIES_WHEN_INTERRUPTED: usize = 8;

/// `call()`, made again while a signal interrupts it, at most [`RETRIES_WHEN_INTERRUPTED`] times.
fn retried_when_interrupted(mut call: impl FnMut() -> std::io::Result<()>) -> std::io::Result<()> {
    let mut r = call();
    for _ in 0..RETRIES_WHEN_INTERRUPTED {
        if !r
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::Interrupted)
        {
            break;
        }
        r = call();
    }
    r
}

/// Makes each file's name unique within the process.
static SEQ: AtomicU64 = AtomicU64::new(0);

/// One allocation's backup file (Note [Disk backup files]).
pub struct DiskFile {
    file: Flock<File>,
    /// Known to this process's sweeps as its own (dropped after the name goes).
    _held: Held,
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
        if len == 0 || chunk == 0 || !chunk.is_multiple_of(DIRECT_ALIGN) {
            return Err(Error::invalid_argument(format!(
                "disk backup of {len} bytes in chunks of {chunk}: expected a length above 0 and \
                 a chunk that is a positive multiple of {DIRECT_ALIGN}"
            )));
        }
        match Self::create_in(dir.files()?, len, chunk) {
            // The folder was removed between finding it and making the file (a job wiping it):
            // found again once.
            Err((e, true)) => {
                tracing::info!("{e}; looking for the folder again");
                Self::create_in(dir.files()?, len, chunk).map_err(|(e, _)| e)
            }
            r => r.map_err(|(e, _)| e),
        }
    }

    /// [`DiskFile::create`] in `files`; an error says whether the folder was gone.
    fn create_in(
        files: Arc<FileDir>,
        len: u64,
        chunk: u64,
    ) -> std::result::Result<Self, (Error, bool)> {
        let gone = |e: &std::io::Error| e.raw_os_error() == Some(libc::ENOENT);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let stamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let base = tms_disk_folder::unique_part(std::process::id(), stamp, seq);
        let tmp_name = tms_disk_folder::tmp_name(&base);
        let name = tms_disk_folder::file_name(&base);
        let tmp = files.shown.join(&tmp_name);
        let path = files.shown.join(&name);
        let what = |op: &str| format!("{op} disk backup file {}", path.display());
        let direct = len.is_multiple_of(DIRECT_ALIGN);
        let remove_tmp = || {
            let _ = nix::unistd::unlinkat(&files.fd, tmp_name.as_str(), UnlinkatFlags::NoRemoveDir);
        };
        let open_at = |direct: bool| -> std::io::Result<File> {
            let mut flags = OFlag::O_RDWR
                | OFlag::O_CREAT
                | OFlag::O_EXCL
                | OFlag::O_NOFOLLOW
                | OFlag::O_CLOEXEC;
            if direct {
                flags |= OFlag::O_DIRECT;
            }
            let mode = Mode::S_IRUSR | Mode::S_IWUSR;
            let fd =
                nix::fcntl::openat(&files.fd, tmp_name.as_str(), flags, mode).map_err(errno_io)?;
            // The mode asked, whatever the umask: a sweep must be able to open it (to take its
            // lock) once this process is gone. Refused (a file system that keeps no modes), the
            // file made goes now rather than at a sweep a minute later.
            let chmod = match injected(DiskOp::Chmod, &tmp) {
                Some(e) => Err(e),
                None => nix::sys::stat::fchmod(&fd, mode).map_err(errno_io),
            };
            if let Err(e) = chmod {
                remove_tmp();
                return Err(e);
            }
            Ok(File::from(fd))
        };
        let open = |direct: bool| -> std::io::Result<File> {
            match injected(DiskOp::Create, &tmp) {
                // As a file system without O_DIRECT refuses it: after making the file.
                Some(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                    drop(open_at(false));
                    Err(e)
                }
                Some(e) => Err(e),
                None => open_at(direct),
            }
        };
        let (file, direct) = match open(direct) {
            Ok(f) => (f, direct),
            // File systems without O_DIRECT (ramfs, tmpfs before Linux 6.6, some FUSE) refuse
            // it at open, some after making the file: it goes (the name is ours, in a folder
            // only we can write to), and it is made again without the flag.
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::info!(
                    "{} does not allow O_DIRECT; writing through the page cache",
                    files.shown.display()
                );
                remove_tmp();
                match open(false) {
                    Ok(f) => (f, false),
                    // The folder may be wiped between the two opens too.
                    Err(e) => {
                        let g = gone(&e);
                        return Err((io_err(what("creating"), e), g));
                    }
                }
            }
            Err(e) => {
                let g = gone(&e);
                return Err((io_err(what("creating"), e), g));
            }
        };
        // Held as long as the file exists: the sign that its process is alive.
        let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(f) => f,
            Err((_, e)) => {
                remove_tmp();
                return Err((io_err(what("locking"), std::io::Error::from(e)), false));
            }
        };
        // Known as this process's own before it has a name a sweep takes.
        let held = match Held::register(&file) {
            Ok(h) => h,
            Err(e) => {
                remove_tmp();
                return Err((io_err(what("inspecting"), e), false));
            }
        };
        let reserve = || match injected(DiskOp::Allocate, &tmp) {
            Some(e) => Err(e),
            None => {
                nix::fcntl::fallocate(&*file, nix::fcntl::FallocateFlags::empty(), 0, len as i64)
                    .map_err(std::io::Error::from)
            }
        };
        // tmpfs gives up with EINTR whenever a signal is pending (a profiler's timer, SIGCHLD),
        // undoing what it reserved.
        let allocated = retried_when_interrupted(reserve);
        match allocated {
            Ok(()) => {}
            // Not every file system reserves space, nor does one that keeps being interrupted:
            // set the length and find out when writing.
            Err(e)
                if e.raw_os_error() == Some(libc::EOPNOTSUPP)
                    || e.kind() == std::io::ErrorKind::Interrupted =>
            {
                if let Err(e) = file.set_len(len) {
                    remove_tmp();
                    return Err((io_err(what("sizing"), e), false));
                }
            }
            Err(e) => {
                remove_tmp();
                return Err((
                    io_err(
                        format!("{} ({} needed)", what("reserving space for"), human(len)),
                        e,
                    ),
                    false,
                ));
            }
        }
        if let Err(e) = nix::fcntl::renameat(&files.fd, tmp_name.as_str(), &files.fd, name.as_str())
        {
            remove_tmp();
            let e = errno_io(e);
            let g = gone(&e);
            return Err((io_err(what("naming"), e), g));
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
            _held: held,
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

    /// Read `buf.len()` bytes at `off`; a file cut short is an error that says so.
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
            // Cut short while being read (its length was checked before): an O_DIRECT read
            // stops at an unaligned end, and before Linux 5.10 reading on from there is refused
            // as unaligned (EINVAL) rather than finding the end. The length tells.
            let end = off + buf.len() as u64;
            if let Ok(m) = self.file.metadata() {
                if m.len() < end {
                    return Error::invalid_state(format!(
                        "{what}: the file is {} bytes, not {}: it was cut short on disk; not \
                         restored",
                        m.len(),
                        self.len
                    ));
                }
            }
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
        // NFS and FUSE may give up with EINTR on a pending signal: what was written is still to
        // be made durable, so it is asked again.
        let r = retried_when_interrupted(|| match injected(DiskOp::Sync, &self.path) {
            Some(e) => Err(e),
            None => self.file.sync_data(),
        });
        r.map_err(|e| io_err(format!("syncing {}", self.path.display()), e))
    }

    /// Record chunk `i`'s checksum after writing it.
    fn set_sum(&self, i: usize, sum: u64) {
        self.sums[i].store(sum, Ordering::Release);
    }

    /// Check chunk `i`'s checksum after reading it.
    fn check_sum(&self, i: usize, sum: u64) -> Result<()> {
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

    /// Whether the file still has a name (its folder was not wiped, nor the file removed).
    /// Unnamed, it is still ours and readable through the descriptor held.
    pub fn linked(&self) -> bool {
        // An error tells nothing about the name: the file is kept.
        self.file.metadata().map_or(true, |m| {
            use std::os::unix::fs::MetadataExt;
            m.nlink() > 0
        })
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

impl DiskFile {
    /// Refuse a chunk size setting for disk backups (`CopyConfig::disk_chunk`) that files
    /// cannot be cut in: 0 (the host chunk) or a multiple of [`DIRECT_ALIGN`].
    pub fn check_chunk_setting(bytes: u64) -> Result<()> {
        if !bytes.is_multiple_of(DIRECT_ALIGN) {
            return Err(Error::invalid_argument(format!(
                "disk backup chunk of {bytes} bytes: expected a multiple of {DIRECT_ALIGN}"
            )));
        }
        Ok(())
    }
}

impl Backing for DiskFile {
    fn kind(&self) -> BackupKind {
        BackupKind::Disk
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn chunks(&self) -> usize {
        DiskFile::chunks(self)
    }

    fn chunk_span(&self, k: usize) -> (u64, u64) {
        DiskFile::chunk_span(self, k)
    }

    /// Never: a file is always copied through the staging slots.
    fn direct(&self, _k: usize, _off: u64, _pin_now: bool) -> Result<Option<*mut u8>> {
        Ok(None)
    }

    /// Always a whole chunk, checksummed as its pieces pass: the sum is recorded when saving
    /// and checked when restoring (Note [Disk backup files]).
    unsafe fn staged(
        &self,
        dir: Dir,
        k: usize,
        off: u64,
        len: u64,
        pieces: &mut dyn FnMut(&mut dyn UnitIo) -> Result<()>,
    ) -> Result<()> {
        let span = self.chunk_span(k);
        if (off, len) != span {
            return Err(Error::internal(format!(
                "a copy of bytes {off}+{len} cuts disk backup chunk {k} ({}+{})",
                span.0, span.1
            )));
        }
        let mut unit = FileUnit {
            file: self,
            base: off,
            hash: Xxh3::new(),
        };
        pieces(&mut unit)?;
        let sum = unit.hash.digest();
        match dir {
            Dir::Save => {
                self.set_sum(k, sum);
                Ok(())
            }
            Dir::Restore => self.check_sum(k, sum),
        }
    }
}

/// One chunk of a file being copied, with its running checksum.
struct FileUnit<'a> {
    file: &'a DiskFile,
    /// The chunk's offset in the file.
    base: u64,
    hash: Xxh3,
}

impl UnitIo for FileUnit<'_> {
    fn load(&mut self, at: u64, slot: &mut [u8]) -> Result<()> {
        self.file.read_at(slot, self.base + at)?;
        self.hash.update(slot);
        Ok(())
    }

    fn store(&mut self, at: u64, slot: &[u8]) -> Result<()> {
        self.hash.update(slot);
        self.file.write_at(slot, self.base + at)
    }
}

#[cfg(test)]
mod tests {
    use super::super::disk_faults::{arm_fault, pending_faults};
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
        let f = DiskFile::create(&BackupDir::new(&d).unwrap(), 3 * 4096, 8192).unwrap();
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
    fn a_file_cut_short_at_an_unaligned_length_while_read_is_told_as_such() {
        // Cut while a resume reads it (the length checked before reading was whole): an O_DIRECT
        // read stops at the unaligned end, and reading on from there finds the end (Linux 5.10
        // on) or, before (on file systems of the kernel's generic direct I/O code, ext4 before
        // 5.5 among them), is refused as an unaligned read (EINVAL), injected here.
        let d = dir("cut");
        let f = DiskFile::create(&BackupDir::new(&d).unwrap(), 4 * 4096, 8192).unwrap();
        let page = Box::new(Page([5u8; 4096]));
        for i in 0..4 {
            f.write_at(&page.0, i * 4096).unwrap();
        }
        let cut = 2 * 4096 + 100;
        let other = std::fs::OpenOptions::new()
            .write(true)
            .open(f.path())
            .unwrap();
        other.set_len(cut).unwrap();
        let mut back = Box::new(Page([0u8; 4096]));
        let found_end = f.read_at(&mut back.0, 2 * 4096).unwrap_err();
        arm_fault(Some(&d), DiskOp::Read, 1, libc::EINVAL);
        let refused = f.read_at(&mut back.0, 2 * 4096).unwrap_err();
        assert_eq!(pending_faults(Some(&d)), 0);
        for e in [refused, found_end] {
            let msg = e.to_string();
            assert!(
                msg.contains(&*f.path().to_string_lossy())
                    && msg.contains("reading 4096 bytes at 8192")
                    && msg.contains(&format!("is {cut} bytes, not {}", 4 * 4096))
                    && msg.contains("cut short"),
                "{msg}"
            );
            assert!(!msg.contains("Invalid argument"), "{msg}");
        }
        // Before the cut the file is whole: a read there succeeds, and its failure is its own.
        f.read_at(&mut back.0, 4096).unwrap();
        assert_eq!(back.0, page.0);
        arm_fault(Some(&d), DiskOp::Read, 1, libc::EIO);
        let msg = f.read_at(&mut back.0, 4096).unwrap_err().to_string();
        assert!(
            msg.contains("Input/output error") && !msg.contains("cut short"),
            "{msg}"
        );
        drop((f, other));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_sweep_in_this_process_never_takes_a_file_it_holds_even_where_the_lock_is_free() {
        // Where a file system lets a process take a lock it holds already (flock emulated with
        // POSIX locks, which a process's own requests never conflict with), the lock tells
        // nothing to this process's own sweep. Released here, as such a file system would see
        // it.
        let d = dir("own");
        let bd = BackupDir::new(&d).unwrap();
        let f = DiskFile::create(&bd, 8192, 4096).unwrap();
        // SAFETY: flock(2) on a descriptor `f` holds open; only its lock changes.
        assert_eq!(unsafe { libc::flock(f.file.as_raw_fd(), libc::LOCK_UN) }, 0);
        let dead = d.join(tms_disk_folder::file_name("999999-0-0.bin"));
        std::fs::write(&dead, b"old").unwrap();
        assert_eq!(bd.sweep().unwrap(), 1, "the dead process's file goes");
        assert!(!dead.exists());
        assert!(f.path().exists(), "this process's own file stays");
        // The same folder chosen again (`set_disk_backup_dir`) is swept at its first file.
        let again = BackupDir::new(&d).unwrap();
        let g = DiskFile::create(&again, 4096, 4096).unwrap();
        assert!(f.path().exists(), "this process's own file stays");
        // Once gone from this process, its files are another's to sweep.
        let kept = d.join("kept.bin");
        std::fs::hard_link(f.path(), &kept).unwrap();
        drop(f);
        let left = d.join(tms_disk_folder::file_name("999998-0-0.bin"));
        std::fs::rename(&kept, &left).unwrap();
        assert_eq!(again.sweep().unwrap(), 1);
        assert!(!left.exists());
        assert!(g.path().exists());
        drop(g);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_interrupted_space_reservation_is_made_again() {
        // tmpfs's fallocate gives up with EINTR whenever a signal is pending (a profiler's
        // timer, SIGCHLD), having undone what it reserved: the pause must not fail for it.
        let d = dir("eintr");
        let bd = BackupDir::new(&d).unwrap();
        arm_fault(Some(&d), DiskOp::Allocate, 1, libc::EINTR);
        let f = DiskFile::create(&bd, 8192, 4096).unwrap();
        assert_eq!(std::fs::metadata(f.path()).unwrap().len(), 8192);
        // Interrupted at every try: sized, unreserved, as where reserving is not supported.
        for _ in 0..=RETRIES_WHEN_INTERRUPTED {
            arm_fault(Some(&d), DiskOp::Allocate, 1, libc::EINTR);
        }
        let g = DiskFile::create(&bd, 8192, 4096).unwrap();
        assert_eq!(std::fs::metadata(g.path()).unwrap().len(), 8192);
        assert_eq!(pending_faults(Some(&d)), 0);
        // A sync interrupted once is made again; one interrupted at every try fails.
        arm_fault(Some(&d), DiskOp::Sync, 1, libc::EINTR);
        g.sync().unwrap();
        for _ in 0..=RETRIES_WHEN_INTERRUPTED {
            arm_fault(Some(&d), DiskOp::Sync, 1, libc::EINTR);
        }
        let e = g.sync().unwrap_err();
        assert!(e.to_string().contains("syncing"), "{e}");
        assert_eq!(pending_faults(Some(&d)), 0);
        drop((f, g));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_file_whose_mode_cannot_be_set_is_not_left_behind() {
        let d = dir("chmod");
        let bd = BackupDir::new(&d).unwrap();
        arm_fault(Some(&d), DiskOp::Chmod, 1, libc::EPERM);
        let Err(e) = DiskFile::create(&bd, 8192, 4096) else {
            panic!("made a file whose mode could not be set");
        };
        assert!(e.to_string().contains("creating disk backup file"), "{e}");
        let left: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
        drop(DiskFile::create(&bd, 8192, 4096).unwrap());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_folder_gone_at_the_open_without_o_direct_is_found_again() {
        // The open with O_DIRECT is refused, and the folder is wiped before the open without
        // it: found again once, as where the first open finds it gone.
        let d = dir("gone-direct");
        let bd = BackupDir::new(&d).unwrap();
        arm_fault(Some(&d), DiskOp::Create, 1, libc::EINVAL);
        arm_fault(Some(&d), DiskOp::Create, 2, libc::ENOENT);
        let f = DiskFile::create(&bd, 8192, 4096).unwrap();
        assert_eq!(pending_faults(Some(&d)), 0);
        assert!(f.path().exists());
        drop(f);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn injected_faults_fire_once_at_the_nth_call() {
        let d = dir("faults");
        let bd = BackupDir::new(&d).unwrap();
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
}
