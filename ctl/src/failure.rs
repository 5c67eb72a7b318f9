//! How a command fails: a [`Failure`] carries the exit code it maps to ([`Code`]) and a one-line
//! reason; [`Reported`] is one already told, of which only the exit code remains.

use std::fmt;

use tms_proto::Changed;

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
    /// A pause or resume the process answered with an error: what it changed all the same, as
    /// the process said (`None` where it did not: a server that predates saying it, or no
    /// such reply).
    pub changed: Option<Changed>,
}

impl Failure {
    /// A failure.
    pub fn new(code: Code, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
            changed: None,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Failure {}

/// A result whose error is a [`Failure`].
pub type Result<T> = std::result::Result<T, Failure>;

/// An error already reported (on stderr, and with --json on stdout): only the exit code remains.
#[derive(Debug)]
pub struct Reported(pub Code);

impl fmt::Display for Reported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "failed (exit code {})", self.0 as u8)
    }
}

impl std::error::Error for Reported {}
