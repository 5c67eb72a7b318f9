//! A control socket as tmsctl sees it: its file, and where its process lives relative to
//! tmsctl's pid namespace.
//!
//! A socket is named `<pid>.<pidns>.sock` (`<pid>.sock` by older servers, or without `/proc`).
//! A pid means a process of the namespace it names: one of another namespace is another process
//! here, if any, so such a socket is never taken for a pid of ours nor acted on; `tmsctl list`
//! shows it and asks its server's status, checked as far as it can be from here (its uid and its
//! hello's pid; not the kernel's pid, nor whether the pid lives, which mean another process
//! here).

use std::path::{Path, PathBuf};

use tms_proto::SocketName;

/// Where a socket's process lives, relative to tmsctl's pid namespace. Ordered by preference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Ns {
    /// Ours (`<pid>.<our-ns>.sock`): its pid means the same process here.
    Ours,
    /// Not said (`<pid>.sock`: an older server, or one without `/proc`): taken to be ours.
    Unnamed,
    /// Another pid namespace (a container, say): its pid is another process here, if any.
    Other(u64),
}

/// Where the name of a socket of namespace `pidns` places it, relative to `ours`.
pub fn classify(pidns: Option<u64>, ours: Option<u64>) -> Ns {
    match pidns {
        None => Ns::Unnamed,
        Some(n) if Some(n) == ours => Ns::Ours,
        Some(n) => Ns::Other(n),
    }
}

/// A socket file of a folder.
#[derive(Clone, Debug)]
pub struct Socket {
    /// What its name says.
    pub name: SocketName,
    /// Its path.
    pub path: PathBuf,
    /// Its pid namespace, relative to ours.
    pub ns: Ns,
    /// When its process started (field 22 of `/proc/PID/stat`), as the first connection to it
    /// read it ([`crate::client::Client::socket`] has it): a later connection to another process
    /// given the pid since is refused. `None` before any connection, and where `/proc` does not
    /// say (a process of another namespace).
    pub started: Option<u64>,
}

impl Socket {
    /// The pid its name gives (in its own pid namespace).
    pub fn pid(&self) -> u32 {
        self.name.pid
    }

    /// Its file name.
    pub fn file_name(&self) -> String {
        self.name.file_name()
    }

    /// Its pid means a process of our namespace: whether it lives can be asked, and its server's
    /// pid compared with the kernel's.
    pub fn here(&self) -> bool {
        !matches!(self.ns, Ns::Other(_))
    }
}

/// Connecting to the socket at `path` is refused: nobody listens on it (a file left by a
/// process that died). Never waits: a server whose queue is full is taken to listen.
pub fn nobody_listens(path: &Path) -> bool {
    tms_proto::via_short_path(path, |p| Ok(refused_at(p))).unwrap_or(false)
}

/// [`nobody_listens`] through a path that fits in a socket address.
fn refused_at(path: &Path) -> bool {
    use nix::errno::Errno;
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
    use std::os::fd::AsRawFd;
    let Ok(addr) = UnixAddr::new(path) else {
        return false;
    };
    let Ok(fd) = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    ) else {
        return false;
    };
    loop {
        match connect(fd.as_raw_fd(), &addr) {
            Err(Errno::EINTR) => continue,
            r => return r == Err(Errno::ECONNREFUSED),
        }
    }
}

/// A socket of `pid` in `ns` (ours being namespace 100), for the tests.
#[cfg(test)]
pub fn test_socket(pid: u32, ns: Ns) -> Socket {
    let pidns = match ns {
        Ns::Ours => Some(100),
        Ns::Unnamed => None,
        Ns::Other(n) => Some(n),
    };
    let name = SocketName { pid, pidns };
    Socket {
        path: PathBuf::from(name.file_name()),
        name,
        ns,
        started: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_placed_by_namespace() {
        assert_eq!(classify(Some(7), Some(7)), Ns::Ours);
        assert_eq!(classify(None, Some(7)), Ns::Unnamed);
        assert_eq!(classify(Some(8), Some(7)), Ns::Other(8));
        assert_eq!(classify(Some(8), None), Ns::Other(8));
        assert!(Ns::Ours < Ns::Unnamed && Ns::Unnamed < Ns::Other(0));
    }
}
