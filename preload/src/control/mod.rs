//! The control socket: lets `tmsctl` (or any client of the protocol in `tms-proto`) pause,
//! resume and inspect a process from outside.
//!
//! # Note [The control server]
//!
//! *When it starts.* Only once the [`Runtime`](crate::Runtime) has started successfully, i.e.
//! in a process that made a pauseable allocation or called the C ABI; a process that merely
//! inherited `LD_PRELOAD` never gets here, so it gets no thread, no folder, no socket.
//! `TMS_CONTROL=0` turns the server off. Setup (folder check, bind) runs on the thread that
//! started the runtime, once, and costs a handful of system calls; everything else runs on the
//! server's own thread (`tms-control`).
//!
//! *Where.* `$TMS_SOCKET_DIR`, else `$XDG_RUNTIME_DIR/tms`, else `/tmp/tms-<uid>`; the folder is
//! created 0700 and refused (the server stays off, with a logged error) unless it is a real
//! folder owned by us that no one else can enter. The socket is `<pid>.sock`, mode 0600.
//! Sockets of processes that died without cleaning up are removed when a server starts.
//!
//! *Who.* The peer's uid (`SO_PEERCRED`) must be ours ([`auth`]).
//!
//! *How long.* One thread, one connection at a time, each bounded in time and size
//! ([`session::Limits`]), so no client can keep another waiting for long. The thread touches
//! the host's threads only through the engine: `status` takes the registry lock briefly, and
//! `pause`/`resume` take it for the whole operation, exactly as the C ABI's calls do.
//!
//! *Exit and fork.* An `atexit` handler removes the socket, but only in the process that made
//! it; a fork child closes its copies of the listener and of any open connection (it has no
//! server thread, and the library is disabled in it anyway).
//!
//! *Harm.* Any failure here is logged (seen only with `TMS_LOG`) and the process carries on;
//! the server thread runs inside `catch_unwind`; replies are sent with `MSG_NOSIGNAL` so a
//! client that disappears cannot raise `SIGPIPE` in the host.
//!
//! This module has `unsafe` of its own (beyond driver/, hooks/ and ffi.rs), all of it in
//! [`sys`]: the socket calls above have no safe form in the standard library.

pub mod auth;
pub mod dir;
pub mod dispatch;
pub mod session;
mod sys;

use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixListener;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Once, OnceLock};
use std::time::Duration;

use crate::engine::Engine;
use crate::error::Result;
use crate::hooks::runtime::Runtime;
use crate::hooks::settings::{self, RegionSettings};
use crate::units::{env_parsed, parse_flag};

use dispatch::Host;
use session::{Identity, Limits};

static START: Once = Once::new();
static STATE: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();

/// The process's [`Host`]: the one runtime's engine and the settings module.
struct ProcessHost {
    rt: &'static Runtime,
}

impl Host for ProcessHost {
    fn engine(&self) -> &Engine {
        &self.rt.engine
    }

    fn default_region(&self) -> Result<RegionSettings> {
        settings::default_region()
    }

    fn set_default_region(&self, r: RegionSettings) {
        settings::set_default_region(r)
    }
}

/// Start the server for `rt` unless it was started (or tried) before. Cheap after the first
/// call. Never panics, never prints (failures are logged).
pub fn ensure_started(rt: &'static Runtime) {
    if START.is_completed() {
        return;
    }
    START.call_once(|| {
        let r = catch_unwind(AssertUnwindSafe(|| start(rt)))
            .unwrap_or_else(|_| Err("starting the control server panicked (a bug)".into()));
        match &r {
            Ok(p) => tracing::info!("control socket {}", p.display()),
            Err(e) if e.starts_with("disabled") => tracing::debug!("control socket: {e}"),
            Err(e) => tracing::error!("no control socket: {e}"),
        }
        let _ = STATE.set(r);
    });
}

/// The socket's path, or why there is none (not started yet, disabled, or it failed).
pub fn socket_path() -> std::result::Result<PathBuf, String> {
    match STATE.get() {
        Some(r) => r.clone(),
        None => Err("the control server has not started (the library has not started)".into()),
    }
}

fn enabled() -> std::result::Result<(), String> {
    match env_parsed("TMS_CONTROL", parse_flag) {
        Ok(None | Some(true)) => Ok(()),
        Ok(Some(false)) => Err("disabled by TMS_CONTROL=0".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn start(rt: &'static Runtime) -> std::result::Result<PathBuf, String> {
    if let Err(e) = enabled() {
        if !e.starts_with("disabled") {
            // A malformed setting is reported in one line, like every other TMS_* variable.
            eprintln!("torch-memory-saver: {e}; the control socket stays off");
        }
        return Err(e);
    }
    let uid = sys::euid();
    let pid = std::process::id();
    let folder = tms_proto::socket_dir_from_env(uid);
    dir::prepare(&folder, uid)?;
    let (listener, path) = dir::bind(&folder, pid)?;
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| format!("socket path {} contains a NUL byte", path.display()))?;
    sys::install_process_handlers(c_path, listener.as_raw_fd());
    let me = Identity {
        uid,
        pid,
        backend: rt.engine.driver().name().to_string(),
    };
    let host = ProcessHost { rt };
    let folder2 = folder.clone();
    let spawned = std::thread::Builder::new()
        .name("tms-control".into())
        .spawn(move || {
            let r = catch_unwind(AssertUnwindSafe(|| {
                let n = dir::clean_stale(&folder2, uid, pid);
                if n > 0 {
                    tracing::debug!("removed {n} stale control sockets");
                }
                serve(&listener, &host, &Limits::default(), &me)
            }));
            if r.is_err() {
                tracing::error!(
                    "the control server stopped after a panic (a bug); the process carries on"
                );
            }
        });
    match spawned {
        Ok(_) => Ok(path),
        Err(e) => {
            sys::forget_listener();
            let _ = std::fs::remove_file(&path);
            Err(format!("cannot start the control thread: {e}"))
        }
    }
}

/// Accept and serve connections, one at a time, for ever.
fn serve(listener: &UnixListener, host: &dyn Host, limits: &Limits, me: &Identity) {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                sys::set_connection(stream.as_raw_fd());
                let r = catch_unwind(AssertUnwindSafe(|| {
                    session::serve_connection(&stream, host, limits, me)
                }));
                sys::set_connection(-1);
                drop(stream);
                if r.is_err() {
                    tracing::error!("a control connection panicked (a bug); the server carries on");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of descriptors, typically: wait a little rather than spin.
                tracing::warn!("control socket accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// The folder this process's server uses (or would use).
pub fn socket_dir() -> PathBuf {
    tms_proto::socket_dir_from_env(sys::euid())
}

#[cfg(test)]
mod tests;
