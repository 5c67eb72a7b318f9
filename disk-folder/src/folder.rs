//! The I/O on a disk backup folder: nothing here can be made to block or to follow a link by
//! what another user plants in the folder (a FIFO, a link, a file of theirs under our names).

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::{openat, AtFlags, Flock, FlockArg, OFlag, AT_FDCWD};
use nix::sys::stat::{fchmodat, fstat, fstatat, mkdirat, FchmodatFlags, FileStat, Mode};
use nix::unistd::{geteuid, unlinkat, UnlinkatFlags};
use nix::NixPath;

use crate::layout::{is_regular_file_of, private_subfolder_name, subfolder_is_private, Entry};

/// Open the folder at `path` (relative to `at`) without ever blocking: `O_DIRECTORY |
/// O_NONBLOCK` refuses a FIFO planted there before opening it. Without `follow`, a symbolic link
/// at `path` is refused too (`O_NOFOLLOW`: the subfolder we make must be a real one).
pub fn open_folder<P: ?Sized + NixPath>(
    at: impl AsFd,
    path: &P,
    follow: bool,
) -> nix::Result<OwnedFd> {
    let mut flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
    if !follow {
        flags |= OFlag::O_NOFOLLOW;
    }
    openat(at, path, flags, Mode::empty())
}

/// Give the folder at `path` (relative to `at`), if it is ours and closed to group and others,
/// mode 0700: a umask that takes the owner's bits (0777, 0477) leaves a folder we make with
/// mode 0700 closed to us too. Reached by an `O_PATH` descriptor, which needs no access to the
/// folder and, without `follow`, takes no link; changed through that descriptor's `/proc` link
/// (`fchmod` refuses `O_PATH` descriptors), so what is changed is what was checked. Whether it
/// was changed.
pub fn restore_owner_access<P: ?Sized + NixPath>(
    at: impl AsFd,
    path: &P,
    follow: bool,
    me: u32,
) -> nix::Result<bool> {
    let mut flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    if !follow {
        flags |= OFlag::O_NOFOLLOW;
    }
    let fd = openat(at, path, flags, Mode::empty())?;
    let st = fstat(&fd)?;
    if st.st_uid != me || st.st_mode & 0o077 != 0 || st.st_mode & 0o700 == 0o700 {
        return Ok(false);
    }
    let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
    fchmodat(
        AT_FDCWD,
        link.as_str(),
        Mode::S_IRWXU,
        FchmodatFlags::FollowSymlink,
    )?;
    Ok(true)
}

/// Our private subfolder of a folder others can write to, opened and vetted.
#[derive(Debug)]
pub struct Subfolder {
    pub fd: OwnedFd,
    pub stat: FileStat,
}

/// Why our subfolder of a shared folder cannot be used. Its `Display` says why in words both
/// the library and `tmsctl clean` use ("it belongs to uid 0, not 1000").
#[derive(Debug, PartialEq, Eq)]
pub enum SubfolderError {
    /// Its name is taken by a symbolic link, or by something not a folder.
    NotAFolder,
    /// Another user (`uid`) made it first (it may be closed to us, `ours`).
    Foreign { uid: u32, ours: u32 },
    /// It is ours, but group or others have access to it.
    NotPrivate { mode: u32 },
    /// The system refused `op` (`"creating"`, `"opening"`, `"inspecting"`).
    Io { op: &'static str, errno: Errno },
}

impl std::fmt::Display for SubfolderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubfolderError::NotAFolder => write!(f, "it is a symbolic link or not a folder"),
            SubfolderError::Foreign { uid, ours } => {
                write!(f, "it belongs to uid {uid}, not {ours}")
            }
            SubfolderError::NotPrivate { mode } => write!(
                f,
                "its mode is {mode:04o}: group or others have access (want 0700)"
            ),
            SubfolderError::Io { op, errno } => write!(f, "{op} it failed: {}", errno.desc()),
        }
    }
}

/// Open `me`'s subfolder ([`private_subfolder_name`]) of the folder `base` (made first if
/// `create`; `Ok(None)` if it is not there and not made), refusing it unless it is a real folder
/// of `me`'s closed to group and others. Another user's folder under our name is told as such
/// even when it is closed to us (then only `fstatat`, which follows no link, can see its owner).
pub fn open_private_subfolder(
    base: impl AsFd,
    me: u32,
    create: bool,
) -> Result<Option<Subfolder>, SubfolderError> {
    let name = private_subfolder_name(me);
    if create {
        match mkdirat(base.as_fd(), name.as_str(), Mode::S_IRWXU) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(errno) => {
                return Err(SubfolderError::Io {
                    op: "creating",
                    errno,
                })
            }
        }
    }
    let open = || open_folder(base.as_fd(), name.as_str(), false);
    let mut opened = open();
    if matches!(opened, Err(Errno::EACCES))
        && restore_owner_access(base.as_fd(), name.as_str(), false, me) == Ok(true)
    {
        // Ours, made (now or earlier) under a umask that closed it to us.
        opened = open();
    }
    let fd = match opened {
        Ok(fd) => fd,
        Err(Errno::ENOENT) if !create => return Ok(None),
        Err(Errno::ELOOP | Errno::ENOTDIR) => return Err(SubfolderError::NotAFolder),
        Err(Errno::EACCES) => {
            return Err(
                match fstatat(base.as_fd(), name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                    Ok(st) if st.st_uid != me => SubfolderError::Foreign {
                        uid: st.st_uid,
                        ours: me,
                    },
                    _ => SubfolderError::Io {
                        op: "opening",
                        errno: Errno::EACCES,
                    },
                },
            )
        }
        Err(errno) => {
            return Err(SubfolderError::Io {
                op: "opening",
                errno,
            })
        }
    };
    let stat = fstat(&fd).map_err(|errno| SubfolderError::Io {
        op: "inspecting",
        errno,
    })?;
    if !subfolder_is_private(stat.st_uid, stat.st_mode & 0o777, me) {
        return Err(if stat.st_uid != me {
            SubfolderError::Foreign {
                uid: stat.st_uid,
                ours: me,
            }
        } else {
            SubfolderError::NotPrivate {
                mode: stat.st_mode & 0o777,
            }
        });
    }
    Ok(Some(Subfolder { fd, stat }))
}

/// Remove the backup files in the folder `dir` that no live process holds; returns how many.
/// Opens nothing but regular files of ours, and never blocks: each candidate is checked with
/// `fstatat` without following links, opened with `O_NOFOLLOW | O_NONBLOCK` (for reading and
/// writing, as NFS's exclusive `flock` needs, else for reading), and checked again with `fstat`
/// (the name may have changed hands meanwhile); nothing is written. A file is stale only when
/// its `flock` can be taken, which proves that the process that made it is gone. For a sweep from
/// another process than those that make files (`tmsctl clean`); a process that makes them
/// sweeps with [`sweep_keeping`].
pub fn sweep(dir: BorrowedFd<'_>) -> nix::Result<usize> {
    sweep_keeping(dir, &|_| false)
}

/// [`sweep`], leaving alone every file for which `ours` (given its `fstatat`, before it is
/// opened, and its `fstat` once opened) is true: the files the sweeping process holds open
/// itself. Their lock cannot tell them from stale ones there, where the file system lets a
/// process take a lock it holds already (flock emulated with POSIX locks, which never set a
/// process's own requests against each other); nor are they opened, as closing a descriptor
/// of a file drops every POSIX lock of the process on it.
pub fn sweep_keeping(dir: BorrowedFd<'_>, ours: &dyn Fn(&FileStat) -> bool) -> nix::Result<usize> {
    sweep_locking(dir, ours, |file| {
        Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| errno)
    })
}

/// [`sweep_keeping`], taking each candidate's lock with `lock`, which holds it for as long as
/// what it returns lives: `flock`, or in tests the lock NFS takes for it.
fn sweep_locking<L>(
    dir: BorrowedFd<'_>,
    ours: &dyn Fn(&FileStat) -> bool,
    lock: impl Fn(File) -> nix::Result<L>,
) -> nix::Result<usize> {
    let me = geteuid().as_raw();
    let mut listing = nix::dir::Dir::openat(
        dir,
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let names: Vec<(CString, Entry)> = listing
        .iter()
        .flatten()
        .filter_map(|e| Entry::of(e.file_name().to_bytes()).map(|k| (e.file_name().to_owned(), k)))
        .collect();
    drop(listing);
    let mut removed = 0;
    for (name, kind) in names {
        let Ok(before) = fstatat(dir, name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) else {
            continue;
        };
        // A regular file of ours (not a link, a FIFO, a file of theirs), and not one being made.
        if !kind.may_be_stale(before.st_mode, before.st_uid, before.st_mtime, me) {
            continue;
        }
        // Not even opened: where flock is emulated with POSIX locks, closing any descriptor of
        // a file drops the process's lock on it, which would expose it to other sweeps.
        if ours(&before) {
            continue;
        }
        // Opened for writing, though nothing is written: where `flock` is emulated with a POSIX
        // lock over the whole file (NFS), an exclusive one needs a descriptor open for writing
        // (EBADF otherwise). Where writing is refused (a mode such as 0400, a read-only mount),
        // read-only: on a local file system the lock is the same either way.
        let flags = OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
        let open = |access| openat(dir, name.as_c_str(), flags | access, Mode::empty());
        let Ok(fd) = open(OFlag::O_RDWR).or_else(|_| open(OFlag::O_RDONLY)) else {
            continue;
        };
        match fstat(&fd) {
            Ok(st)
                if is_regular_file_of(st.st_mode, st.st_uid, me)
                    && st.st_ino == before.st_ino
                    && !ours(&st) => {}
            _ => continue,
        }
        // Taking the lock proves no other process holds it (and `ours` that this one does not).
        if let Ok(locked) = lock(File::from(fd)) {
            if unlinkat(dir, name.as_c_str(), UnlinkatFlags::NoRemoveDir).is_ok() {
                removed += 1;
            }
            drop(locked);
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{file_name, private_subfolder_name, tmp_name, unique_part};
    use nix::fcntl::{fcntl, FcntlArg};
    use nix::libc;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::os::unix::fs::symlink;
    use std::process::{Command, Stdio};

    /// A POSIX lock of `kind` over the whole file.
    fn whole_file(kind: libc::c_int) -> libc::flock {
        libc::flock {
            l_type: kind as libc::c_short,
            l_whence: libc::SEEK_SET as libc::c_short,
            l_start: 0,
            l_len: 0,
            l_pid: 0,
        }
    }

    /// The lock an NFS client takes for `flock(LOCK_EX | LOCK_NB)` (flock(2), "NFS details"):
    /// a POSIX write lock over the whole file on the same descriptor, which the kernel refuses
    /// (EBADF) on a descriptor not open for writing. Held until the file is closed.
    fn nfs_style_lock(file: File) -> nix::Result<File> {
        fcntl(&file, FcntlArg::F_SETLK(&whole_file(libc::F_WRLCK)))?;
        Ok(file)
    }

    fn nfs_style_sweep(dir: BorrowedFd<'_>) -> nix::Result<usize> {
        sweep_locking(dir, &|_| false, nfs_style_lock)
    }

    /// Names the file [`lock_holder_child`] locks in a child process.
    const HOLD_VAR: &str = "TMS_DISK_FOLDER_TEST_HOLD";

    /// Not a test: the child process of
    /// [`an_nfs_style_sweep_keeps_a_file_another_process_locks`], which holds a POSIX write
    /// lock on the file [`HOLD_VAR`] names, says "locked" on stdout, and keeps the lock until its
    /// stdin closes. A process's own POSIX locks never conflict, so only another one can hold it.
    #[test]
    #[ignore = "run as a child process by an_nfs_style_sweep_keeps_a_file_another_process_locks"]
    fn lock_holder_child() {
        let Some(path) = std::env::var_os(HOLD_VAR) else {
            return;
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        fcntl(&file, FcntlArg::F_SETLK(&whole_file(libc::F_WRLCK))).unwrap();
        // Not `println!`, which the test harness would keep until the end.
        let mut out = std::io::stdout();
        out.write_all(b"locked\n").unwrap();
        out.flush().unwrap();
        let _ = std::io::stdin().read(&mut [0; 1]);
    }

    #[test]
    fn an_nfs_style_sweep_takes_the_files_of_dead_processes() {
        let d = tempfile::tempdir().unwrap();
        let dead = d.path().join(file_name(&unique_part(1, 0xdead, 0)));
        std::fs::write(&dead, b"old").unwrap();
        let folder = open_folder(nix::fcntl::AT_FDCWD, d.path(), true).unwrap();
        assert_eq!(nfs_style_sweep(folder.as_fd()), Ok(1));
        assert!(!dead.exists());
    }

    #[test]
    fn an_nfs_style_sweep_keeps_a_file_another_process_locks() {
        let d = tempfile::tempdir().unwrap();
        let live = d.path().join(file_name(&unique_part(1, 0x11fe, 0)));
        std::fs::write(&live, b"live").unwrap();
        let test = module_path!().split_once("::").unwrap().1;
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                &format!("{test}::lock_holder_child"),
            ])
            .env(HOLD_VAR, &live)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Kept open until the child is gone: the harness there fails on a closed stdout.
        let mut said = BufReader::new(child.stdout.take().unwrap()).lines();
        // Its stdout ends without it if the child fails, so this cannot hang.
        assert!(
            said.any(|l| l.unwrap() == "locked"),
            "the child took no lock"
        );
        let folder = open_folder(nix::fcntl::AT_FDCWD, d.path(), true).unwrap();
        assert_eq!(nfs_style_sweep(folder.as_fd()), Ok(0));
        assert!(live.exists());
        drop(child.stdin.take());
        assert!(child.wait().unwrap().success());
        drop(said);
        assert_eq!(
            nfs_style_sweep(folder.as_fd()),
            Ok(1),
            "its maker gone, the file goes"
        );
        assert!(!live.exists());
    }

    /// Runs `f` on a thread of its own without CAP_DAC_OVERRIDE in its effective set
    /// (capabilities are per thread), so that a file's mode refuses writing even to root.
    fn without_dac_override<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: libc::c_int,
        }
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        const VERSION_3: u32 = 0x2008_0522;
        const CAP_DAC_OVERRIDE: u32 = 1;
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut header = Header {
                    version: VERSION_3,
                    pid: 0,
                };
                let mut data = [Data::default(); 2];
                // SAFETY: capget(2) with version 3 writes two `Data` (the kernel's
                // `__user_cap_data_struct`) for the calling thread (pid 0).
                let got =
                    unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
                assert_eq!(got, 0, "capget: {}", Errno::last());
                data[0].effective &= !(1 << CAP_DAC_OVERRIDE);
                // SAFETY: capset(2) reads the header and two `Data`; it changes only the
                // calling thread, which ends with `f`.
                let set = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
                assert_eq!(set, 0, "capset: {}", Errno::last());
                f()
            })
            .join()
            .unwrap()
        })
    }

    #[test]
    fn a_file_whose_mode_refuses_writing_is_still_swept() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let dead = d.path().join(file_name(&unique_part(1, 0xdead, 0)));
        std::fs::write(&dead, b"old").unwrap();
        std::fs::set_permissions(&dead, std::fs::Permissions::from_mode(0o400)).unwrap();
        let folder = open_folder(nix::fcntl::AT_FDCWD, d.path(), true).unwrap();
        let swept = without_dac_override(|| {
            let write = std::fs::OpenOptions::new().write(true).open(&dead);
            assert_eq!(
                write.unwrap_err().raw_os_error(),
                Some(libc::EACCES),
                "opening it for writing must be refused, as it is to the sweep"
            );
            sweep(folder.as_fd())
        });
        assert_eq!(swept, Ok(1));
        assert!(!dead.exists());
    }

    #[test]
    fn a_sweep_takes_only_unlocked_files_of_ours_and_never_blocks() {
        let d = tempfile::tempdir().unwrap();
        let at = |n: String| d.path().join(n);
        let dead = at(file_name(&unique_part(1, 0xdead, 0)));
        std::fs::write(&dead, b"old").unwrap();
        // A live process's file: its lock is held.
        let live = at(file_name(&unique_part(2, 0x11fe, 0)));
        std::fs::write(&live, b"live").unwrap();
        let held =
            Flock::lock(File::open(&live).unwrap(), FlockArg::LockExclusiveNonblock).unwrap();
        let young_tmp = at(tmp_name(&unique_part(3, 0x9e3, 0)));
        std::fs::write(&young_tmp, b"new").unwrap();
        // A FIFO under our name (opening it without O_NONBLOCK would block), a link to a file
        // of ours, a name that is not ours, and a file of the user's that begins like ours.
        let fifo = at(file_name(&unique_part(4, 0xf1f0, 0)));
        nix::unistd::mkfifo(&fifo, Mode::S_IRWXU).unwrap();
        let link = at(file_name(&unique_part(5, 0x11, 0)));
        symlink(&live, &link).unwrap();
        let other = at("unrelated.bin".into());
        std::fs::write(&other, b"keep").unwrap();
        let users = at("tms-backup-weights.pt".into());
        std::fs::write(&users, b"the user's").unwrap();
        let folder = open_folder(nix::fcntl::AT_FDCWD, d.path(), true).unwrap();
        assert_eq!(sweep(folder.as_fd()), Ok(1));
        assert!(!dead.exists());
        for kept in [&live, &young_tmp, &fifo, &other, &users] {
            assert!(kept.exists(), "{}", kept.display());
        }
        assert!(link.symlink_metadata().is_ok(), "a link is left alone");
        drop(held);
        assert_eq!(
            sweep(folder.as_fd()),
            Ok(1),
            "unlocked, the live file goes too"
        );
        assert!(!live.exists());
    }

    #[test]
    fn a_sweep_leaves_the_files_its_process_holds_even_unlocked() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let mine = d.path().join(file_name(&unique_part(1, 0x1, 0)));
        let dead = d.path().join(file_name(&unique_part(2, 0x2, 0)));
        for f in [&mine, &dead] {
            std::fs::write(f, b"x").unwrap();
        }
        // No lock on either: as a file system whose locks never keep a process's own sweep out
        // sees this process's file.
        let m = std::fs::metadata(&mine).unwrap();
        let ours = |st: &FileStat| (st.st_dev, st.st_ino) == (m.dev(), m.ino());
        let folder = open_folder(nix::fcntl::AT_FDCWD, d.path(), true).unwrap();
        assert_eq!(sweep_keeping(folder.as_fd(), &ours), Ok(1));
        assert!(mine.exists() && !dead.exists());
        assert_eq!(sweep(folder.as_fd()), Ok(1), "told as no one's, it goes");
        assert!(!mine.exists());
    }

    #[test]
    fn a_sweep_never_opens_a_file_its_process_holds() {
        // Where flock is emulated with POSIX record locks, closing any descriptor of a file
        // drops every such lock the process holds on it: a sweep that opened one of its own
        // files, even to leave it, would leave it unlocked for another process's sweep.
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let mine = d.path().join(file_name(&unique_part(1, 0x1, 0)));
        std::fs::write(&mine, b"x").unwrap();
        let held = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&mine)
            .unwrap();
        fcntl(&held, FcntlArg::F_SETLK(&whole_file(libc::F_WRLCK))).unwrap();
        let m = std::fs::metadata(&mine).unwrap();
        let ours = |st: &FileStat| (st.st_dev, st.st_ino) == (m.dev(), m.ino());
        let folder = open_folder(nix::fcntl::AT_FDCWD, d.path(), true).unwrap();
        assert_eq!(sweep_keeping(folder.as_fd(), &ours), Ok(0));
        assert!(mine.exists());
        // An open file description lock conflicts with this process's record lock, if held.
        let probe = File::open(&mine).unwrap();
        let mut asked = whole_file(libc::F_RDLCK);
        fcntl(&probe, FcntlArg::F_OFD_GETLK(&mut asked)).unwrap();
        assert_eq!(
            i32::from(asked.l_type),
            libc::F_WRLCK,
            "this process's lock on its own file was dropped by the sweep"
        );
        drop(held);
    }

    #[test]
    fn our_subfolder_is_made_private_and_anything_else_under_its_name_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let me = geteuid().as_raw();
        let base = open_folder(nix::fcntl::AT_FDCWD, d.path(), true).unwrap();
        let sub = d.path().join(private_subfolder_name(me));
        assert!(open_private_subfolder(&base, me, false).unwrap().is_none());
        let made = open_private_subfolder(&base, me, true).unwrap().unwrap();
        assert_eq!(made.stat.st_mode & 0o777, 0o700);
        assert_eq!(made.stat.st_uid, me);
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(
            open_private_subfolder(&base, me, false).unwrap_err(),
            SubfolderError::NotPrivate { mode: 0o755 }
        );
        if me == 0 {
            std::os::unix::fs::chown(&sub, Some(65534), None).unwrap();
            assert_eq!(
                open_private_subfolder(&base, me, true).unwrap_err(),
                SubfolderError::Foreign {
                    uid: 65534,
                    ours: 0
                }
            );
            assert_eq!(
                open_private_subfolder(&base, me, true)
                    .unwrap_err()
                    .to_string(),
                "it belongs to uid 65534, not 0"
            );
        }
        std::fs::remove_dir(&sub).unwrap();
        let elsewhere = d.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        symlink(&elsewhere, &sub).unwrap();
        assert_eq!(
            open_private_subfolder(&base, me, true).unwrap_err(),
            SubfolderError::NotAFolder
        );
        std::fs::remove_file(&sub).unwrap();
        std::fs::write(&sub, b"a file").unwrap();
        assert_eq!(
            open_private_subfolder(&base, me, false).unwrap_err(),
            SubfolderError::NotAFolder
        );
    }

    #[test]
    fn a_folder_is_opened_without_blocking_and_a_link_only_when_followed() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("fifo");
        nix::unistd::mkfifo(&fifo, Mode::S_IRWXU).unwrap();
        assert_eq!(
            open_folder(nix::fcntl::AT_FDCWD, &fifo, true).err(),
            Some(nix::errno::Errno::ENOTDIR)
        );
        let real = d.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = d.path().join("link");
        symlink(&real, &link).unwrap();
        assert!(open_folder(nix::fcntl::AT_FDCWD, &link, true).is_ok());
        assert!(matches!(
            open_folder(nix::fcntl::AT_FDCWD, &link, false).err(),
            Some(nix::errno::Errno::ELOOP | nix::errno::Errno::ENOTDIR)
        ));
    }
}
