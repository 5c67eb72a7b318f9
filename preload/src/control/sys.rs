//! The few operating-system calls the control server needs that the standard library does not
//! offer safely: the peer's credentials, a send that cannot raise `SIGPIPE`, liveness of a pid,
//! the effective uid, and the exit and fork handlers. All of this module's `unsafe` is here.

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Once, OnceLock};

use super::auth::PeerCred;

/// The effective uid of this process.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// This process's id, as the kernel says now (differs from a cached value after `fork`).
pub fn getpid() -> i32 {
    // SAFETY: getpid has no preconditions and cannot fail.
    unsafe { libc::getpid() }
}

/// The credentials the kernel recorded for the peer of `stream` when it connected.
pub fn peer_cred(stream: &UnixStream) -> io::Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the fd is a live socket owned by `stream`; `cred` and `len` are valid for
    // writes of the sizes given.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(io::Error::other("SO_PEERCRED returned a short answer"));
    }
    Ok(PeerCred {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// Write all of `data`, honouring the stream's write timeout. Uses `MSG_NOSIGNAL`: a client
/// that went away must give an error here, not a `SIGPIPE` that kills the host process (the
/// host may be a C program that never ignored the signal).
pub fn send_all(stream: &UnixStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        // SAFETY: the fd is a live socket owned by `stream`; `data` is valid for reads of
        // `data.len()` bytes.
        let n = unsafe {
            libc::send(
                stream.as_raw_fd(),
                data.as_ptr().cast(),
                data.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        data = &data[n as usize..];
    }
    Ok(())
}

/// True when a process `pid` exists (ours or another user's).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission; nothing is delivered.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Socket file to remove at exit, and the pid of the process that made it.
struct ExitUnlink {
    path: CString,
    pid: i32,
}

static EXIT_UNLINK: OnceLock<ExitUnlink> = OnceLock::new();
static HANDLERS: Once = Once::new();
/// The listening socket's fd (-1: none), closed in a fork child.
static LISTEN_FD: AtomicI32 = AtomicI32::new(-1);
/// The fd of the connection being served (-1: none), closed in a fork child.
static CONN_FD: AtomicI32 = AtomicI32::new(-1);

extern "C" fn unlink_at_exit() {
    // Only the process that created the socket removes it: a fork child exiting must not
    // take its parent's socket away.
    if let Some(u) = EXIT_UNLINK.get() {
        if getpid() == u.pid {
            // SAFETY: `path` is a NUL-terminated string that lives for the whole process.
            unsafe { libc::unlink(u.path.as_ptr()) };
        }
    }
}

extern "C" fn close_in_fork_child() {
    // The child has no server thread: it must not keep the parent's listener (or a
    // connection) open. Only async-signal-safe calls here: atomics and close.
    for slot in [&LISTEN_FD, &CONN_FD] {
        let fd = slot.swap(-1, Ordering::SeqCst);
        if fd >= 0 {
            // SAFETY: `fd` was open in the parent when fork happened (the slot is cleared
            // before the parent closes it), so in the child it is the inherited copy, which
            // nothing else in the child uses.
            unsafe { libc::close(fd) };
        }
    }
}

/// Remove `path` at exit (in this process only) and close the server's fds in fork children.
/// Call once, after the socket exists.
pub fn install_process_handlers(path: CString, listen_fd: i32) {
    let _ = EXIT_UNLINK.set(ExitUnlink {
        path,
        pid: getpid(),
    });
    LISTEN_FD.store(listen_fd, Ordering::SeqCst);
    HANDLERS.call_once(|| {
        // SAFETY: registers handlers that only use async-signal-safe calls and never unwind.
        unsafe {
            libc::atexit(unlink_at_exit);
            libc::pthread_atfork(None, None, Some(close_in_fork_child));
        }
    });
}

/// Forget the listener fd before it is closed (so a fork child never closes a reused number).
pub fn forget_listener() {
    LISTEN_FD.store(-1, Ordering::SeqCst);
}

/// Record the connection being served (`-1` when none). Clear it before closing the fd.
pub fn set_connection(fd: i32) {
    CONN_FD.store(fd, Ordering::SeqCst);
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
    }

    #[test]
    fn send_to_a_closed_peer_is_an_error_not_a_signal() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        let e = send_all(&a, b"hello\n").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn liveness() {
        assert!(pid_alive(std::process::id()));
        assert!(!pid_alive(0));
        assert!(!pid_alive(u32::MAX));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!pid_alive(pid));
    }
}
