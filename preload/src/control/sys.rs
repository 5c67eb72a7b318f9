//! The operating-system calls the control server needs beyond the standard library: the
//! peer's credentials, sends that cannot raise `SIGPIPE`, a probe of whether anyone listens on
//! a socket file, the effective uid, and the exit and fork handlers. They go through the `nix`
//! crate; what it does not cover (registering the `atexit` and `pthread_atfork` handlers, and
//! closing inherited descriptors by number in a fork child) is this module's `unsafe`, the only
//! `unsafe` of the control server.

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{self, sockopt, AddressFamily, MsgFlags, SockFlag, SockType, UnixAddr};

/// The effective uid of this process.
pub fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// This process's id, as the kernel says now (differs from a cached value after `fork`).
pub fn getpid() -> i32 {
    nix::unistd::getpid().as_raw()
}

/// The peer's credentials as the kernel reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// Process id of the peer (at connect time).
    pub pid: i32,
    /// Its effective uid.
    pub uid: u32,
    /// Its effective gid.
    pub gid: u32,
}

/// The credentials the kernel recorded for the peer of `stream` when it connected.
pub fn peer_cred(stream: &UnixStream) -> io::Result<PeerCred> {
    let c = socket::getsockopt(stream, sockopt::PeerCredentials)?;
    Ok(PeerCred {
        pid: c.pid(),
        uid: c.uid(),
        gid: c.gid(),
    })
}

/// Write all of `data` within `within` (a `TimedOut` error after that): the stream's write
/// timeout is set to what is left before each send, so a client that takes a little of a long
/// reply now and then cannot stretch it past the bound. Uses `MSG_NOSIGNAL`: a client that
/// went away must give an error here, not a `SIGPIPE` that kills the host process (the host
/// may be a C program that never ignored the signal).
pub fn send_all(stream: &UnixStream, mut data: &[u8], within: Duration) -> io::Result<()> {
    let deadline = Instant::now() + within;
    while !data.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the reply was not taken within {within:?}"),
            ));
        }
        stream.set_write_timeout(Some(left))?;
        match socket::send(stream.as_raw_fd(), data, MsgFlags::MSG_NOSIGNAL) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n.min(data.len())..],
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Send `data` only as far as it goes without waiting (`MSG_DONTWAIT`, `MSG_NOSIGNAL`): for a
/// short notice to a connection the server is dropping, which must not hold up its caller.
pub fn send_now(stream: &UnixStream, data: &[u8]) -> io::Result<usize> {
    let flags = MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT;
    loop {
        match socket::send(stream.as_raw_fd(), data, flags) {
            Err(Errno::EINTR) => {}
            r => return r.map_err(io::Error::from),
        }
    }
}

/// What connecting to a socket file says about it.
#[derive(Debug)]
pub enum Probe {
    /// Someone listens on it (the connection was accepted or queued, or the queue is full).
    Listening,
    /// `ECONNREFUSED`: the file is a socket nobody listens on any more.
    Refused,
    /// Anything else (not a socket, no permission, a path too long for `sun_path`...).
    Unknown(io::Error),
}

/// Connect to the socket file `path` without waiting, and close the connection at once. The
/// only answer that proves the file stale is [`Probe::Refused`]: unlike a pid, a listener can
/// be probed across pid namespaces. Only meaningful for a file known to be a socket: Linux
/// refuses a connection to a regular file with `ECONNREFUSED` too.
pub fn probe(path: &Path) -> Probe {
    tms_proto::via_short_path(path, |p| Ok(probe_at(p))).unwrap_or_else(Probe::Unknown)
}

/// [`probe`] through a path that fits in a socket address.
fn probe_at(path: &Path) -> Probe {
    let addr = match UnixAddr::new(path) {
        Ok(a) => a,
        Err(e) => return Probe::Unknown(e.into()),
    };
    let fd = match socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    ) {
        Ok(fd) => fd,
        Err(e) => return Probe::Unknown(e.into()),
    };
    loop {
        return match socket::connect(fd.as_raw_fd(), &addr) {
            // A full accept queue (EAGAIN) also means someone listens.
            Ok(()) | Err(Errno::EAGAIN | Errno::EINPROGRESS) => Probe::Listening,
            Err(Errno::ECONNREFUSED) => Probe::Refused,
            Err(Errno::EINTR) => continue,
            Err(e) => Probe::Unknown(e.into()),
        };
    }
}

/// Socket file to remove at exit, the pid of the process that made it, and the file it made
/// (device and inode), if known.
struct ExitUnlink {
    path: CString,
    pid: i32,
    file: Option<(u64, u64)>,
}

static EXIT_UNLINK: OnceLock<ExitUnlink> = OnceLock::new();
static HANDLERS: Once = Once::new();
/// The listening socket's fd (-1: none), closed in a fork child.
static LISTEN_FD: AtomicI32 = AtomicI32::new(-1);

/// Connections tracked for fork children at most (more than the server's cap on concurrent
/// connections, which is what bounds them in a process; tests run several servers at once).
pub const TRACKED_CONNECTIONS: usize = 128;

/// The fds of the connections being served (-1: free slot), closed in a fork child.
static CONN_FDS: [AtomicI32; TRACKED_CONNECTIONS] =
    [const { AtomicI32::new(-1) }; TRACKED_CONNECTIONS];

extern "C" fn unlink_at_exit() {
    // Only the process that created the socket removes it: a fork child exiting must not
    // take its parent's socket away.
    if let Some(u) = EXIT_UNLINK.get() {
        // Nor a file put at its name since: that one is someone else's.
        let same = |f| {
            nix::sys::stat::lstat(u.path.as_c_str()).is_ok_and(|st| (st.st_dev, st.st_ino) == f)
        };
        if getpid() == u.pid && u.file.is_none_or(same) {
            let _ = nix::unistd::unlink(u.path.as_c_str());
        }
    }
}

extern "C" fn close_in_fork_child() {
    // The child has no server threads: it must not keep the parent's listener (or its
    // connections) open. Only async-signal-safe calls here: atomics and close.
    for slot in std::iter::once(&LISTEN_FD).chain(CONN_FDS.iter()) {
        let fd = slot.swap(-1, Ordering::SeqCst);
        if fd >= 0 {
            // SAFETY: `fd` was open in the parent when fork happened (a slot is cleared before
            // the parent closes its fd), so in the child it is the inherited copy, which
            // nothing else in the child uses. nix has no safe way to close an fd by number.
            unsafe { libc::close(fd) };
        }
    }
}

/// Close the server's fds in fork children; and where `unlink` names the socket (`path`, and
/// `file`, its device and inode: the socket could not be recorded in `os.rs`'s removal table),
/// remove it at exit, in this process only and while it is still `file`. Call once, after the
/// socket exists.
pub fn install_process_handlers(unlink: Option<(CString, Option<(u64, u64)>)>, listen_fd: i32) {
    if let Some((path, file)) = unlink {
        let _ = EXIT_UNLINK.set(ExitUnlink {
            path,
            pid: getpid(),
            file,
        });
    }
    LISTEN_FD.store(listen_fd, Ordering::SeqCst);
    HANDLERS.call_once(|| {
        // SAFETY: registers handlers that only use async-signal-safe calls and never unwind;
        // nix offers no wrapper for either registration.
        unsafe {
            libc::atexit(unlink_at_exit);
            libc::pthread_atfork(None, None, Some(close_in_fork_child));
        }
    });
}

/// Forget the listener fd before it is closed (so a fork child never closes a reused number).
fn forget_listener() {
    LISTEN_FD.store(-1, Ordering::SeqCst);
}

/// The server's listening socket: however it goes (its thread ends or panics, or never starts
/// and drops it), its number is forgotten for fork children before it is closed.
pub struct Listening(pub std::os::unix::net::UnixListener);

impl Drop for Listening {
    fn drop(&mut self) {
        forget_listener();
    }
}

/// Record a connection being served, so that a fork child closes its copy; `None` when every
/// slot is taken (the child then keeps that copy until it exits). Call [`untrack_connection`]
/// with the slot before the fd is closed.
pub fn track_connection(fd: i32) -> Option<usize> {
    CONN_FDS.iter().position(|slot| {
        slot.compare_exchange(-1, fd, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    })
}

/// Forget a connection recorded by [`track_connection`].
pub fn untrack_connection(slot: usize) {
    if let Some(s) = CONN_FDS.get(slot) {
        s.store(-1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_cred_of_a_socketpair_is_ours() {
        let (a, _b) = UnixStream::pair().unwrap();
        let c = peer_cred(&a).unwrap();
        assert_eq!(c.uid, euid());
        assert_eq!(c.pid as u32, std::process::id());
        assert_eq!(getpid() as u32, std::process::id());
    }

    #[test]
    fn send_to_a_closed_peer_is_an_error_not_a_signal() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        let e = send_all(&a, b"hello\n", Duration::from_secs(2)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
        assert_eq!(
            send_now(&a, b"hello\n").unwrap_err().kind(),
            io::ErrorKind::BrokenPipe
        );
    }

    #[test]
    fn send_now_never_waits() {
        let (a, _b) = UnixStream::pair().unwrap();
        let chunk = vec![0u8; 1 << 16];
        let t = std::time::Instant::now();
        // The peer reads nothing: the buffer fills, then sends fail at once.
        let e = loop {
            match send_now(&a, &chunk) {
                Ok(_) => {}
                Err(e) => break e,
            }
        };
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert!(t.elapsed() < std::time::Duration::from_secs(2));
    }

    #[test]
    fn probe_tells_listeners_from_stale_files() {
        let d = std::env::temp_dir().join(format!("tms-sys-probe-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let live = d.join("live.sock");
        let _l = std::os::unix::net::UnixListener::bind(&live).unwrap();
        assert!(matches!(probe(&live), Probe::Listening));
        let dead = d.join("dead.sock");
        drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
        assert!(matches!(probe(&dead), Probe::Refused));
        assert!(matches!(probe(&d.join("none.sock")), Probe::Unknown(_)));
        assert!(matches!(probe(&d.join("x".repeat(200))), Probe::Unknown(_)));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn tracked_connections_take_and_free_slots() {
        let a = track_connection(1_000_001).unwrap();
        let b = track_connection(1_000_002).unwrap();
        assert_ne!(a, b);
        untrack_connection(a);
        untrack_connection(b);
        untrack_connection(usize::MAX);
    }
}
