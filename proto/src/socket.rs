//! Where the control sockets are: the folder a process listens in, and the names of the socket
//! files in it.

use std::ffi::OsString;
use std::path::PathBuf;

/// The folder of the control sockets: `tms_socket_dir` (`$TMS_SOCKET_DIR`) if set and not
/// empty, else `<xdg_runtime_dir>/tms` (`$XDG_RUNTIME_DIR`) if set and not empty, else
/// `/tmp/tms-<uid>`. Server and client compute it the same way.
pub fn socket_dir(
    tms_socket_dir: Option<OsString>,
    xdg_runtime_dir: Option<OsString>,
    uid: u32,
) -> PathBuf {
    match (tms_socket_dir, xdg_runtime_dir) {
        (Some(d), _) if !d.is_empty() => PathBuf::from(d),
        (_, Some(x)) if !x.is_empty() => PathBuf::from(x).join("tms"),
        _ => PathBuf::from(format!("/tmp/tms-{uid}")),
    }
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
