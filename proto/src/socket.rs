//! Where the control sockets are: the folder a process listens in, and the names of the socket
//! files in it.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The folder of the control sockets: `tms_socket_dir` (`$TMS_SOCKET_DIR`) if set and not
/// empty, else `<xdg_runtime_dir>/tms` (`$XDG_RUNTIME_DIR`) if set to a folder of `uid`'s, else
/// `/tmp/tms-<uid>`. Server and client compute it the same way. An `$XDG_RUNTIME_DIR` of
/// someone else's (root's process under `sudo -E`, say) or that is no folder is passed over, as
/// the XDG base directory rules say it must be the user's own: a server there would be refused
/// (another user can change it) and run without its socket.
pub fn socket_dir(
    tms_socket_dir: Option<OsString>,
    xdg_runtime_dir: Option<OsString>,
    uid: u32,
) -> PathBuf {
    match (tms_socket_dir, xdg_runtime_dir) {
        (Some(d), _) if !d.is_empty() => PathBuf::from(d),
        (_, Some(x)) if runtime_dir_usable(&x, uid) => PathBuf::from(x).join("tms"),
        _ => PathBuf::from(format!("/tmp/tms-{uid}")),
    }
}

/// Whether `$XDG_RUNTIME_DIR` = `xdg` gives [`socket_dir`] its folder for user `uid`: set, not
/// empty, and a folder of `uid`'s.
pub fn runtime_dir_usable(xdg: &std::ffi::OsStr, uid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    !xdg.is_empty() && std::fs::metadata(xdg).is_ok_and(|m| m.is_dir() && m.uid() == uid)
}

/// [`socket_dir`] from this process's environment.
pub fn socket_dir_from_env(uid: u32) -> PathBuf {
    socket_dir(
        std::env::var_os("TMS_SOCKET_DIR"),
        std::env::var_os("XDG_RUNTIME_DIR"),
        uid,
    )
}

/// Where a socket file says its process is: the pid as that process sees it, and the inode of
/// its pid namespace (`/proc/self/ns/pid`), which tells processes of different namespaces
/// apart (two of them can have the same pid, and a pid of another namespace cannot be probed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SocketName {
    /// The process id, in the process's own pid namespace.
    pub pid: u32,
    /// The inode of that pid namespace; `None` where it could not be read (no `/proc`), and for
    /// sockets named by earlier versions.
    pub pidns: Option<u64>,
}

impl SocketName {
    /// File name of the socket: `<pid>.<pidns>.sock`, or `<pid>.sock` without a namespace.
    pub fn file_name(&self) -> String {
        match self.pidns {
            Some(ns) => format!("{}.{ns}.sock", self.pid),
            None => format!("{}.sock", self.pid),
        }
    }

    /// Parse a socket file name; `None` for any other name.
    pub fn parse(name: &str) -> Option<SocketName> {
        fn number<T: std::str::FromStr>(s: &str) -> Option<T> {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || s.starts_with('0') {
                return None;
            }
            s.parse().ok()
        }
        let stem = name.strip_suffix(".sock")?;
        let (pid, pidns) = match stem.split_once('.') {
            Some((pid, ns)) => (pid, Some(number::<u64>(ns)?)),
            None => (stem, None),
        };
        let pid = number::<u32>(pid).filter(|p| *p > 0 && *p <= i32::MAX as u32)?;
        Some(SocketName { pid, pidns })
    }
}

/// The inode of this process's pid namespace, or `None` where `/proc` cannot say.
pub fn pid_namespace() -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

/// File name of the socket of process `pid` in this process's pid namespace.
pub fn socket_file_name(pid: u32) -> String {
    SocketName {
        pid,
        pidns: pid_namespace(),
    }
    .file_name()
}

/// The pid in a socket file name (`"1234.4026531836.sock"` or `"1234.sock"` -> 1234); `None`
/// for any other name.
pub fn pid_of_socket_file(name: &str) -> Option<u32> {
    SocketName::parse(name).map(|n| n.pid)
}

/// A folder held open by reference only (`O_PATH`: no read permission needed, nothing read), for
/// reaching the files in it through its fd however long their paths.
pub fn hold_folder(dir: &Path) -> io::Result<std::fs::File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(dir)
}

/// The longest path a Unix socket address holds (`sun_path` is 108 bytes, its NUL included).
pub const SOCKET_PATH_MAX: usize = 107;

/// Call `f` (a bind, a connect) with a path to the socket file `path` that fits in a socket
/// address: `path` itself where it fits; else `/proc/self/fd/<N>/<name>`, through its folder
/// opened (`O_PATH`) for the length of the call. So a socket folder at any depth (a deep
/// `$TMS_SOCKET_DIR`, a test's temporary folder) is listened in and reached alike; without
/// `/proc`, `f` gets `path` and fails as it would have.
pub fn via_short_path<T>(path: &Path, f: impl FnOnce(&Path) -> io::Result<T>) -> io::Result<T> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return f(path);
    };
    if path.as_os_str().len() <= SOCKET_PATH_MAX || !Path::new("/proc/self/fd").is_dir() {
        return f(path);
    }
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let folder = hold_folder(dir)?;
    let short = Path::new("/proc/self/fd")
        .join(folder.as_raw_fd().to_string())
        .join(name);
    if short.as_os_str().len() > SOCKET_PATH_MAX {
        return f(path);
    }
    f(&short)
}

/// Remove the socket file `dir/name` if nobody listens on it (`refused`: a connect to the path
/// given is refused); `Ok(true)` if removed. Server and `tmsctl clean` both sweep the folder,
/// and no call removes a name only while it is a given file: a check then `unlink` would remove
/// a socket a new server renamed into place in between (a check by inode is fooled too: a new
/// socket may get the inode number of a removed one). So the file is moved aside first, to a
/// name no sweep takes (`.<name>.<pid>-<n>.stale`, not a socket name), and probed again there;
/// one that turns out live is put back (by a link, which never replaces a newer socket).
pub fn remove_if_stale(
    dir: &Path,
    name: &str,
    refused: impl Fn(&Path) -> bool,
) -> io::Result<bool> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static ASIDE: AtomicU64 = AtomicU64::new(0);
    let n = ASIDE.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(name);
    let aside = dir.join(format!(".{name}.{}-{n}.stale", std::process::id()));
    std::fs::rename(&path, &aside)?;
    if refused(&aside) {
        std::fs::remove_file(&aside)?;
        return Ok(true);
    }
    let back = std::fs::hard_link(&aside, &path);
    std::fs::remove_file(&aside)?;
    back.map(|()| false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};

    #[test]
    fn a_socket_in_a_folder_too_deep_for_an_address_is_listened_on_and_reached() {
        let tmp = tempfile::tempdir().unwrap();
        let deep = tmp.path().join("d".repeat(100)).join("e".repeat(100));
        std::fs::create_dir_all(&deep).unwrap();
        let path = deep.join("1.2.sock");
        assert!(path.as_os_str().len() > SOCKET_PATH_MAX);
        // As it was: refused outright.
        assert!(UnixListener::bind(&path).is_err());
        let mut seen = None;
        let listener = via_short_path(&path, |p| {
            seen = Some(p.to_path_buf());
            UnixListener::bind(p)
        })
        .unwrap();
        let seen = seen.unwrap();
        assert!(seen.starts_with("/proc/self/fd"), "{}", seen.display());
        assert!(seen.as_os_str().len() <= SOCKET_PATH_MAX);
        // The socket is the file at the long path, reachable the same way once the call is over.
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_socket());
        let mut c = via_short_path(&path, |p| UnixStream::connect(p)).unwrap();
        let (mut s, _) = listener.accept().unwrap();
        c.write_all(b"hi").unwrap();
        let mut got = [0u8; 2];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hi");
    }

    #[test]
    fn remove_if_stale_removes_a_dead_socket_and_puts_a_live_one_back() {
        let tmp = tempfile::tempdir().unwrap();
        let refused = |p: &Path| matches!(UnixStream::connect(p), Err(e) if e.kind() == io::ErrorKind::ConnectionRefused);
        drop(UnixListener::bind(tmp.path().join("1.2.sock")).unwrap());
        assert!(remove_if_stale(tmp.path(), "1.2.sock", refused).unwrap());
        let live = UnixListener::bind(tmp.path().join("3.4.sock")).unwrap();
        assert!(!remove_if_stale(tmp.path(), "3.4.sock", refused).unwrap());
        let names: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            ["3.4.sock"],
            "the live socket is back, nothing else is left"
        );
        let _c = UnixStream::connect(tmp.path().join("3.4.sock")).unwrap();
        live.accept().unwrap();
        let e = remove_if_stale(tmp.path(), "5.6.sock", refused).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn a_path_that_fits_is_used_as_it_is_and_a_missing_folder_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("1.2.sock");
        let used = via_short_path(&path, |p| Ok(p.to_path_buf())).unwrap();
        assert_eq!(used, path);
        let gone = tmp.path().join("x".repeat(120)).join("1.2.sock");
        let e = via_short_path(&gone, |_| Ok(())).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
