//! The client side of the control protocol: find sockets, connect, hello, ask; every failure
//! is a [`Failure`] with the exit code it maps to.

use std::fmt;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tms_proto::{
    decode_reply, encode, ErrorKind, Hello, LineBuffer, Reply, Request, MAX_REPLY_BYTES,
    PROTOCOL_VERSION,
};

/// Exit codes of tmsctl (documented in `--help`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// The process replied with an error, or another failure (a demo check, a bad reply).
    Failed = 1,
    /// Bad command line.
    Usage = 2,
    /// No such process, or it has no control socket.
    NoProcess = 3,
    /// Permission denied.
    Permission = 4,
    /// No answer in time.
    Timeout = 5,
}

/// A failure with its exit code and a one-line reason.
#[derive(Debug)]
pub struct Failure {
    /// The exit code.
    pub code: Code,
    /// The reason.
    pub message: String,
}

impl Failure {
    /// A failure.
    pub fn new(code: Code, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Failure {}

/// Result of this module.
pub type Result<T> = std::result::Result<T, Failure>;

/// Our effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// True when process `pid` exists (ours or another user's).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if p <= 0 {
        return false;
    }
    // SAFETY: signal 0 delivers nothing; it only checks that the process exists.
    let r = unsafe { libc::kill(p, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// The pids of the live processes with a socket in `dir`, in order.
pub fn live_sockets(dir: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(tms_proto::pid_of_socket_file)
        })
        .filter(|p| pid_alive(*p))
        .collect();
    pids.sort_unstable();
    pids
}

/// `/proc/PID/cmdline` as one line (arguments joined by spaces), or `?`.
pub fn command_line(pid: u32) -> String {
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(b) if !b.is_empty() => {
            let parts: Vec<String> = b
                .split(|c| *c == 0)
                .filter(|p| !p.is_empty())
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .collect();
            parts.join(" ")
        }
        _ => "?".to_string(),
    }
}

/// A connection that has passed the hello.
pub struct Client {
    pid: u32,
    stream: UnixStream,
    lines: LineBuffer,
    deadline: Instant,
    timeout: Duration,
    /// The server's hello.
    pub hello: Hello,
}

fn remaining(deadline: Instant, timeout: Duration, pid: u32) -> Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(timed_out(pid, timeout));
    }
    Ok(left.max(Duration::from_millis(1)))
}

fn timed_out(pid: u32, timeout: Duration) -> Failure {
    Failure::new(
        Code::Timeout,
        format!(
            "process {pid} did not answer within {:.1} s (--timeout)",
            timeout.as_secs_f64()
        ),
    )
}

/// The exit code an error reply maps to.
pub fn code_of(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::PermissionDenied => Code::Permission,
        ErrorKind::Timeout => Code::Timeout,
        _ => Code::Failed,
    }
}

impl Client {
    /// Connect to process `pid`'s socket in `dir` and exchange hellos, all within `timeout`.
    pub fn connect(dir: &Path, pid: u32, timeout: Duration) -> Result<Client> {
        let deadline = Instant::now() + timeout;
        let path = socket_path(dir, pid);
        if !pid_alive(pid) {
            return Err(Failure::new(
                Code::NoProcess,
                format!("no such process: {pid}"),
            ));
        }
        match std::fs::symlink_metadata(&path) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(Failure::new(
                    Code::NoProcess,
                    format!(
                        "process {pid} has no control socket in {} (is libtms.so preloaded, has \
                         it made a pauseable allocation, is TMS_CONTROL=0 set, or does it use \
                         another TMS_SOCKET_DIR?)",
                        dir.display()
                    ),
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                return Err(Failure::new(
                    Code::Permission,
                    format!("permission denied: {}: {e}", path.display()),
                ))
            }
            Err(e) => {
                return Err(Failure::new(
                    Code::Failed,
                    format!("{}: {e}", path.display()),
                ))
            }
        }
        let stream = UnixStream::connect(&path).map_err(|e| match e.kind() {
            io::ErrorKind::PermissionDenied => Failure::new(
                Code::Permission,
                format!("permission denied connecting to {}: {e}", path.display()),
            ),
            io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound => Failure::new(
                Code::NoProcess,
                format!(
                    "process {pid} does not listen on {} (a stale socket)",
                    path.display()
                ),
            ),
            _ => Failure::new(
                Code::Failed,
                format!("connecting to {}: {e}", path.display()),
            ),
        })?;
        let mut c = Client {
            pid,
            stream,
            lines: LineBuffer::new(MAX_REPLY_BYTES),
            deadline,
            timeout,
            hello: Hello {
                protocol: 0,
                pid: 0,
                software: String::new(),
                backend: None,
            },
        };
        let me = Hello {
            protocol: PROTOCOL_VERSION,
            pid: std::process::id(),
            software: concat!("tmsctl ", env!("CARGO_PKG_VERSION")).to_string(),
            backend: None,
        };
        match c.ask(&Request::Hello(me))? {
            Reply::Hello(h) if h.protocol == PROTOCOL_VERSION => c.hello = h,
            Reply::Hello(h) => {
                return Err(Failure::new(
                    Code::Failed,
                    format!(
                        "process {pid} speaks control protocol {}, this tmsctl protocol \
                         {PROTOCOL_VERSION}: use the tmsctl built with its libtms.so ({})",
                        h.protocol, h.software
                    ),
                ))
            }
            other => return Err(c.unexpected(&other)),
        }
        Ok(c)
    }

    /// The process on the other end.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    fn unexpected(&self, r: &Reply) -> Failure {
        Failure::new(
            Code::Failed,
            format!("process {}: unexpected reply {r:?}", self.pid),
        )
    }

    fn io_failure(&self, what: &str, e: io::Error) -> Failure {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            return timed_out(self.pid, self.timeout);
        }
        Failure::new(Code::Failed, format!("process {}: {what}: {e}", self.pid))
    }

    /// Send `req` and read one reply; error replies come back as `Ok(Reply::Error(..))`.
    fn exchange(&mut self, req: &Request) -> Result<Reply> {
        let left = remaining(self.deadline, self.timeout, self.pid)?;
        self.stream
            .set_write_timeout(Some(left))
            .map_err(|e| self.io_failure("socket", e))?;
        // A server that refuses us may reply and close before reading what we sent: then
        // the write fails, but its reply (the reason) is still there to read.
        let sent = self.stream.write_all(&encode(req));
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            match self.lines.next_line() {
                Some(Ok(line)) => {
                    return decode_reply(&line).map_err(|e| {
                        Failure::new(
                            Code::Failed,
                            format!("process {} sent a bad reply: {e}", self.pid),
                        )
                    })
                }
                Some(Err(e)) => {
                    return Err(Failure::new(
                        Code::Failed,
                        format!("process {}: reply: {e}", self.pid),
                    ))
                }
                None => {}
            }
            let left = remaining(self.deadline, self.timeout, self.pid)?;
            self.stream
                .set_read_timeout(Some(left))
                .map_err(|e| self.io_failure("socket", e))?;
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    if let Err(e) = sent {
                        return Err(self.io_failure("sending", e));
                    }
                    return Err(Failure::new(
                        Code::Failed,
                        format!(
                            "process {} closed the connection without replying",
                            self.pid
                        ),
                    ));
                }
                Ok(n) => self.lines.push(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    if let Err(se) = sent {
                        return Err(self.io_failure("sending", se));
                    }
                    return Err(self.io_failure("reading the reply", e));
                }
            }
        }
    }

    /// Send `req`; an error reply becomes a [`Failure`] with its exit code.
    pub fn ask(&mut self, req: &Request) -> Result<Reply> {
        match self.exchange(req)? {
            Reply::Error(e) => Err(Failure::new(
                code_of(e.kind),
                format!("process {}: {}", self.pid, e.message),
            )),
            r => Ok(r),
        }
    }

    /// `ask` expecting a particular kind of reply, picked by `pick`.
    pub fn ask_for<T>(
        &mut self,
        req: &Request,
        pick: impl FnOnce(Reply) -> Option<T>,
    ) -> Result<T> {
        let r = self.ask(req)?;
        let shown = format!("{r:?}");
        pick(r).ok_or_else(|| {
            Failure::new(
                Code::Failed,
                format!("process {}: unexpected reply {shown}", self.pid),
            )
        })
    }
}

/// `<dir>/<pid>.sock`.
pub fn socket_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(tms_proto::socket_file_name(pid))
}
