//! The client side of the control protocol: open and vet the socket folder, pick a process's
//! socket, connect, check who answers, hello, ask; every failure is a [`Failure`] with the exit
//! code it maps to.
//!
//! # Whom tmsctl trusts
//!
//! What a server replies decides what tmsctl prints and whether it reports success, so the reply
//! must come from the process named, run by us:
//!
//! - the socket folder must be a real folder (not a symbolic link) owned by our effective uid
//!   that group and others cannot use at all (the rule the server applies when it makes it);
//!   anything else is refused with [`Code::Permission`] before a socket in it is looked at;
//! - the server must run as our uid (`SO_PEERCRED`);
//! - its hello must name the pid of the socket's file name, and, for a socket of our own pid
//!   namespace (or one that names none), that pid must be the one the kernel reports for the
//!   server (a pid of another namespace means another process here, so there it cannot be
//!   compared).
//!
//! Text a server sends is printed only through [`crate::output::printable`].
//!
//! # Pid namespaces
//!
//! A socket is named `<pid>.<pidns>.sock` (`<pid>.sock` by older servers, or without `/proc`).
//! `--pid P` means process P of tmsctl's own pid namespace: `<P>.<ours>.sock`, else `<P>.sock`;
//! sockets of P in other namespaces are never taken for it ([`Folder::find`]).

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fmt;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{open, OFlag};
use nix::sys::signal::kill;
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use nix::sys::stat::{fstat, lstat, Mode, SFlag};
use nix::unistd::{geteuid, Pid};
use tms_proto::{
    decode_reply, encode, ErrorKind, Hello, LineBuffer, ReadFault, Reply, Request, SocketName,
    MAX_REPLY_BYTES, PROTOCOL_VERSION,
};

use crate::output::printable;

/// Exit codes of tmsctl (documented in `--help` and the README; an interface: add, never
/// change).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// The process replied with an error, or another failure (a demo check, a bad reply).
    Failed = 1,
    /// Bad command line.
    Usage = 2,
    /// No such process, or it has no control socket.
    NoProcess = 3,
    /// Permission denied: another user's process, or a folder or server tmsctl does not trust.
    Permission = 4,
    /// No answer in time.
    Timeout = 5,
    /// A pause or resume named a tag that no allocation of the process ever had.
    UnknownTag = 6,
    /// A pause or resume was sent and not answered within the timeout: it runs on in the
    /// process (or waits there for another to end); `tmsctl status` lists it until it ends.
    Running = 7,
}

impl Code {
    /// Its name in `--json` errors (an interface too: scripts match on it).
    pub fn name(self) -> &'static str {
        match self {
            Code::Failed => "failed",
            Code::Usage => "usage",
            Code::NoProcess => "no_process",
            Code::Permission => "permission",
            Code::Timeout => "timeout",
            Code::UnknownTag => "unknown_tag",
            Code::Running => "running",
        }
    }
}

/// A failure with its exit code and a one-line reason.
#[derive(Clone, Debug)]
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
    geteuid().as_raw()
}

/// True when process `pid` (of our pid namespace) exists, ours or another user's.
pub fn pid_alive(pid: u32) -> bool {
    let Ok(p) = i32::try_from(pid) else {
        return false;
    };
    if p <= 0 {
        return false;
    }
    // Signal "none" delivers nothing; it only checks that the process exists.
    matches!(kill(Pid::from_raw(p), None), Ok(()) | Err(Errno::EPERM))
}

/// [`command_line`], cut to 60 characters, for naming a process inside a line.
pub fn short_command(pid: u32) -> String {
    let c = command_line(pid);
    if c.chars().count() <= 60 {
        return c;
    }
    let mut s: String = c.chars().take(59).collect();
    s.push('\u{2026}');
    s
}

/// `/proc/PID/cmdline` as one printable line (arguments joined by spaces), or `?`.
pub fn command_line(pid: u32) -> String {
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(b) if !b.is_empty() => {
            let parts: Vec<String> = b
                .split(|c| *c == 0)
                .filter(|p| !p.is_empty())
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .collect();
            printable(&parts.join(" ")).into_owned()
        }
        _ => "?".to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// The folder and its sockets

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

/// A socket file of the folder.
#[derive(Clone, Debug)]
pub struct Socket {
    /// What its name says.
    pub name: SocketName,
    /// Its path.
    pub path: PathBuf,
    /// Its pid namespace, relative to ours.
    pub ns: Ns,
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

    /// Its pid means a process of our namespace: it can be probed and checked here.
    pub fn here(&self) -> bool {
        !matches!(self.ns, Ns::Other(_))
    }
}

/// The socket folder, vetted, and the sockets in it.
#[derive(Debug)]
pub struct Folder {
    /// Its path.
    pub dir: PathBuf,
    /// Our pid namespace (`None` without `/proc`).
    pub our_ns: Option<u64>,
    /// Every file named like a socket, by pid, ours first.
    pub sockets: Vec<Socket>,
    /// It exists (a missing folder holds no socket).
    pub exists: bool,
}

/// `dir`, printable, followed by what it is (`about`) when that is given.
fn folder_shown(dir: &Path, about: &str) -> String {
    let shown = printable(&dir.display().to_string()).into_owned();
    if about.is_empty() {
        shown
    } else {
        format!("{shown} ({about})")
    }
}

fn refuse_folder(dir: &Path, about: &str, why: impl fmt::Display) -> Failure {
    Failure::new(
        Code::Permission,
        format!(
            "permission denied: refusing the socket folder {}: {why}",
            folder_shown(dir, about)
        ),
    )
}

/// What a refusal by [`Folder::open`] of `dir` says after the folder's name: why.
pub fn why_refused<'a>(f: &'a Failure, dir: &Path) -> &'a str {
    let path = dir.display().to_string();
    let shown = printable(&path);
    [
        "permission denied: refusing the socket folder ",
        "permission denied: cannot read the socket folder ",
        "cannot read the socket folder ",
    ]
    .iter()
    .find_map(|p| {
        f.message
            .strip_prefix(p)?
            .strip_prefix(&*shown)?
            .strip_prefix(": ")
    })
    .unwrap_or(&f.message)
}

fn unreadable_folder(dir: &Path, about: &str, e: Errno) -> Failure {
    let shown = folder_shown(dir, about);
    if matches!(e, Errno::EACCES | Errno::EPERM) {
        Failure::new(
            Code::Permission,
            format!(
                "permission denied: cannot read the socket folder {shown}: {}",
                e.desc()
            ),
        )
    } else {
        Failure::new(
            Code::Failed,
            format!("cannot read the socket folder {shown}: {}", e.desc()),
        )
    }
}

/// Where the name of a socket of namespace `pidns` places it, relative to `ours`.
pub fn classify(pidns: Option<u64>, ours: Option<u64>) -> Ns {
    match pidns {
        None => Ns::Unnamed,
        Some(n) if Some(n) == ours => Ns::Ours,
        Some(n) => Ns::Other(n),
    }
}

impl Folder {
    /// Open `dir`, check that we can trust it (a folder, not a link, ours, closed to group and
    /// others), and list its sockets. A folder that does not exist holds none; one that cannot
    /// be read is a permission error naming it.
    pub fn open(dir: &Path) -> Result<Folder> {
        Folder::open_about(dir, "")
    }

    /// [`Folder::open`], its refusals saying what the folder is (`about`: whose, from which
    /// variable) after its path.
    pub fn open_about(dir: &Path, about: &str) -> Result<Folder> {
        let our_ns = tms_proto::pid_namespace();
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd = match open(dir, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => {
                return Ok(Folder {
                    dir: dir.to_path_buf(),
                    our_ns,
                    sockets: Vec::new(),
                    exists: false,
                })
            }
            Err(e @ (Errno::ELOOP | Errno::ENOTDIR)) => {
                let kind =
                    lstat(dir).map(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT);
                let why = match kind {
                    Ok(k) if k == SFlag::S_IFLNK => "it is a symbolic link".to_string(),
                    Ok(k) if k != SFlag::S_IFDIR => "it is not a folder".to_string(),
                    _ => format!("cannot open it: {}", e.desc()),
                };
                return Err(refuse_folder(dir, about, why));
            }
            Err(e) => return Err(unreadable_folder(dir, about, e)),
        };
        let st = fstat(&fd).map_err(|e| unreadable_folder(dir, about, e))?;
        let me = euid();
        if st.st_uid != me {
            return Err(refuse_folder(
                dir,
                about,
                format!(
                    "it belongs to uid {}, not to uid {me} (this tmsctl's)",
                    st.st_uid
                ),
            ));
        }
        let mode = st.st_mode & 0o777;
        if mode & 0o077 != 0 {
            return Err(refuse_folder(
                dir,
                about,
                format!(
                    "its mode is {mode:04o}: group or others have access (it must be 0700, as \
                     the server makes it)"
                ),
            ));
        }
        let mut listing = Dir::from_fd(fd).map_err(|e| unreadable_folder(dir, about, e))?;
        let mut sockets = Vec::new();
        for entry in listing.iter() {
            let entry = entry.map_err(|e| unreadable_folder(dir, about, e))?;
            let name = OsStr::from_bytes(entry.file_name().to_bytes());
            let Some(name) = name.to_str().and_then(SocketName::parse) else {
                continue;
            };
            sockets.push(Socket {
                path: dir.join(name.file_name()),
                ns: classify(name.pidns, our_ns),
                name,
            });
        }
        sockets.sort_by_key(|s| (!s.here(), s.name.pid, s.ns));
        Ok(Folder {
            dir: dir.to_path_buf(),
            our_ns,
            sockets,
            exists: true,
        })
    }

    /// The sockets of live processes of our pid namespace (named for it, or for none), one per
    /// pid (the one named for our namespace where both are there), by pid.
    pub fn live_here(&self) -> Vec<Socket> {
        let mut by_pid: BTreeMap<u32, &Socket> = BTreeMap::new();
        for s in self.sockets.iter().filter(|s| s.here()) {
            let e = by_pid.entry(s.pid()).or_insert(s);
            if s.ns < e.ns {
                *e = s;
            }
        }
        by_pid
            .into_values()
            .filter(|s| pid_alive(s.pid()))
            .cloned()
            .collect()
    }

    /// The sockets of other pid namespaces, by pid (not probed: their pids mean other
    /// processes here).
    pub fn elsewhere(&self) -> Vec<Socket> {
        self.sockets.iter().filter(|s| !s.here()).cloned().collect()
    }

    fn shown(&self) -> String {
        printable(&self.dir.display().to_string()).into_owned()
    }

    fn ns_shown(&self) -> String {
        match self.our_ns {
            Some(n) => format!("pid namespace {n}"),
            None => "this pid namespace".to_string(),
        }
    }

    /// The socket of process `pid` of our pid namespace: `<pid>.<our-ns>.sock`, else
    /// `<pid>.sock`. Sockets of that pid in other namespaces belong to other processes: they
    /// are named in the refusal, never taken.
    pub fn find(&self, pid: u32) -> Result<Socket> {
        let of_pid: Vec<&Socket> = self.sockets.iter().filter(|s| s.pid() == pid).collect();
        if let Some(s) = of_pid.iter().filter(|s| s.here()).min_by_key(|s| s.ns) {
            return Ok((*s).clone());
        }
        if !of_pid.is_empty() {
            let names: Vec<String> = of_pid.iter().map(|s| s.file_name()).collect();
            return Err(Failure::new(
                Code::NoProcess,
                format!(
                    "process {pid} of this pid namespace ({}) has no control socket in {}; {} \
                     there {} of pid {pid} of another pid namespace, which is another process: \
                     run tmsctl in that namespace",
                    self.ns_shown(),
                    self.shown(),
                    names.join(", "),
                    if names.len() == 1 { "is" } else { "are" },
                ),
            ));
        }
        if !pid_alive(pid) {
            return Err(Failure::new(
                Code::NoProcess,
                format!("no such process: {pid}"),
            ));
        }
        Err(Failure::new(
            Code::NoProcess,
            format!(
                "process {pid} has no control socket in {} (is libtms.so preloaded, has it made \
                 a pauseable allocation, is TMS_CONTROL=0 set, or do its TMS_SOCKET_DIR or \
                 XDG_RUNTIME_DIR make it another folder?)",
                self.shown()
            ),
        ))
    }

    /// What the folder holds of other pid namespaces, for a message saying that no process of
    /// ours has a socket in it: `None` when it holds nothing of theirs.
    pub fn other_namespaces(&self) -> Option<String> {
        let others = self.elsewhere();
        if others.is_empty() {
            return None;
        }
        let names: Vec<String> = others.iter().map(Socket::file_name).collect();
        Some(format!(
            "no process of this pid namespace ({}) has one there; it holds sockets of other \
             pid namespaces only ({}): run tmsctl in theirs (tmsctl list shows them)",
            self.ns_shown(),
            names.join(", ")
        ))
    }

    /// It holds a socket named for pid `pid` (of any pid namespace).
    pub fn has_pid(&self, pid: u32) -> bool {
        self.sockets.iter().any(|s| s.pid() == pid)
    }
}

// ---------------------------------------------------------------------------------------------
// A connection

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
    /// The process is of our pid namespace: whether it still lives can be asked.
    here: bool,
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

impl Client {
    /// Connect to `sock`, check who serves it and exchange hellos, all within `timeout`.
    ///
    /// A server with no room for another connection says so ([`ErrorKind::Busy`]) and closes
    /// it: then tmsctl connects again, after a pause that grows, until `timeout` has passed
    /// ([`Code::Timeout`]).
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
        let stream = UnixStream::connect(path).map_err(|e| match e.kind() {
            io::ErrorKind::PermissionDenied => Failure::new(
                Code::Permission,
                format!("permission denied connecting to {shown}: {e}"),
            ),
            io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound => Failure::new(
                Code::NoProcess,
                format!("process {pid} does not listen on {shown} (a stale socket)"),
            ),
            _ => Failure::new(Code::Failed, format!("connecting to {shown}: {e}")),
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
        let mut c = Client {
            pid,
            sock: sock.clone(),
            by_progress: false,
            here: sock.here(),
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

    /// The socket this connection is on.
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
                    if self.here && !pid_alive(self.pid) {
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
            Reply::Error(e) => Err(Failure::new(
                code_of(e.kind),
                format!("process {}: {}", self.pid, printable(&e.message)),
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

    fn sock(pid: u32, ns: Ns) -> Socket {
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
        }
    }

    #[test]
    fn names_are_placed_by_namespace() {
        assert_eq!(classify(Some(7), Some(7)), Ns::Ours);
        assert_eq!(classify(None, Some(7)), Ns::Unnamed);
        assert_eq!(classify(Some(8), Some(7)), Ns::Other(8));
        assert_eq!(classify(Some(8), None), Ns::Other(8));
        assert!(Ns::Ours < Ns::Unnamed && Ns::Unnamed < Ns::Other(0));
    }

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
