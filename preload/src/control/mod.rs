//! The control socket: lets `tmsctl` (or any client of the protocol in `tms-proto`) pause,
//! resume and inspect a process from outside.
//!
//! # Note [The control server]
//!
//! *When it starts.* Only once the [`Runtime`] has started successfully (the
//! entry points reach it through [`runtime()`], which starts the server with it), i.e.
//! in a process that made a pauseable allocation or called the C ABI; a process that merely
//! inherited `LD_PRELOAD` never gets here, so it gets no thread, no folder, no socket.
//! `TMS_CONTROL=0` turns the server off. Setup (folder check, bind) runs on the thread that
//! started the runtime, once, and costs a handful of system calls; everything else runs on the
//! server's own threads: `tms-control` accepts, and each connection is served by a thread of
//! its own (`tms-control-conn`) that ends with the connection.
//!
//! *Where.* `$TMS_SOCKET_DIR`, else `$XDG_RUNTIME_DIR/tms` (if `$XDG_RUNTIME_DIR` is a folder of
//! the user's), else `/tmp/tms-<uid>`; the folder is created 0700 (the mode set explicitly after
//! `mkdir`, whatever the umask) and refused (the server stays off, with a logged error) unless it
//! is a real folder owned by us that no one else can enter (one of ours that we cannot enter
//! either, left by a umask such as 0777, is given 0700 again). It is refused too unless every
//! folder above it, up to `/`, is owned by root or by us and cannot be written to by group or
//! others unless it has the sticky bit (like `/tmp`, 1777): whoever can write to one could move our
//! folder away after the check and put their own, or a link, in its place. Links on the way are
//! followed only where root or we own them, and the folders they lead to are held to the same rule
//! (in a user namespace mapping only some uids, unmapped owners, shown as 65534, count as root,
//! unless it maps 65534 itself); the ancestors are checked before anything is made or looked at in
//! the folder, again before each missing folder is made, and once more after; the refusal names the
//! ancestor and why (Note [The ancestors of the socket folder] in `tms_proto::ancestors`; tmsctl
//! applies the same rule). `$XDG_RUNTIME_DIR/tms` (`/run/user/<uid>`) and `/tmp/tms-<uid>` pass it.
//! The socket is `<pid>.<pidns>.sock` ([`tms_proto::socket_file_name`]: the pid and the inode of
//! our pid namespace, so processes of different pid namespaces sharing the folder never collide),
//! mode 0600, also set explicitly. A folder too deep for a socket address (108 bytes) is listened
//! in and reached through `/proc/self/fd/<N>/` ([`tms_proto::via_short_path`]), and the socket's
//! removal on a signal goes by the folder, held open, and the name, so a socket path of any length
//! works.
//!
//! *Stale sockets.* When a server starts, it removes the sockets in the folder that nobody
//! listens on: a socket is stale only when connecting to it is refused (`ECONNREFUSED`), never
//! because its pid looks dead (a pid of another namespace cannot be probed from ours, and a
//! live server there must keep its socket). Our own name is never touched ([`dir::clean_stale`]).
//!
//! *Who.* The peer's uid (`SO_PEERCRED`) must be ours ([`auth`]).
//!
//! *How long, and how many.* Each connection is bounded in time and size ([`session::Limits`]): a
//! request line must arrive within 2 s of the previous reply, a reply must be taken within 2 s, and
//! a connection serves at most 1000 requests (one more gets a `busy` error saying so), waits for
//! them 10 s in all, and waits for its replies to be taken 10 s in all (then it is closed: a client
//! that sends its requests at once and takes each reply late would hold it for 1000 times 2 s).
//! Since each connection has its own thread, a slow or silent client holds only its own
//! connection, never another client's. At most 64 connections are served at once
//! ([`conns::Table`]). One more makes room by closing an idle connection, one waiting for a request
//! line: one that has not sent its hello yet if there is such, else the one that has waited
//! longest; it gets a `busy` error. If all 64 are busy serving requests, the newcomer gets a `busy`
//! error at once and is closed. So idle connections, however many, never keep a newcomer waiting,
//! and a misbehaving client can hold a place for 10 s of waiting for requests and 10 s of waiting
//! for its replies to be taken at most. (Every client has our
//! uid, so this guards against clients that are broken or stuck, not against a deliberate flood of
//! connections: such a client could signal the process anyway.)
//!
//! *The engine.* The threads touch the host's threads only through the engine: `status` takes
//! the registry lock briefly, and `pause`/`resume` take the operations lock for the whole
//! operation (and the registry lock only briefly, never across a driver call), exactly as the C
//! ABI's calls do; two clients asking for a pause at once are served one after the other by the
//! operations lock, like two threads of the process (engine Note [Locks]).
//!
//! *Exit and fork.* An `atexit` handler removes the socket, but only in the process that made it
//! and only while the file at its name is still that socket (a file put there since is someone
//! else's), and so does SIGTERM or SIGINT where the host left their default action (Note
//! [Removal at exit and on a termination signal] in `os.rs`); a fork child closes its copies of
//! the listener and of every open connection (it has no server threads, and the library is
//! disabled in it anyway). A fork that comes as a connection is accepted, or closed, waits the
//! few system calls it takes to record it, or forget it, for the child (Note [The server's
//! descriptors in a fork child] in `sys.rs`).
//!
//! *Harm.* Any failure here is logged (seen only with `TMS_LOG`) and the process carries on:
//! the accept thread and every connection thread run inside `catch_unwind`, a thread that
//! cannot be started costs its connection a `busy` reply, and replies are sent with
//! `MSG_NOSIGNAL` so a client that disappears cannot raise `SIGPIPE` in the host.
//!
//! The system calls go through the `nix` crate (`sys.rs`); this module's only `unsafe` is there
//! too: registering the exit and fork handlers, and closing descriptors (in a fork child, and
//! the server's own where a fork must not come between forgetting and closing them).

pub mod auth;
pub mod conns;
pub mod dir;
pub mod dispatch;
pub mod session;
mod sys;

use std::ffi::CString;
use std::fmt;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Once, OnceLock};
use std::time::Duration;

use tms_proto::encode;

use crate::engine::Engine;
use crate::error::{Error, ErrorKind, Result};
use crate::process::runtime::{self, Runtime};
use crate::process::settings::{self, RegionSettings};
use crate::units::{env_parsed, parse_flag};

use conns::Table;
use dispatch::Host;
use session::{busy_reply, serve_connection, Identity, Limits};

static START: Once = Once::new();
static STATE: OnceLock<std::result::Result<PathBuf, NoSocket>> = OnceLock::new();

/// Why this process has no control socket.
#[derive(Debug)]
pub enum NoSocket {
    /// The server has not started, because the library has not.
    NotStarted,
    /// Turned off (`TMS_CONTROL=0`).
    Disabled,
    /// Starting it panicked (a bug).
    Panicked,
    /// Starting it failed: a malformed `TMS_CONTROL`, a refused folder, no socket or thread.
    Failed(Error),
}

impl fmt::Display for NoSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NoSocket::NotStarted => {
                f.write_str("the control server has not started (the library has not started)")
            }
            NoSocket::Disabled => f.write_str("disabled by TMS_CONTROL=0"),
            NoSocket::Panicked => f.write_str("starting the control server panicked (a bug)"),
            NoSocket::Failed(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl From<Error> for NoSocket {
    fn from(e: Error) -> Self {
        NoSocket::Failed(e)
    }
}

/// The process's [`Host`]: the one runtime's engine and the settings module.
struct ProcessHost {
    rt: &'static Runtime,
}

impl Host for ProcessHost {
    fn engine(&self) -> &Engine {
        &self.rt.engine
    }

    fn resume_nonblocking(&self, tag: Option<&str>, label: u64) -> Result<crate::engine::OpReport> {
        let rt: &'static Runtime = self.rt;
        Engine::resume_nonblocking_labeled(&rt.engine, tag, &[], None, Some(label))
    }

    fn default_region(&self) -> Result<RegionSettings> {
        settings::default_region()
    }

    fn set_default_region(&self, r: RegionSettings) {
        settings::set_default_region(r)
    }
}

/// Record the socket `path` in `folder` for removal at exit and when a signal ends the process
/// (`os.rs`'s table, whose `atexit` handler and signal handlers remove it): by the folder, held
/// open (`O_PATH`) for the life of the process, and the file name, so that a path too long for
/// a removal slot is removed all the same; by the path where the folder cannot be opened. Only
/// while it is still `file` (device and inode), the socket made. False where no slot was free.
fn record_for_exit(folder: &Path, path: &Path, file: Option<(u64, u64)>) -> bool {
    use crate::os::ExitRemoval;
    let held = tms_proto::hold_folder(folder);
    let recorded = match (&held, path.file_name()) {
        (Ok(dir), Some(name)) => ExitRemoval::register_file(dir.as_raw_fd(), name.as_bytes(), file),
        _ => ExitRemoval::register_file(libc::AT_FDCWD, path.as_os_str().as_bytes(), file),
    };
    let Some(r) = recorded else {
        return false;
    };
    // Both live as long as the process: the handlers read the slot and its folder.
    std::mem::forget(r);
    std::mem::forget(held);
    true
}

/// The process's runtime (created on the first call, see [`runtime::get`]) with the server
/// started for it. The entry points (hooks and C ABI) reach the runtime only through here, so
/// the control socket starts with the first successful use, never at load time.
pub fn runtime() -> Result<&'static Runtime> {
    let rt = runtime::get()?;
    ensure_started(rt);
    Ok(rt)
}

/// Start the server for `rt` unless it was started (or tried) before. Cheap after the first
/// call. Never panics, never prints (failures are logged).
fn ensure_started(rt: &'static Runtime) {
    if START.is_completed() {
        return;
    }
    START.call_once(|| {
        let r = catch_unwind(AssertUnwindSafe(|| start(rt))).unwrap_or(Err(NoSocket::Panicked));
        match &r {
            Ok(p) => tracing::info!("control socket {}", p.display()),
            Err(e @ NoSocket::Disabled) => tracing::debug!("control socket: {e}"),
            Err(e) => tracing::error!("no control socket: {e}"),
        }
        let _ = STATE.set(r);
    });
}

/// The socket's path, or why there is none (not started yet, disabled, or it failed).
pub fn socket_path() -> std::result::Result<&'static Path, &'static NoSocket> {
    static NOT_STARTED: NoSocket = NoSocket::NotStarted;
    match STATE.get() {
        Some(r) => r.as_deref(),
        None => Err(&NOT_STARTED),
    }
}

fn enabled() -> std::result::Result<(), NoSocket> {
    match env_parsed("TMS_CONTROL", parse_flag)? {
        None | Some(true) => Ok(()),
        Some(false) => Err(NoSocket::Disabled),
    }
}

fn start(rt: &'static Runtime) -> std::result::Result<PathBuf, NoSocket> {
    match enabled() {
        Ok(()) => {}
        Err(NoSocket::Disabled) => return Err(NoSocket::Disabled),
        Err(e) => {
            // A malformed setting is reported in one line, like every other TMS_* variable.
            crate::process::logging::say(&format!(
                "torch-memory-saver: {e}; the control socket stays off"
            ));
            return Err(e);
        }
    }
    let uid = sys::euid();
    let pid = std::process::id();
    let folder = socket_dir();
    let ours = tms_proto::socket_file_name(pid);
    dir::prepare(&folder, uid)?;
    // Made and recorded for fork children in one step (Note [The server's descriptors in a
    // fork child] in `sys.rs`).
    let (listener, path) = sys::listen(|| dir::bind_as(&folder, &ours))?;
    // The system would refuse such a path too (EINVAL): an OS-level failure.
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        let why = format!("socket path {} contains a NUL byte", path.display());
        Error::new(ErrorKind::Io, why)
    })?;
    // What is at the socket's name when the process ends may no longer be our socket (moved
    // away, another file put there): removed only if it is the file made here.
    let file = std::fs::symlink_metadata(&path)
        .ok()
        .map(|m| (m.dev(), m.ino()));
    // Where no removal slot is free, `sys`'s own atexit handler removes it (at exit only).
    let fallback = (!record_for_exit(&folder, &path, file)).then_some((c_path, file));
    sys::remove_at_exit(fallback);
    let me = Identity {
        uid,
        pid,
        backend: rt.engine.driver().name().to_string(),
    };
    // Once per process (START): the connection threads need a host that lives for ever.
    let host: &'static ProcessHost = Box::leak(Box::new(ProcessHost { rt }));
    let spawned = std::thread::Builder::new()
        .name("tms-control".into())
        .spawn(move || run(&listener, &folder, &ours, host, Limits::default(), me));
    match spawned {
        Ok(_) => Ok(path),
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            Err(Error::io("cannot start the control thread", e).into())
        }
    }
}

/// The server's setup in `folder`: the folder made and checked ([`dir::prepare`]: refused,
/// with nothing made or bound there, unless it can be trusted), then a socket named `name`
/// listened on in it ([`dir::bind_as`]). [`start`] does the same (its listener recorded for
/// fork children as it is made), and the tests that start a server in a folder of their
/// choosing run it.
#[cfg(test)]
fn listen_in(folder: &Path, uid: u32, name: &str) -> Result<(UnixListener, PathBuf)> {
    dir::prepare(folder, uid)?;
    dir::bind_as(folder, name)
}

/// The server thread's work: clean the folder of stale sockets (ours, `ours`, excepted), then
/// serve for ever. Never panics.
fn run(
    listener: &UnixListener,
    folder: &Path,
    ours: &str,
    host: &'static dyn Host,
    limits: Limits,
    me: Identity,
) {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let n = dir::clean_stale(folder, me.uid, ours);
        if n > 0 {
            tracing::debug!("removed {n} stale control sockets");
        }
        serve(listener, host, limits, me)
    }));
    if r.is_err() {
        tracing::error!("the control server stopped after a panic (a bug); the process carries on");
    }
}

/// What every connection thread shares.
struct Shared {
    host: &'static dyn Host,
    limits: Limits,
    me: Identity,
}

/// Stack of a connection thread. The same as the old single server thread's (and Rust's
/// default), because a pause or resume runs on it, CUDA driver calls included: an overflow
/// would kill the host. Only the pages a thread touches are ever committed.
const CONN_STACK: usize = 2 << 20;

/// Accept connections for ever, each served on a thread of its own (see the Note).
fn serve(listener: &UnixListener, host: &'static dyn Host, limits: Limits, me: Identity) {
    let table = Table::new(limits.max_connections);
    let shared = Arc::new(Shared { host, limits, me });
    // `sys::accept` waits in `poll`, then takes the connection without waiting: a fork waits
    // for the accept and its record, never for a client.
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!("the control socket cannot be made non-blocking ({e}); no server");
        return;
    }
    loop {
        match sys::accept(listener) {
            Ok(stream) => {
                let r = catch_unwind(AssertUnwindSafe(|| admit(&table, &shared, stream)));
                if r.is_err() {
                    tracing::error!(
                        "taking a control connection panicked (a bug); the server carries on"
                    );
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of descriptors, typically: wait a little rather than spin. So too for
                // `WouldBlock`: a listener shut down for reading is ready for ever with nothing
                // to take.
                tracing::warn!("control socket accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Refuse a connection with a `busy` error, without waiting for the client.
fn refuse(stream: &UnixStream, why: &str) {
    tracing::debug!("control connection refused: {why}");
    let _ = sys::send_now(stream, &encode(&busy_reply(why)));
}

/// Give `stream` a place in `table` and a thread, or a `busy` reply.
fn admit(table: &Arc<Table>, shared: &Arc<Shared>, stream: sys::Tracked) {
    let ticket = match table.admit(stream) {
        Ok(t) => t,
        Err(stream) => {
            let why = format!(
                "all {} connections it serves at once are running requests",
                shared.limits.max_connections
            );
            return refuse(&stream, &why);
        }
    };
    let stream = ticket.shared_stream();
    let s = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("tms-control-conn".into())
        .stack_size(CONN_STACK)
        .spawn(move || {
            let r = catch_unwind(AssertUnwindSafe(|| {
                serve_connection(ticket.stream(), s.host, &s.limits, &s.me, &ticket)
            }));
            drop(ticket);
            if r.is_err() {
                tracing::error!("a control connection panicked (a bug); the server carries on");
            }
        });
    if let Err(e) = spawned {
        refuse(&stream, &format!("no thread could be started for it ({e})"));
    }
}

/// The folder this process's server uses (or would use), made absolute against the working
/// directory at the server's start: a relative `TMS_SOCKET_DIR` and a later `chdir` would
/// otherwise send the removal at exit (by path) elsewhere and leave the socket behind.
pub fn socket_dir() -> PathBuf {
    let folder = tms_proto::socket_dir_from_env(sys::euid());
    std::path::absolute(&folder).unwrap_or(folder)
}

#[cfg(test)]
mod tests;
