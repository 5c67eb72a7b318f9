//! One connection: hello, then requests and replies, under time and size limits.
//!
//! The server has one thread, so a connection must not hold it for long whatever the client
//! does: every request line must arrive whole within [`Limits::request_timeout`] of the
//! previous reply (this bounds idle clients and clients that dribble bytes alike), every reply
//! must be taken within [`Limits::write_timeout`], and a connection serves at most
//! [`Limits::max_requests`] requests. Anything unacceptable gets an error reply (best effort)
//! and the connection is closed; nothing a client sends can make this code panic, and the
//! dispatch of a request runs inside `catch_unwind` regardless.

use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use tms_proto::{
    decode_request, encode, ErrorKind, Hello, LineBuffer, ProtoError, Reply, Request,
    MAX_LINE_BYTES, PROTOCOL_VERSION,
};

use super::auth::{authenticate, AuthenticatedClient};
use super::dispatch::{dispatch, Host};
use super::sys;

/// Time and count limits of one connection.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Time for a whole request line to arrive, counted from the previous reply.
    pub request_timeout: Duration,
    /// Time for a reply to be taken by the client.
    pub write_timeout: Duration,
    /// Requests served on one connection.
    pub max_requests: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            request_timeout: Duration::from_secs(2),
            write_timeout: Duration::from_secs(2),
            max_requests: 1000,
        }
    }
}

/// Who the server is, for the hello and the credential check.
#[derive(Clone, Debug)]
pub struct Identity {
    /// Our effective uid.
    pub uid: u32,
    /// Our pid.
    pub pid: u32,
    /// Driver name.
    pub backend: String,
}

enum ReadError {
    /// The peer closed; `pending` bytes of an unfinished line had arrived.
    Closed {
        pending: usize,
    },
    Timeout,
    Proto(ProtoError),
    Io(io::Error),
}

/// Serve one connection until it ends. Never panics on anything the client sends.
pub fn serve_connection(stream: &UnixStream, host: &dyn Host, limits: &Limits, me: &Identity) {
    if let Err(e) = stream.set_write_timeout(Some(limits.write_timeout.max(MIN_TIMEOUT))) {
        tracing::debug!("control connection: setting the write timeout: {e}");
        return;
    }
    match authenticate(stream, me.uid) {
        Ok(client) => Session::new(client, host, limits, me).run(),
        Err(e) => {
            tracing::warn!("control connection refused: {e}");
            send(
                stream,
                &Reply::error(ErrorKind::PermissionDenied, e.to_string()),
            );
        }
    }
}

const MIN_TIMEOUT: Duration = Duration::from_millis(1);

fn send(stream: &UnixStream, reply: &Reply) -> bool {
    match sys::send_all(stream, &encode(reply)) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!("control connection: sending a reply: {e}");
            false
        }
    }
}

struct Session<'a> {
    client: AuthenticatedClient<'a>,
    host: &'a dyn Host,
    limits: &'a Limits,
    me: &'a Identity,
    lines: LineBuffer,
}

impl<'a> Session<'a> {
    fn new(
        client: AuthenticatedClient<'a>,
        host: &'a dyn Host,
        limits: &'a Limits,
        me: &'a Identity,
    ) -> Self {
        Session {
            client,
            host,
            limits,
            me,
            lines: LineBuffer::new(MAX_LINE_BYTES),
        }
    }

    fn reply(&self, r: &Reply) -> bool {
        send(self.client.stream(), r)
    }

    fn read_line(&mut self) -> Result<Vec<u8>, ReadError> {
        let deadline = Instant::now() + self.limits.request_timeout;
        let mut chunk = [0u8; 8192];
        let mut stream = self.client.stream();
        loop {
            match self.lines.next_line() {
                Some(Ok(l)) => return Ok(l),
                Some(Err(e)) => return Err(ReadError::Proto(e)),
                None => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ReadError::Timeout);
            }
            stream
                .set_read_timeout(Some(left.max(MIN_TIMEOUT)))
                .map_err(ReadError::Io)?;
            match stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(ReadError::Closed {
                        pending: self.lines.pending(),
                    })
                }
                Ok(n) => self.lines.push(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(ReadError::Timeout)
                }
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
    }

    /// The next request, or `None` when the connection is over (an error was replied where
    /// the client can still read it).
    fn next_request(&mut self) -> Option<Request> {
        let line = match self.read_line() {
            Ok(l) => l,
            Err(ReadError::Closed { pending: 0 }) => return None,
            Err(ReadError::Closed { pending }) => {
                tracing::debug!("control client left in the middle of a line ({pending} bytes)");
                self.reply(&Reply::error(
                    ErrorKind::BadRequest,
                    format!("connection closed in the middle of a line ({pending} bytes)"),
                ));
                return None;
            }
            Err(ReadError::Timeout) => {
                tracing::debug!("control client too slow");
                self.reply(&Reply::error(
                    ErrorKind::Timeout,
                    format!(
                        "no complete request line within {:.1} s; closing",
                        self.limits.request_timeout.as_secs_f64()
                    ),
                ));
                return None;
            }
            Err(ReadError::Proto(e)) => {
                self.reply(&e.to_reply());
                return None;
            }
            Err(ReadError::Io(e)) => {
                tracing::debug!("control connection: {e}");
                return None;
            }
        };
        match decode_request(&line) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::debug!("control client sent a bad request: {e}");
                self.reply(&e.to_reply());
                None
            }
        }
    }

    fn hello(&mut self) -> bool {
        let Some(req) = self.next_request() else {
            return false;
        };
        let reply = match req {
            Request::Hello(h) if h.protocol == PROTOCOL_VERSION => {
                tracing::debug!(
                    "control client pid {} ({}) connected",
                    self.client.cred().pid,
                    h.software
                );
                Reply::Hello(Hello {
                    protocol: PROTOCOL_VERSION,
                    pid: self.me.pid,
                    software: concat!("libtms ", env!("CARGO_PKG_VERSION")).to_string(),
                    backend: Some(self.me.backend.clone()),
                })
            }
            Request::Hello(h) => Reply::error(
                ErrorKind::VersionMismatch,
                format!(
                    "this process speaks control protocol {PROTOCOL_VERSION}, the client ({}) \
                     protocol {}: use the tmsctl that came with this libtms.so",
                    if h.software.is_empty() {
                        "unnamed"
                    } else {
                        &h.software
                    },
                    h.protocol
                ),
            ),
            _ => Reply::error(
                ErrorKind::HelloRequired,
                "the first message must be a hello",
            ),
        };
        let ok = !matches!(reply, Reply::Error(_));
        self.reply(&reply) && ok
    }

    fn run(mut self) {
        if !self.hello() {
            return;
        }
        for _ in 0..self.limits.max_requests {
            let Some(req) = self.next_request() else {
                return;
            };
            let host = self.host;
            let reply =
                catch_unwind(AssertUnwindSafe(|| dispatch(host, req))).unwrap_or_else(|_| {
                    tracing::error!("control request panicked (a bug in torch-memory-saver)");
                    Reply::error(
                        ErrorKind::Internal,
                        "internal error (a bug in torch-memory-saver); the process carries on",
                    )
                });
            let close = matches!(&reply, Reply::Error(e) if e.kind.closes_connection());
            if !self.reply(&reply) || close {
                return;
            }
        }
        tracing::debug!("control connection reached its request limit; closing");
    }
}
