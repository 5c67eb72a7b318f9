//! The operating-system calls the control server needs beyond the standard library: the
//! peer's credentials, sends that cannot raise `SIGPIPE`, a probe of whether anyone listens on
//! a socket file, the effective uid, and the exit and fork handlers with the descriptors they
//! close in a fork child (Note [The server's descriptors in a fork child]). They go through the
//! `nix` crate; what it does not cover (registering the `atexit` and `pthread_atfork` handlers,
//! and closing descriptors by number) is this module's `unsafe`, the only `unsafe` of the
//! control server.
//!
//! # Note [The server's descriptors in a fork child]
//!
//! A fork child has no server threads, so it closes its copies of the listener and of the
//! connections being served: left open, a copy keeps the server's end of a client's connection
//! alive after the parent closed it or died, and the client waits for a reply that never comes
//! instead of seeing the end (a copy of the listener makes a dead server's socket look alive).
//! The child handler closes them by the numbers recorded in [`LISTEN_FD`] and [`CONN_FDS`]. A
//! number can only be recorded once the call that made the descriptor has returned, and must be
//! forgotten before the one that closes it (else a child could close a number reused by the
//! host), so each descriptor has two moments when it is open and not recorded. Both happen
//! inside a gate ([`Gate`]): make and record (the accept itself is non-blocking, after a `poll`
//! outside the gate), forget and close. A fork's prepare handler closes the gate to newcomers
//! and waits for the threads inside to leave (a few system calls; nothing in the gate waits),
//! at most [`FORK_WAIT`]: a server thread stopped inside by a debugger, or a fork from a signal
//! handler that interrupted one, costs the fork that long and may leave the child that copy,
//! never a hang. The parent and child handlers open the gate again. Children that run no
//! `pthread_atfork` handler (`_Fork`, a raw `clone`) keep every copy; `exec` closes them
//! (close-on-exec).

use std::ffi::CString;
use std::io;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
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

/// Server threads inside the [`Gate`].
static IN_GATE: AtomicUsize = AtomicUsize::new(0);
/// Forks under way in this process (prepare handler run, parent handler not yet): the
/// [`Gate`] is closed to newcomers.
static FORKING: AtomicUsize = AtomicUsize::new(0);
/// How long a fork waits at most for the threads inside the [`Gate`] to leave.
const FORK_WAIT: Duration = Duration::from_secs(1);

/// Held from making a server descriptor until it is recorded for fork children, and from
/// forgetting it until it is closed: a fork waits for it (Note [The server's descriptors in a
/// fork child]). Never held across anything that waits.
struct Gate(());

impl Gate {
    fn enter() -> Gate {
        loop {
            IN_GATE.fetch_add(1, Ordering::SeqCst);
            // Both sides store, then read the other's counter (SeqCst): a fork either sees
            // this thread inside, or this thread sees the fork and steps back out.
            if FORKING.load(Ordering::SeqCst) == 0 {
                return Gate(());
            }
            IN_GATE.fetch_sub(1, Ordering::SeqCst);
            while FORKING.load(Ordering::SeqCst) != 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        leave(&IN_GATE);
    }
}

/// One thread fewer in the gate. Never below zero: a fork from a signal handler on a thread
/// inside the gate gives a child whose handler set the count to zero (its only thread being
/// that one), and a wrapped count would make every later fork there wait [`FORK_WAIT`].
fn leave(in_gate: &AtomicUsize) {
    let _ = in_gate.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
}

extern "C" fn before_fork() {
    // Only async-signal-safe calls: atomics, clock_gettime, sched_yield.
    FORKING.fetch_add(1, Ordering::SeqCst);
    let t = Instant::now();
    while IN_GATE.load(Ordering::SeqCst) != 0 && t.elapsed() < FORK_WAIT {
        std::thread::yield_now();
    }
}

extern "C" fn after_fork_in_parent() {
    let _ = FORKING.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
}

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
    // The child's only thread is this one: no fork is under way, no thread in the gate.
    FORKING.store(0, Ordering::SeqCst);
    IN_GATE.store(0, Ordering::SeqCst);
}

/// Register the exit handler and the fork handlers (Note [The server's descriptors in a fork
/// child]), once per process.
pub fn register_handlers() {
    HANDLERS.call_once(|| {
        // SAFETY: registers handlers that only use async-signal-safe calls and never unwind;
        // nix offers no wrapper for either registration.
        unsafe {
            libc::atexit(unlink_at_exit);
            libc::pthread_atfork(
                Some(before_fork),
                Some(after_fork_in_parent),
                Some(close_in_fork_child),
            );
        }
    });
}

/// Where `unlink` names the socket (`path`, and `file`, its device and inode: the socket could
/// not be recorded in `os.rs`'s removal table), remove it at exit, in this process only and
/// while it is still `file`.
pub fn remove_at_exit(unlink: Option<(CString, Option<(u64, u64)>)>) {
    register_handlers();
    if let Some((path, file)) = unlink {
        let _ = EXIT_UNLINK.set(ExitUnlink {
            path,
            pid: getpid(),
            file,
        });
    }
}

/// The server's listening socket, made by `bind` and recorded for fork children in one step
/// (a fork waits for both).
pub fn listen<T, E>(
    bind: impl FnOnce() -> Result<(UnixListener, T), E>,
) -> Result<(Listening, T), E> {
    register_handlers();
    let _gate = Gate::enter();
    let (listener, t) = bind()?;
    LISTEN_FD.store(listener.as_raw_fd(), Ordering::SeqCst);
    Ok((Listening(ManuallyDrop::new(listener)), t))
}

/// The listening socket [`listen`] made: however it goes (its thread ends or panics, or never
/// starts and drops it), it is forgotten for fork children and closed in one step too.
pub struct Listening(ManuallyDrop<UnixListener>);

impl Deref for Listening {
    type Target = UnixListener;

    fn deref(&self) -> &UnixListener {
        &self.0
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        let _gate = Gate::enter();
        // Forgotten before it is closed: a fork child never closes a reused number.
        LISTEN_FD.store(-1, Ordering::SeqCst);
        // SAFETY: dropped once, here; the field is never used again.
        unsafe { ManuallyDrop::drop(&mut self.0) };
    }
}

/// Record a connection being served, so that a fork child closes its copy; `None` when every
/// slot is taken (the child then keeps that copy until it exits). [`untrack_connection`] with
/// the slot before the fd is closed.
fn track_connection(fd: i32) -> Option<usize> {
    CONN_FDS.iter().position(|slot| {
        slot.compare_exchange(-1, fd, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    })
}

/// Forget a connection recorded by [`track_connection`].
fn untrack_connection(slot: usize) {
    if let Some(s) = CONN_FDS.get(slot) {
        s.store(-1, Ordering::SeqCst);
    }
}

/// A connection being served, recorded for fork children from its accept until it is closed
/// (Note [The server's descriptors in a fork child]).
pub struct Tracked {
    stream: ManuallyDrop<UnixStream>,
    slot: Option<usize>,
}

impl Tracked {
    /// Record `stream`, made before (elsewhere than in [`accept`], which records in the same
    /// step).
    pub fn new(stream: UnixStream) -> Tracked {
        let _gate = Gate::enter();
        Tracked::recorded(stream)
    }

    /// Record `stream` (the caller is inside the gate).
    fn recorded(stream: UnixStream) -> Tracked {
        let slot = track_connection(stream.as_raw_fd());
        Tracked {
            stream: ManuallyDrop::new(stream),
            slot,
        }
    }
}

impl Deref for Tracked {
    type Target = UnixStream;

    fn deref(&self) -> &UnixStream {
        &self.stream
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let _gate = Gate::enter();
        // Forgotten before it is closed: a fork child never closes a reused number.
        if let Some(slot) = self.slot {
            untrack_connection(slot);
        }
        #[cfg(test)]
        in_window(&self.stream, Window::Closing);
        // SAFETY: dropped once, here; the field is never used again.
        unsafe { ManuallyDrop::drop(&mut self.stream) };
    }
}

/// Where [`WINDOW_HOOK`] is called.
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// Between the accept of a connection and its record.
    Accepted,
    /// Between forgetting a connection and closing it.
    Closing,
}

/// Test hook: called with a connection in each moment it is open and not recorded.
#[cfg(test)]
#[allow(clippy::type_complexity)]
pub static WINDOW_HOOK: parking_lot::Mutex<
    Option<std::sync::Arc<dyn Fn(&UnixStream, Window) + Send + Sync>>,
> = parking_lot::Mutex::new(None);

#[cfg(test)]
fn in_window(stream: &UnixStream, w: Window) {
    let hook = WINDOW_HOOK.lock().clone();
    if let Some(h) = hook {
        h(stream, w);
    }
}

/// Wait for a connection on `listener` (made non-blocking by the caller), then accept it and
/// record it for fork children in one step. `WouldBlock` where `poll` found it ready with
/// nothing to take: another holder of a copy took the connection first, or the listener was
/// shut down for reading (then ready for ever: the caller must not call again at once).
pub fn accept(listener: &UnixListener) -> io::Result<Tracked> {
    // The wait is outside the gate: a fork never waits for a client.
    let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::NONE) {
        Ok(_) => {}
        Err(Errno::EINTR) => return Err(io::ErrorKind::Interrupted.into()),
        Err(e) => return Err(e.into()),
    }
    let _gate = Gate::enter();
    let (stream, _) = listener.accept()?;
    #[cfg(test)]
    in_window(&stream, Window::Accepted);
    Ok(Tracked::recorded(stream))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaving_a_gate_a_fork_child_emptied_keeps_its_count_at_zero() {
        // As in a child forked from a signal handler on a thread inside the gate: the child's
        // handler set the count to zero, then that thread leaves.
        let in_gate = AtomicUsize::new(0);
        leave(&in_gate);
        assert_eq!(in_gate.load(Ordering::SeqCst), 0);
        let in_gate = AtomicUsize::new(2);
        leave(&in_gate);
        assert_eq!(in_gate.load(Ordering::SeqCst), 1);
    }

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
