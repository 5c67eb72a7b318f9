//! The client side of the control protocol: connect to a process's socket, check who answers,
//! hello, ask; every failure is a [`Failure`] with the exit code it maps to.
//!
//! # Whom tmsctl trusts
//!
//! What a server replies decides what tmsctl prints and whether it reports success, so the reply
//! must come from the process named, run by us:
//!
//! - the socket folder must be one tmsctl trusts ([`crate::folder`]);
//! - the server must run as our uid (`SO_PEERCRED`);
//! - its hello must name the pid of the socket's file name, and, for a socket of our own pid
//!   namespace (or one that names none), that pid must be the one the kernel reports for the
//!   server (a pid of another namespace means another process here, so there it cannot be
//!   compared);
//! - a later connection through the socket a connection has ([`Client::socket`]) must reach
//!   the process that one reached, not another given its pid since (a pid is reused once the
//!   counter wraps around, and a new process of the library binds the same socket name in the
//!   same folder): told by the process's start time ([`crate::procfs::start_time`]), read on
//!   each connection once its peer is checked, before the hello, and kept in the [`Socket`].
//!   Where `/proc` did not say at first, it cannot be compared.
//!
//! Text a server sends is printed only through [`crate::text::printable`].

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use tms_proto::{
    decode_reply, encode, ErrorKind, Hello, LineBuffer, ReadFault, Reply, Request, MAX_REPLY_BYTES,
    PROTOCOL_VERSION,
};

// The failures, and the folder, where the demo names them.
pub use crate::failure::{Code, Failure, Result};
use crate::procfs::{euid, pid_alive, start_time};
use crate::socket::Socket;
use crate::text::printable;

/// What one attempt to connect gave.
enum Attempt {
    /// A connection that passed the checks and the hello.
    Ready(Box<Client>),
    /// The server had no room for it (its reason).
    Busy(String),
}

/// A connection that has passed the checks and the hello.
pub struct Client {
    pid: u32,
    /// The socket it is connected to (a progress display opens a second connection).
    sock: Socket,
    /// The wait for the last reply was bounded by the time without progress (see
    /// [`Client::ask_while`]).
    by_progress: bool,
    /// The last request went out whole and its reply did not come in time.
    unanswered: bool,
    stream: UnixStream,
    lines: LineBuffer,
    deadline: Instant,
    timeout: Duration,
    /// The server's hello.
    pub hello: Hello,
}

/// Longest wait for a reply between two checks that the process still lives.
const LIVENESS_SLICE: Duration = Duration::from_millis(200);

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

/// The checks on who serves a socket, given what the kernel says (`peer_uid`, `peer_pid`) and
/// what the server says (`hello_pid`; `None` before the hello). `Err` is the reason to refuse.
pub fn vet_server(
    sock: &Socket,
    me: u32,
    peer_uid: u32,
    peer_pid: i32,
    hello_pid: Option<u32>,
) -> std::result::Result<(), String> {
    let pid = sock.pid();
    if peer_uid != me {
        return Err(format!(
            "its server runs as uid {peer_uid}, not as uid {me} (this tmsctl's)"
        ));
    }
    if sock.here() && u32::try_from(peer_pid).ok() != Some(pid) {
        return Err(format!(
            "it is served by process {peer_pid}, not by process {pid} as its name says"
        ));
    }
    if let Some(h) = hello_pid {
        if h != pid {
            return Err(format!(
                "its server says it is process {h}, not process {pid} as its name says"
            ));
        }
    }
    Ok(())
}

/// Connect to the socket at `path`, waiting at most `wait` for room in its server's queue of
/// connections (a blocking `connect` waits for as long as a server that takes none leaves it
/// full); `WouldBlock` once that has passed.
fn connect_within(path: &std::path::Path, wait: Duration) -> io::Result<UnixStream> {
    use nix::errno::Errno;
    use nix::sys::socket::{
        connect, setsockopt, socket, sockopt::SendTimeout, AddressFamily, SockFlag, SockType,
        UnixAddr,
    };
    use nix::sys::time::{TimeVal, TimeValLike};
    use std::os::fd::AsRawFd;
    let addr = UnixAddr::new(path)?;
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let deadline = Instant::now() + wait;
    let mut left = wait;
    loop {
        // Never 0, which would mean no bound at all.
        let micros = i64::try_from(left.as_micros())
            .unwrap_or(i64::MAX)
            .max(1000);
        setsockopt(&fd, SendTimeout, &TimeVal::microseconds(micros))?;
        match connect(fd.as_raw_fd(), &addr) {
            // A signal: a Ctrl-C that `--atomic` takes ends the wait; any other goes on with
            // what is left of it, not a new one.
            Err(Errno::EINTR) if crate::interrupt::taken() => {
                return Err(io::Error::new(io::ErrorKind::Interrupted, "Ctrl-C"))
            }
            Err(Errno::EINTR) => {
                left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
            }
            r => {
                r?;
                return Ok(UnixStream::from(fd));
            }
        }
    }
}

impl Client {
    /// Connect to `sock`, check who serves it and exchange hellos, all within `timeout`.
    ///
    /// A server with no room for another connection says so ([`ErrorKind::Busy`]) and closes
    /// it: then tmsctl connects again, after a pause that grows, until `timeout` has passed
    /// ([`Code::Timeout`]).
    ///
    /// Where `sock` says when its process started (a connection's [`Client::socket`]), another
    /// process given its pid since is refused ([`Code::NoProcess`]) before it is sent anything.
    pub fn connect(sock: &Socket, timeout: Duration) -> Result<Client> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(20);
        let mut busy: Option<String> = None;
        let no_room = |why: &str| {
            Failure::new(
                Code::Timeout,
                format!(
                    "process {} had no room for this connection within {:.1} s (--timeout): {}",
                    sock.pid(),
                    timeout.as_secs_f64(),
                    printable(why)
                ),
            )
        };
        loop {
            match Client::attempt(sock, deadline, timeout) {
                Ok(Attempt::Ready(c)) => return Ok(*c),
                Ok(Attempt::Busy(why)) => busy = Some(why),
                Err(f) => {
                    return Err(match (&busy, f.code) {
                        (Some(why), Code::Timeout) => no_room(why),
                        _ => f,
                    })
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(no_room(busy.as_deref().unwrap_or("")));
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    fn attempt(sock: &Socket, deadline: Instant, timeout: Duration) -> Result<Attempt> {
        let pid = sock.pid();
        let path = &sock.path;
        let shown = printable(&path.display().to_string()).into_owned();
        if sock.here() && !pid_alive(pid) {
            return Err(Failure::new(
                Code::NoProcess,
                format!("no such process: {pid}"),
            ));
        }
        let wait = remaining(deadline, timeout, pid)?;
        let stream = tms_proto::via_short_path(path, |p| connect_within(p, wait)).map_err(|e| {
            match e.kind() {
                // Its queue of connections stayed full: a server that takes none (stopped, say).
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Failure::new(
                    Code::Timeout,
                    format!(
                        "process {pid} did not take the connection on {shown} within {:.1} s \
                         (--timeout): its queue of connections is full",
                        timeout.as_secs_f64()
                    ),
                ),
                io::ErrorKind::Interrupted => Failure::new(
                    Code::Running,
                    format!(
                        "process {pid}: interrupted (Ctrl-C) while connecting, before it was \
                         asked: nothing was sent to it"
                    ),
                ),
                io::ErrorKind::PermissionDenied => Failure::new(
                    Code::Permission,
                    format!("permission denied connecting to {shown}: {e}"),
                ),
                io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound => Failure::new(
                    Code::NoProcess,
                    format!("process {pid} does not listen on {shown} (a stale socket)"),
                ),
                _ => Failure::new(Code::Failed, format!("connecting to {shown}: {e}")),
            }
        })?;
        let refuse = |why: String| {
            Failure::new(
                Code::Permission,
                format!("permission denied: refusing {shown}: {why}"),
            )
        };
        let cred = getsockopt(&stream, PeerCredentials).map_err(|e| {
            Failure::new(
                Code::Failed,
                format!(
                    "{shown}: the kernel does not say who serves it (SO_PEERCRED): {}",
                    e.desc()
                ),
            )
        })?;
        let me = euid();
        vet_server(sock, me, cred.uid(), cred.pid(), None).map_err(refuse)?;
        // Read once the kernel's pid is known to be the one named: that process's.
        let started = sock.here().then(|| start_time(pid)).flatten();
        let gone = |why: String| Err(Failure::new(Code::NoProcess, why));
        match (sock.started, started) {
            (Some(then), Some(now)) if now != then => {
                return gone(format!(
                    "process {pid} ended; pid {pid} is now another process"
                ))
            }
            (Some(_), None) => {
                return gone(format!(
                    "process {pid}: when it started can no longer be read (/proc/{pid}/stat): \
                     it cannot be told from another process given pid {pid}"
                ))
            }
            _ => {}
        }
        let mut c = Client {
            pid,
            sock: Socket {
                started,
                ..sock.clone()
            },
            by_progress: false,
            unanswered: false,
            stream,
            lines: LineBuffer::new(MAX_REPLY_BYTES),
            deadline,
            timeout,
            hello: Hello {
                protocol: 0,
                pid: 0,
                software: String::new(),
                backend: None,
                features: Vec::new(),
            },
        };
        let hello = Hello {
            protocol: PROTOCOL_VERSION,
            pid: std::process::id(),
            software: concat!("tmsctl ", env!("CARGO_PKG_VERSION")).to_string(),
            backend: None,
            features: Vec::new(),
        };
        match c.exchange(&Request::Hello(hello))? {
            Reply::Error(e) if e.kind == ErrorKind::Busy => return Ok(Attempt::Busy(e.message)),
            Reply::Error(e) => {
                return Err(Failure::new(
                    code_of(e.kind),
                    format!("process {pid}: {}", printable(&e.message)),
                ))
            }
            Reply::Hello(h) => {
                vet_server(sock, me, cred.uid(), cred.pid(), Some(h.pid)).map_err(refuse)?;
                if h.protocol != PROTOCOL_VERSION {
                    return Err(Failure::new(
                        Code::Failed,
                        format!(
                            "process {pid} speaks control protocol {}, this tmsctl protocol \
                             {PROTOCOL_VERSION}: use the tmsctl built with its libtms.so ({})",
                            h.protocol,
                            printable(&h.software)
                        ),
                    ));
                }
                c.hello = h;
            }
            other => return Err(c.unexpected(&other)),
        }
        Ok(Attempt::Ready(Box::new(c)))
    }

    /// The process on the other end.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The socket this connection is on, with when its process started: a connection through it
    /// reaches that process or none.
    pub fn socket(&self) -> &Socket {
        &self.sock
    }

    /// Give the next request `timeout` from now (a connection's requests share the one wait
    /// set when it was made; one that polls for long needs a fresh one for each).
    pub fn rearm(&mut self, timeout: Duration) {
        self.timeout = timeout;
        self.deadline = Instant::now() + timeout;
    }

    fn unexpected(&self, r: &Reply) -> Failure {
        Failure::new(
            Code::Failed,
            format!(
                "process {}: unexpected reply {}",
                self.pid,
                printable(&format!("{r:?}"))
            ),
        )
    }

    fn io_failure(&self, what: &str, e: io::Error) -> Failure {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                timed_out(self.pid, self.timeout)
            }
            // The server closed its end (with our request unread, or before we wrote it).
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => self.closed(),
            _ => Failure::new(Code::Failed, format!("process {}: {what}: {e}", self.pid)),
        }
    }

    fn closed(&self) -> Failure {
        Failure::new(
            Code::Failed,
            format!(
                "process {} closed the connection without replying",
                self.pid
            ),
        )
    }

    /// `f`, or for a timeout of a request that went out whole, a [`Code::Running`] failure
    /// saying so: `what` ("the pause of tag \"kv\"") runs on in the process.
    pub fn still_running(&self, f: Failure, what: &str) -> Failure {
        if f.code != Code::Timeout || !self.unanswered {
            return f;
        }
        let waited = if self.by_progress {
            format!(
                "no reply came and nothing moved for {:.1} s (--timeout counts the time without \
                 progress)",
                self.timeout.as_secs_f64()
            )
        } else {
            format!(
                "no reply came within {:.1} s (--timeout)",
                self.timeout.as_secs_f64()
            )
        };
        Failure::new(
            Code::Running,
            format!(
                "process {pid}: {what} was sent, and {waited}: sent; still running in the \
                 process (or waiting there for another pause or resume to end); `tmsctl status \
                 --pid {pid}` lists it until it has ended",
                pid = self.pid,
            ),
        )
    }

    /// Send `req` and read one reply; error replies come back as `Ok(Reply::Error(..))`.
    fn exchange(&mut self, req: &Request) -> Result<Reply> {
        self.exchange_while(req, None)
    }

    /// [`Client::exchange`], where `moved` (if given) tells when the process last made
    /// progress: the wait then ends only once `--timeout` has passed since then.
    fn exchange_while(
        &mut self,
        req: &Request,
        moved: Option<&dyn Fn() -> Instant>,
    ) -> Result<Reply> {
        self.by_progress = moved.is_some();
        let left = remaining(self.deadline, self.timeout, self.pid)?;
        self.stream
            .set_write_timeout(Some(left))
            .map_err(|e| self.io_failure("socket", e))?;
        // A server that refuses us may reply and close before reading what we sent: then
        // the write fails, but its reply (the reason) is still there to read.
        let sent = self.stream.write_all(&encode(req));
        self.unanswered = false;
        loop {
            let (deadline, timeout) = (&mut self.deadline, self.timeout);
            // In slices, so that a process that has ended is told from one that takes its
            // time (a copy of its end of the connection, in a child it forked, keeps it open).
            let slice = || {
                if let Some(m) = moved {
                    *deadline = (*deadline).max(m() + timeout);
                }
                let left = deadline.saturating_duration_since(Instant::now());
                (!left.is_zero()).then(|| left.min(LIVENESS_SLICE))
            };
            match self.lines.read_line(&self.stream, slice) {
                Ok(line) => {
                    return decode_reply(&line).map_err(|e| {
                        Failure::new(
                            Code::Failed,
                            format!(
                                "process {} sent a bad reply: {}",
                                self.pid,
                                printable(&e.to_string())
                            ),
                        )
                    })
                }
                Err(ReadFault::TooLong(e)) => {
                    return Err(Failure::new(
                        Code::Failed,
                        format!("process {}: reply: {e}", self.pid),
                    ))
                }
                Err(ReadFault::Expired) => {
                    self.unanswered = sent.is_ok();
                    return Err(timed_out(self.pid, self.timeout));
                }
                Err(ReadFault::Quiet) => {
                    if crate::interrupt::taken() {
                        self.unanswered = sent.is_ok();
                        return Err(Failure::new(
                            Code::Running,
                            format!(
                                "process {pid}: interrupted (Ctrl-C) before it replied: what was \
                                 sent may still run in the process; `tmsctl status --pid {pid}` \
                                 lists it until it has ended",
                                pid = self.pid
                            ),
                        ));
                    }
                    if self.sock.here() && !pid_alive(self.pid) {
                        return Err(Failure::new(
                            Code::Failed,
                            format!("process {} ended without replying", self.pid),
                        ));
                    }
                }
                Err(ReadFault::Closed { .. }) => {
                    if let Err(e) = sent {
                        return Err(self.io_failure("sending", e));
                    }
                    return Err(self.closed());
                }
                Err(ReadFault::Io(e)) => {
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
        self.ask_while(req, None)
    }

    /// [`Client::ask`], waiting for the reply until `--timeout` has passed without progress:
    /// `moved` says when the process last moved (bytes copied, a phase changed).
    pub fn ask_while(
        &mut self,
        req: &Request,
        moved: Option<&dyn Fn() -> Instant>,
    ) -> Result<Reply> {
        match self.exchange_while(req, moved)? {
            Reply::Error(e) => Err(Failure {
                changed: e.changed,
                ..Failure::new(
                    code_of(e.kind),
                    format!("process {}: {}", self.pid, printable(&e.message)),
                )
            }),
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
        let shown = printable(&format!("{r:?}")).into_owned();
        pick(r).ok_or_else(|| {
            Failure::new(
                Code::Failed,
                format!("process {}: unexpected reply {shown}", self.pid),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::socket::{test_socket as sock, Ns};

    #[test]
    fn only_the_named_process_of_our_uid_is_trusted() {
        let ours = sock(42, Ns::Ours);
        assert_eq!(vet_server(&ours, 1000, 1000, 42, Some(42)), Ok(()));
        let e = vet_server(&ours, 1000, 1001, 42, Some(42)).unwrap_err();
        assert!(e.contains("uid 1001") && e.contains("uid 1000"), "{e}");
        let e = vet_server(&ours, 0, 65534, 42, None).unwrap_err();
        assert!(e.contains("uid 65534"), "{e}");
        // Another process serving a socket named after 42.
        let e = vet_server(&ours, 1000, 1000, 43, None).unwrap_err();
        assert!(e.contains("process 43"), "{e}");
        // A hello claiming another pid.
        let e = vet_server(&ours, 1000, 1000, 42, Some(1)).unwrap_err();
        assert!(e.contains("process 1,"), "{e}");
        // Unnamed sockets are taken to be of our namespace: same checks.
        assert!(vet_server(&sock(42, Ns::Unnamed), 1000, 1000, 43, None).is_err());
        // Another namespace: the kernel's pid is of ours, not comparable; the hello still is.
        let other = sock(42, Ns::Other(5));
        assert_eq!(vet_server(&other, 1000, 1000, 9999, Some(42)), Ok(()));
        assert!(vet_server(&other, 1000, 1000, 9999, Some(41)).is_err());
        assert!(vet_server(&other, 1000, 0, 9999, Some(42)).is_err());
    }
}
