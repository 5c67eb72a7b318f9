//! Disk backups: each allocation's contents in a file of its own (`disk_file.rs`, Note [Disk
//! backup files]) in the disk backup folder, which this module finds, prepares and sweeps. File
//! operations can be made to fail for the tests (`disk_faults.rs`). The folder's layout (the
//! names, the subfolder, the staleness rules) and its sweep are shared with `tmsctl clean`
//! (`tms_disk_folder`).
//!
//! # Note [The disk backup folder]
//!
//! Users point the library at a folder that may not exist yet, and some wipe and recreate it
//! while the process runs (a per-rank folder cleared at a job's start): so the folder is a path,
//! found again each time a file is made, and created where it is missing. The directory may also
//! be one other users can write to (the system's temporary directory is the default), and there
//! they could plant anything under the names we use: a FIFO, whose `open` blocks for ever; a
//! symbolic link to a file of ours; a file of theirs. So:
//!
//! - The path is made absolute when given (a relative one against the current folder then), so
//!   a later `chdir` does not move the files. `set_disk_backup_dir` creates the folder at once;
//!   `TMS_DISK_BACKUP_DIR` and the default are created when first needed (a disk-backed pause).
//!   What we create, each missing component, gets mode 0700. Links in the path are followed:
//!   the path is the user's choice (only the subfolder we make, if any, must not be one). But
//!   a folder of ours closed to us is opened to us (0700) only where it is at the name, not
//!   through a link: one at a name found missing was put there since, by someone else.
//! - Each file is made in the folder the path names at that moment. The folder last used is
//!   held open and kept while the path still leads to it (same device and inode: sound, as the
//!   inode we hold open cannot be freed and its number given to another folder); a folder
//!   replaced at the path is prepared and checked anew. Every file operation is
//!   `openat`/`renameat`/`unlinkat` on the held folder's fd, so nothing between the check and
//!   the use can redirect it. A file made in a folder that was then removed stays ours, open:
//!   a paused allocation's contents are read back from it at resume, and its next pause makes a
//!   new file where the path leads (`Engine::prepare_backups`).
//! - Files go in the directory itself only when nobody else can make entries there: it belongs
//!   to us and neither group nor others may write to it. Otherwise (`/tmp`, a group folder, a
//!   folder of another user, one of mode 0777 with or without the sticky bit) they go in our
//!   subfolder `tms-backups-<uid>`, made with mode 0700 and refused unless it is a real folder
//!   (not a link), ours, closed to group and others. Another user can then at worst make that
//!   name first, which fails our disk-backed pauses with a message saying so (whose it is, even
//!   when it is closed to us: `fstatat` sees its owner without opening it). The library and
//!   `tmsctl clean` vet it with the same code (`tms_disk_folder::open_private_subfolder`).
//! - Opening the folder never blocks: `O_DIRECTORY | O_NONBLOCK` refuses a FIFO planted at the
//!   path before opening it.
//! - The sweep takes only names of the exact form we make (`tms-backup-<pid>-<stamp>-<seq>.bin`,
//!   `tms_disk_folder::unique_part`): a user's own `tms-backup-weights.pt` beside them is not
//!   ours. It opens only regular files of ours: each candidate is checked with `fstatat`
//!   without following links, then opened with `O_NOFOLLOW | O_NONBLOCK` (for reading and
//!   writing where the file's mode allows, as an exclusive `flock` on NFS needs; nothing is
//!   written) and checked again with `fstat`, so nothing in the folder can make it block,
//!   under the operation lock or elsewhere. `tmsctl clean` sweeps with the same code
//!   (`tms_disk_folder::sweep`). Each folder is swept
//!   when this process first uses it (a recreated folder too, or one chosen again), leaving alone
//!   the files this process holds open whatever their locks tell (Note [Disk backup files]).
//! - The files' contents are checksummed per chunk, so a file changed while paused is never
//!   silently restored (Note [Disk backup files]).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::AtFlags;
use nix::sys::stat::{FileStat, Mode};
use parking_lot::Mutex;
use tms_disk_folder::{
    files_go_in_directory, open_folder, open_private_subfolder, restore_owner_access,
    SubfolderError,
};

use crate::error::{Error, Result};

pub use super::disk_faults::{arm_fault, clear_faults, parse_faults, pending_faults, DiskOp};
pub use super::disk_file::{DiskFile, DIRECT_ALIGN};
pub use tms_disk_folder::private_subfolder_name;

pub(super) fn io_err(what: String, e: std::io::Error) -> Error {
    if e.raw_os_error() == Some(libc::ENOSPC) {
        return Error::out_of_memory(format!("{what}: {e} (the disk backup directory is full)"));
    }
    Error::io(what, e)
}

fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

pub(super) fn errno_io(e: Errno) -> std::io::Error {
    std::io::Error::from(e)
}

/// A folder's identity: device and inode.
type Identity = (libc::dev_t, libc::ino_t);

fn identity(st: &FileStat) -> Identity {
    (st.st_dev, st.st_ino)
}

/// A disk backup directory as chosen (`set_disk_backup_dir`, `TMS_DISK_BACKUP_DIR`, the
/// system's temporary directory): a path, found again at each file (Note [The disk backup
/// folder]).
#[derive(Debug)]
pub struct BackupDir {
    /// Its absolute path.
    shown: PathBuf,
    /// Where the files went last, while the path still leads there.
    files: Mutex<Option<Arc<FileDir>>>,
}

/// The folder the files are in: the chosen directory, or our private subfolder of it; held open.
#[derive(Debug)]
pub struct FileDir {
    pub(super) shown: PathBuf,
    pub(super) fd: OwnedFd,
    id: Identity,
}

impl FileDir {
    /// Its path (as resolved; for messages).
    pub fn path(&self) -> &Path {
        &self.shown
    }
}

impl BackupDir {
    /// The folder at `path` (relative to the current folder), created when first needed; the
    /// file system is not touched now.
    pub fn new(path: &Path) -> Result<Arc<BackupDir>> {
        if path.as_os_str().is_empty() {
            return Err(Error::invalid_argument(
                "disk backup directory: an empty path".to_string(),
            ));
        }
        let shown = std::path::absolute(path).map_err(|e| {
            Error::invalid_argument(format!("disk backup directory {}: {e}", path.display()))
        })?;
        Ok(Arc::new(BackupDir {
            shown,
            files: Mutex::new(None),
        }))
    }

    /// The folder at `path`, created now if it is missing (as `set_disk_backup_dir` does).
    pub fn create(path: &Path) -> Result<Arc<BackupDir>> {
        let d = Self::new(path)?;
        d.open_base()?;
        Ok(d)
    }

    /// Its path as resolved.
    pub fn path(&self) -> &Path {
        &self.shown
    }

    fn bad(&self, why: impl std::fmt::Display) -> Error {
        Error::invalid_argument(format!(
            "disk backup directory {}: {why}",
            self.shown.display()
        ))
    }

    /// Open the folder the path leads to now, creating what is missing of it (mode 0700).
    fn open_base(&self) -> Result<OwnedFd> {
        let open = || open_folder(nix::fcntl::AT_FDCWD, &self.shown, true);
        let refused = |e: Errno| match e {
            Errno::ENOTDIR => self.bad("not a directory"),
            e => io_err(
                format!("disk backup directory {}", self.shown.display()),
                errno_io(e),
            ),
        };
        match open() {
            Ok(fd) => Ok(fd),
            Err(Errno::ENOENT) => {
                // What is missing of the path, outermost first: each made with mode 0700.
                let mut missing: Vec<&Path> = self
                    .shown
                    .ancestors()
                    .take_while(|p| std::fs::symlink_metadata(p).is_err())
                    .collect();
                if missing.is_empty() {
                    // A link to nowhere: creating the path tells what is wrong.
                    missing.push(&self.shown);
                }
                missing.reverse();
                self.make_missing(&missing)?;
                tracing::info!("created the disk backup directory {}", self.shown.display());
                open().map_err(refused)
            }
            Err(e) => Err(refused(e)),
        }
    }

    /// Make the folders of the path found missing (`missing`, outermost first), each with mode
    /// 0700. One at a time: a umask such as 0777 leaves each closed to us, and it must be opened
    /// to us before the next can be made in it.
    fn make_missing(&self, missing: &[&Path]) -> Result<()> {
        for p in missing {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(p)
                .map_err(|e| match e.raw_os_error() {
                    // A component that is a file, or a link to nowhere.
                    Some(libc::ENOTDIR | libc::EEXIST) => self.bad(format!(
                        "cannot be created: a part of the path is not a directory ({e})"
                    )),
                    _ => io_err(format!("creating {}", self.shown.display()), e),
                })?;
            // Without following a link: one at a name found missing was put there since, by
            // whoever may write to the folder above, and what it leads to is not ours to change.
            let _ = restore_owner_access(nix::fcntl::AT_FDCWD, *p, false, euid());
        }
        Ok(())
    }

    /// The folder the files go in now: the one used last while the path still leads to it,
    /// else found, made and checked anew (and then swept of the files of processes that died).
    pub fn files(&self) -> Result<Arc<FileDir>> {
        let mut g = self.files.lock();
        let base = self.open_base()?;
        let st = nix::sys::stat::fstat(&base).map_err(|e| {
            io_err(
                format!("disk backup directory {}", self.shown.display()),
                e.into(),
            )
        })?;
        let in_base = files_go_in_directory(st.st_uid, st.st_mode, euid());
        if let Some(f) = &*g {
            let now = if in_base {
                Some(identity(&st))
            } else {
                nix::sys::stat::fstatat(
                    &base,
                    private_subfolder_name(euid()).as_str(),
                    AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .ok()
                .map(|s| identity(&s))
            };
            if now == Some(f.id) {
                return Ok(f.clone());
            }
            tracing::info!(
                "the disk backup directory {} was replaced or changed; files go to {} from now on",
                f.shown.display(),
                self.shown.display()
            );
        }
        let f = Arc::new(self.prepare(base, &st, in_base)?);
        *g = Some(f.clone());
        drop(g);
        sweep_once(&f);
        Ok(f)
    }

    fn prepare(&self, base_fd: OwnedFd, st: &FileStat, in_base: bool) -> Result<FileDir> {
        let me = euid();
        let base = &self.shown;
        if in_base {
            // Nobody else can make, rename or remove entries here: the files go right in it.
            return Ok(FileDir {
                shown: base.clone(),
                fd: base_fd,
                id: identity(st),
            });
        }
        let name = private_subfolder_name(me);
        let shown = base.join(&name);
        let sub = match open_private_subfolder(&base_fd, me, true) {
            Ok(Some(sub)) => sub,
            Ok(None) => return Err(Error::internal("a subfolder made but not found")),
            Err(SubfolderError::Io { op, errno }) => {
                return Err(io_err(format!("{op} {}", shown.display()), errno.into()))
            }
            Err(why) => {
                return Err(Error::invalid_state(format!(
                    "disk backup directory {}: others can write to it, so backups go to its \
                     subfolder {}, but {why}: refused (remove it, or choose a directory of yours \
                     with set_disk_backup_dir or TMS_DISK_BACKUP_DIR)",
                    base.display(),
                    shown.display()
                )))
            }
        };
        let (fd, st) = (sub.fd, sub.stat);
        let mode = st.st_mode & 0o777;
        if mode != 0o700 {
            // Ours and closed to others, but a umask such as 0777 left us without access.
            nix::sys::stat::fchmod(&fd, Mode::S_IRWXU)
                .map_err(|e| io_err(format!("giving {} mode 0700", shown.display()), e.into()))?;
        }
        Ok(FileDir {
            shown,
            fd,
            id: identity(&st),
        })
    }

    /// Remove the backup files no live process holds from the folder the files go in; returns
    /// how many.
    pub fn sweep(&self) -> Result<usize> {
        let f = self.files()?;
        sweep(&f).map_err(|e| io_err(format!("sweeping {}", f.shown.display()), e))
    }
}

/// Remove the backup files of processes that died, when this process first uses a folder.
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

/// A file's identity: device and inode.
type FileId = (libc::dev_t, libc::ino_t);

/// The backup files this process holds open, each with how many of its registrations hold
/// it: its own sweeps leave them alone, whatever their lock tells (Note [Disk backup files] in
/// `disk_file.rs`). Counted, because a file's inode is freed as its DiskFile closes it, before
/// its registration goes, and may be given to a file made meanwhile.
static HELD: Mutex<BTreeMap<FileId, usize>> = Mutex::new(BTreeMap::new());

/// A file's place in [`HELD`], for as long as this process holds it open.
pub(super) struct Held(FileId);

impl Held {
    pub(super) fn register(file: &std::fs::File) -> std::io::Result<Held> {
        let st = nix::sys::stat::fstat(file).map_err(errno_io)?;
        let id = (st.st_dev, st.st_ino);
        *HELD.lock().entry(id).or_insert(0) += 1;
        Ok(Held(id))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = HELD.lock();
        if let Some(n) = held.get_mut(&self.0) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.0);
            }
        }
    }
}

/// The file of `st` is a backup file this process holds open.
fn held_here(st: &FileStat) -> bool {
    HELD.lock().contains_key(&(st.st_dev, st.st_ino))
}

/// Remove the backup files in `dir` no live process holds; returns how many. Opens nothing but
/// regular files of ours, never blocks, and never takes one this process holds (Note [The disk
/// backup folder]).
pub fn sweep(dir: &FileDir) -> std::io::Result<usize> {
    tms_disk_folder::sweep_keeping(dir.fd.as_fd(), &held_here).map_err(errno_io)
}

/// Bytes the file system of the folder `dir`'s files go in can still give an unprivileged
/// writer (the folder is found, or made, first); `None` where it tells no size (ramfs, tmpfs
/// mounted without a limit: no blocks at all), and only writing can tell.
pub fn free_space(dir: &BackupDir) -> Result<Option<u64>> {
    let f = dir.files()?;
    let s = nix::sys::statvfs::fstatvfs(&f.fd).map_err(|e| {
        io_err(
            format!("disk backup directory {}", f.shown.display()),
            std::io::Error::from(e),
        )
    })?;
    Ok(space(
        s.blocks() as u64,
        s.blocks_available() as u64,
        s.fragment_size() as u64,
    ))
}

/// Free bytes from `statvfs`'s numbers; `None` for a file system of no blocks (no size).
fn space(blocks: u64, available: u64, fragment: u64) -> Option<u64> {
    (blocks > 0).then(|| available.saturating_mul(fragment))
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
    use tms_disk_folder::{file_name, tmp_name};

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tms-disk-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_file_identity_given_again_stays_held_until_every_holder_goes() {
        // A DiskFile closes its file before its registration goes, so the file system may give
        // the freed inode to a file made meanwhile, registered under the same identity: the
        // older registration going must not take the newer one's, which would leave a live
        // file to this process's sweep. Two descriptors of one file stand for the two here.
        let d = dir("reused-inode");
        let path = d.join("f");
        let old = std::fs::File::create(&path).unwrap();
        let new = std::fs::File::open(&path).unwrap();
        let st = nix::sys::stat::fstat(&new).unwrap();
        let old_held = Held::register(&old).unwrap();
        let new_held = Held::register(&new).unwrap();
        drop((old_held, old));
        assert!(
            held_here(&st),
            "the newer file is no longer known as this process's own"
        );
        drop(new_held);
        assert!(!held_here(&st));
        drop(new);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_sweep_removes_only_files_nobody_holds() {
        let d = dir("sweep");
        let bd = BackupDir::new(&d).unwrap();
        let live = DiskFile::create(&bd, 4096, 4096).unwrap();
        // A dead process's file: same name pattern, no lock.
        let dead = d.join(file_name("999999-0-0.bin"));
        std::fs::write(&dead, b"old").unwrap();
        let young_tmp = d.join(tmp_name("1-0-0.bin"));
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
    fn a_file_system_of_no_blocks_tells_no_free_space_and_is_not_refused_as_full() {
        assert_eq!(space(1000, 10, 4096), Some(40960));
        assert_eq!(space(1000, 0, 4096), Some(0), "full");
        // ramfs, and tmpfs mounted with size=0, report no blocks at all: no limit.
        assert_eq!(space(0, 0, 4096), None);
        assert_eq!(space(u64::MAX, u64::MAX, 4096), Some(u64::MAX));
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
    fn a_missing_folder_is_opened_to_us_but_never_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let d = dir("made-missing");
        // Made meanwhile by another process of ours, under a umask that closed it to us.
        let sibling = d.join("made-meanwhile");
        std::fs::create_dir(&sibling).unwrap();
        std::fs::set_permissions(&sibling, std::fs::Permissions::from_mode(0o500)).unwrap();
        BackupDir::new(&sibling)
            .unwrap()
            .make_missing(&[&sibling])
            .unwrap();
        assert_eq!(mode(&sibling), 0o700, "opened to us");
        // Missing when looked at, a link by the time it is made: put there by whoever may write
        // to the folder above, to a folder of ours that we keep read-only (not ours to change).
        let kept = d.join("read-only");
        std::fs::create_dir(&kept).unwrap();
        std::fs::set_permissions(&kept, std::fs::Permissions::from_mode(0o500)).unwrap();
        let link = d.join("job");
        std::os::unix::fs::symlink(&kept, &link).unwrap();
        let _ = BackupDir::new(&link).unwrap().make_missing(&[&link]);
        assert_eq!(mode(&kept), 0o500, "its mode was changed through the link");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
