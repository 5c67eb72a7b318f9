//! Framing: each message is one line of compact JSON; lines are decoded and encoded here, split
//! from a byte stream by [`LineBuffer`], and read from a socket by [`LineBuffer::read_line`].

use std::fmt;
use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::messages::{ErrorKind, OpTiming, Reply, Request};

/// Longest request line the server accepts, in bytes, not counting the `\n` (a `\r` before it
/// counts).
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Longest reply line a client accepts, in bytes, not counting the `\n` (a status of a
/// process with many tags is longer than any request).
pub const MAX_REPLY_BYTES: usize = 4 * 1024 * 1024;

/// Longest error message a decoder produces (a message may quote part of the input).
const MAX_MESSAGE_CHARS: usize = 240;

/// Why a line could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtoError {
    /// Longer than the limit.
    TooLong {
        /// Bytes seen (at least).
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Nothing but white space.
    Empty,
    /// Not a message of this protocol.
    Malformed(String),
}

impl ProtoError {
    /// The error kind of the reply that reports this.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ProtoError::TooLong { .. } => ErrorKind::LineTooLong,
            ProtoError::Empty | ProtoError::Malformed(_) => ErrorKind::BadRequest,
        }
    }

    /// The error reply that reports this.
    pub fn to_reply(&self) -> Reply {
        Reply::error(self.kind(), self.to_string())
    }
}

impl fmt::Display for ProtoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtoError::TooLong { len, max } => {
                write!(f, "line of {len} bytes or more is over the limit of {max}")
            }
            ProtoError::Empty => f.write_str("empty line"),
            ProtoError::Malformed(m) => write!(f, "malformed message: {m}"),
        }
    }
}

impl std::error::Error for ProtoError {}

/// `s` made fit for a log line or a terminal: its control characters (which a message may
/// quote from the peer) escaped, and cut after [`MAX_MESSAGE_CHARS`], escapes included.
fn shorten(s: &str) -> String {
    let mut out = String::new();
    let mut shown = 0;
    for c in s.chars() {
        let width = if c.is_control() {
            c.escape_default().len()
        } else {
            1
        };
        if shown + width > MAX_MESSAGE_CHARS {
            out.push_str("...");
            break;
        }
        shown += width;
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

fn decode<T: serde::de::DeserializeOwned>(line: &[u8], max: usize) -> Result<T, ProtoError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    // A `\r` counts, as it does for `LineBuffer`: a line the buffer refuses as too long is not
    // taken here when given whole.
    if line.len() > max {
        return Err(ProtoError::TooLong {
            len: line.len(),
            max,
        });
    }
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Some(start) = line.iter().position(|b| !b.is_ascii_whitespace()) else {
        return Err(ProtoError::Empty);
    };
    // One JSON object: serde would also take an array for a struct or an internally tagged
    // enum, its elements in field order (`["pause","kv"]`), which is no message of this
    // protocol, and whose fields have no names to refuse.
    if line[start] != b'{' {
        let found = match line[start] {
            b if b.is_ascii_graphic() => format!("`{}`", char::from(b)),
            b => format!("byte 0x{b:02x}"),
        };
        return Err(ProtoError::Malformed(format!(
            "expected a JSON object, found {found} at column {}",
            start + 1
        )));
    }
    serde_json::from_slice(line).map_err(|e| ProtoError::Malformed(shorten(&e.to_string())))
}

/// The keys a request without fields may have: `op` only.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpOnly {
    #[serde(rename = "op")]
    _op: serde::de::IgnoredAny,
}

/// Decode one request line (with or without its `\n`). Never panics, whatever the bytes.
///
/// A field the request does not have is rejected, for the operations without fields
/// (`ping`, `status`, `get_region`) too: serde ignores extra keys of a unit variant of an
/// internally tagged enum, so those are checked again here.
pub fn decode_request(line: &[u8]) -> Result<Request, ProtoError> {
    let r: Request = decode(line, MAX_LINE_BYTES)?;
    if matches!(r, Request::Ping | Request::Status | Request::GetRegion) {
        decode::<OpOnly>(line, MAX_LINE_BYTES)?;
    }
    Ok(r)
}

/// Decode one reply line (with or without its `\n`). Never panics, whatever the bytes.
pub fn decode_reply(line: &[u8]) -> Result<Reply, ProtoError> {
    let r: Reply = decode(line, MAX_REPLY_BYTES)?;
    check_quantities(&r).map_err(ProtoError::Malformed)?;
    Ok(r)
}

/// Durations and rates a reply reports are finite and not negative: a server that says
/// otherwise (a bug, or a peer that is not ours) is refused rather than printed.
fn check_quantities(r: &Reply) -> Result<(), String> {
    let check = |what: &str, v: f64| {
        if v.is_finite() && v >= 0.0 {
            Ok(())
        } else {
            Err(format!("{what} is {v}: not a duration or a rate"))
        }
    };
    let timing = |what: &str, t: &Option<OpTiming>| match t {
        Some(t) => check(what, t.seconds).and_then(|()| check(what, t.gib_per_s)),
        None => Ok(()),
    };
    match r {
        Reply::Done(d) => check("seconds", d.seconds),
        Reply::Status(s) => {
            for t in &s.tags {
                timing("last_pause", &t.last_pause)?;
                timing("last_resume", &t.last_resume)?;
            }
            for o in &s.operations {
                check("seconds", o.seconds)?;
                if let Some(g) = o.gib_per_s {
                    check("gib_per_s", g)?;
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// One message as a line: compact JSON and `\n`.
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    // The protocol's types have string keys and finite numbers only, so serialising cannot
    // fail; should it ever, the peer gets a line it rejects rather than this side panicking.
    let mut v = serde_json::to_vec(msg).unwrap_or_else(|e| {
        serde_json::to_vec(&Reply::error(
            ErrorKind::Internal,
            format!("encoding a message: {e}"),
        ))
        .unwrap_or_default()
    });
    v.push(b'\n');
    v
}

// ---------------------------------------------------------------------------------------------
// Lines from a byte stream

/// Splits a byte stream into lines of at most `max` bytes:
/// [`read_line`](LineBuffer::read_line) reads them from a socket with the waits its caller
/// chooses.
#[derive(Debug)]
pub struct LineBuffer {
    buf: Vec<u8>,
    /// Bytes at the start of `buf` already searched for a newline.
    scanned: usize,
    max: usize,
}

impl LineBuffer {
    /// A buffer for lines of at most `max` bytes (not counting the `\n`).
    pub fn new(max: usize) -> Self {
        LineBuffer {
            buf: Vec::new(),
            scanned: 0,
            max,
        }
    }

    /// Append bytes that arrived. Not public: [`read_line`](LineBuffer::read_line) calls
    /// [`next_line`](LineBuffer::next_line) between reads, which bounds the buffer to the limit
    /// and one read; a caller pushing without it could grow it without bound.
    pub(crate) fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete line (without its `\n`), an error once more than `max` bytes have
    /// arrived without a newline, or `None` when more bytes are needed.
    pub fn next_line(&mut self) -> Option<Result<Vec<u8>, ProtoError>> {
        let limit = self.buf.len().min(self.max.saturating_add(1));
        if let Some(i) = self.buf[self.scanned..limit]
            .iter()
            .position(|b| *b == b'\n')
        {
            let end = self.scanned + i;
            let mut line: Vec<u8> = self.buf.drain(..=end).collect();
            line.pop();
            self.scanned = 0;
            return Some(Ok(line));
        }
        self.scanned = limit;
        if self.buf.len() > self.max {
            return Some(Err(ProtoError::TooLong {
                len: self.buf.len(),
                max: self.max,
            }));
        }
        None
    }

    /// Bytes received of a line not yet complete.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// The shortest wait a read is given (a zero read timeout would mean none at all).
const MIN_WAIT: Duration = Duration::from_millis(1);

/// Why [`LineBuffer::read_line`] gave no line.
#[derive(Debug)]
pub enum ReadFault {
    /// More than the limit arrived without a newline.
    TooLong(ProtoError),
    /// The peer closed its end, `pending` bytes into a line (0: between lines).
    Closed {
        /// Bytes of the unfinished line.
        pending: usize,
    },
    /// The caller's time ran out before a read.
    Expired,
    /// A read waited as long as it was given, and nothing came.
    Quiet,
    /// Reading, or setting its wait, failed.
    Io(io::Error),
}

impl LineBuffer {
    /// The next line from `stream`: one already complete, else what reads bring. Before each
    /// read `wait` says how long it may wait (`None`: no time is left, [`ReadFault::Expired`]); a
    /// read that waits so long for nothing is [`ReadFault::Quiet`], and one a signal interrupts
    /// is made again. The policy (deadlines, what to check between reads) is the caller's: after
    /// [`ReadFault::Quiet`] or [`ReadFault::Expired`] it may call again, and the bytes of an
    /// unfinished line are kept.
    pub fn read_line(
        &mut self,
        mut stream: &UnixStream,
        mut wait: impl FnMut() -> Option<Duration>,
    ) -> Result<Vec<u8>, ReadFault> {
        let mut chunk = [0u8; 16 * 1024];
        loop {
            match self.next_line() {
                Some(Ok(line)) => return Ok(line),
                Some(Err(e)) => return Err(ReadFault::TooLong(e)),
                None => {}
            }
            let left = wait().ok_or(ReadFault::Expired)?;
            stream
                .set_read_timeout(Some(left.max(MIN_WAIT)))
                .map_err(ReadFault::Io)?;
            match stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(ReadFault::Closed {
                        pending: self.pending(),
                    })
                }
                Ok(n) => self.push(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(ReadFault::Quiet)
                }
                Err(e) => return Err(ReadFault::Io(e)),
            }
        }
    }
}
