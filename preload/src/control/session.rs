//! One connection: hello, then requests and replies, under time and size limits.
//!
//! Each connection has a thread of its own (see Note [The control server]), and whatever the
//! client does, it must not keep that thread and its place among the server's connections for
//! long: every request line must arrive whole within [`Limits::request_timeout`] of the
//! previous reply (this bounds idle clients and clients that dribble bytes alike), every reply
//! must be taken within [`Limits::write_timeout`], and a connection serves at most
//! [`Limits::max_requests`] requests, waits for them [`Limits::max_idle_total`] in all and for
//! its replies to be taken [`Limits::max_write_total`] in all.
//! Anything unacceptable gets an error reply (best effort) and the connection is closed;
//! nothing a client sends can make this code panic, and the dispatch of a request runs inside
//! `catch_unwind` regardless.
//!
//! The session tells the server's connection table when it waits for a request and when it
//! serves one ([`Watch`]): a connection that waits may be closed to make room for a newer one,
//! and then it gets a [`ErrorKind::Busy`] reply instead of its next answer.

use std::io;
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use tms_proto::{
    decode_request, encode, ErrorKind, Hello, LineBuffer, ProtoError, ReadFault, Reply, Request,
    FEATURE_CHUNKS, FEATURE_JOB_RECORD, FEATURE_NO_WAIT, FEATURE_OPERATIONS, FEATURE_PROGRESS,
    FEATURE_VERIFY, MAX_LINE_BYTES, PROTOCOL_VERSION,
};

use super::auth::{authenticate, AuthenticatedClient};
use super::dispatch::{dispatch, Host};
use super::sys;

/// Time and count limits of the connections.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Time for a whole request line to arrive, counted from the previous reply.
    pub request_timeout: Duration,
    /// Time for a reply to be taken by the client.
    pub write_timeout: Duration,
    /// Requests served on one connection.
    pub max_requests: usize,
    /// Time one connection may spend waiting for request lines, in all: a client that sends a
    /// request just before each [`request_timeout`](Limits::request_timeout) runs out is closed
    /// after this long (the time its requests take to serve does not count).
    pub max_idle_total: Duration,
    /// Connections served at once (one thread each); see Note [The control server] for what
    /// happens to one more.
    pub max_connections: usize,
    /// Time one connection may spend waiting for its replies to be taken, in all: a client that
    /// sends its requests at once and takes each reply just before the
    /// [`write_timeout`](Limits::write_timeout) runs out would otherwise hold its thread for
    /// [`max_requests`](Limits::max_requests) times that.
    pub max_write_total: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            request_timeout: Duration::from_secs(2),
            write_timeout: Duration::from_secs(2),
            max_requests: 1000,
            max_idle_total: Duration::from_secs(10),
            max_connections: 64,
            max_write_total: Duration::from_secs(10),
        }
    }
}

/// What the session tells the server's connection table, and learns from it.
pub trait Watch {
    /// The session waits for a request line (the hello, or the next request).
    fn idle(&self);
    /// A whole request arrived and is about to be served; `false` when the connection has
    /// been closed to make room for another (the request is then not served).
    fn working(&self) -> bool;
    /// The connection has been closed to make room for another.
    fn evicted(&self) -> bool;
}

/// A connection outside any table (never closed to make room).
pub struct Unwatched;

impl Watch for Unwatched {
    fn idle(&self) {}
    fn working(&self) -> bool {
        true
    }
    fn evicted(&self) -> bool {
        false
    }
}

/// The reply to a connection closed to make room for a newer one; `greeted`: it had sent its
/// hello. One that had not is closed first, however briefly it waited ([`super::conns::Table`]),
/// so its reply must not say it waited longest.
pub fn evicted_reply(max: usize, greeted: bool) -> Reply {
    let why = if greeted {
        format!(" waited longest of the {max} this process serves at once")
    } else {
        format!(", one of the {max} this process serves at once, had not sent its hello yet")
    };
    Reply::error(
        ErrorKind::Busy,
        format!("this connection{why}, and was closed to make room for a new one; connect again"),
    )
}

/// The reply to a connection the server has no room for.
pub fn busy_reply(why: &str) -> Reply {
    Reply::error(
        ErrorKind::Busy,
        format!("the process cannot take this control connection now: {why}; try again"),
    )
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
    /// The connection used up [`Limits::max_idle_total`].
    IdleBudget,
    Proto(ProtoError),
    Io(io::Error),
}

/// Serve one connection until it ends. Never panics on anything the client sends.
pub fn serve_connection(
    stream: &UnixStream,
    host: &dyn Host,
    limits: &Limits,
    me: &Identity,
    watch: &dyn Watch,
) {
    match authenticate(stream, me.uid) {
        Ok(client) => Session::new(client, host, limits, me, watch).run(),
        Err(e) => {
            tracing::warn!("control connection refused: {e}");
            send(
                stream,
                &Reply::error(ErrorKind::PermissionDenied, e.to_string()),
                limits.write_timeout,
            );
        }
    }
}

const MIN_TIMEOUT: Duration = Duration::from_millis(1);

fn send(stream: &UnixStream, reply: &Reply, within: Duration) -> bool {
    match sys::send_all(stream, &encode(reply), within.max(MIN_TIMEOUT)) {
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
    watch: &'a dyn Watch,
    lines: LineBuffer,
    /// A line (the hello) has arrived and was taken, as the connection table counts it.
    greeted: bool,
    /// Time spent waiting for request lines so far.
    idle: Duration,
    /// Time spent sending replies so far.
    writing: Duration,
}

impl<'a> Session<'a> {
    fn new(
        client: AuthenticatedClient<'a>,
        host: &'a dyn Host,
        limits: &'a Limits,
        me: &'a Identity,
        watch: &'a dyn Watch,
    ) -> Self {
        Session {
            client,
            host,
            limits,
            me,
            watch,
            lines: LineBuffer::new(MAX_LINE_BYTES),
            greeted: false,
            idle: Duration::ZERO,
            writing: Duration::ZERO,
        }
    }

    /// Send `r` within the write timeout and what is left of the connection's time for
    /// writing; `false` if it was not taken (the connection is then over).
    fn reply(&mut self, r: &Reply) -> bool {
        let left = self.limits.max_write_total.saturating_sub(self.writing);
        if left.is_zero() {
            tracing::debug!("control client took its replies too slowly, in all; closing");
            return false;
        }
        let t0 = Instant::now();
        let sent = send(self.client.stream(), r, left.min(self.limits.write_timeout));
        self.writing += t0.elapsed();
        sent
    }

    fn read_line(&mut self) -> Result<Vec<u8>, ReadError> {
        let t0 = Instant::now();
        let r = self.read_line_by(t0);
        self.idle += t0.elapsed();
        r
    }

    fn read_line_by(&mut self, t0: Instant) -> Result<Vec<u8>, ReadError> {
        let budget = self.limits.max_idle_total.saturating_sub(self.idle);
        let by_budget = budget < self.limits.request_timeout;
        let deadline = t0 + budget.min(self.limits.request_timeout);
        let left =
            || Some(deadline.saturating_duration_since(Instant::now())).filter(|l| !l.is_zero());
        self.lines
            .read_line(self.client.stream(), left)
            .map_err(|fault| match fault {
                ReadFault::TooLong(e) => ReadError::Proto(e),
                ReadFault::Closed { pending } => ReadError::Closed { pending },
                ReadFault::Expired | ReadFault::Quiet if by_budget => ReadError::IdleBudget,
                ReadFault::Expired | ReadFault::Quiet => ReadError::Timeout,
                ReadFault::Io(e) => ReadError::Io(e),
            })
    }

    /// The notice to a connection closed to make room: sent without waiting, since the
    /// client may not be reading.
    fn evicted(&self) -> Option<Request> {
        tracing::debug!("control connection closed to make room for a newer one");
        let _ = sys::send_now(
            self.client.stream(),
            &encode(&evicted_reply(self.limits.max_connections, self.greeted)),
        );
        None
    }

    /// The next request, or `None` when the connection is over (an error was replied where
    /// the client can still read it).
    fn next_request(&mut self) -> Option<Request> {
        self.watch.idle();
        let line = match self.read_line() {
            Ok(l) => l,
            Err(_) if self.watch.evicted() => return self.evicted(),
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
            Err(ReadError::IdleBudget) => {
                tracing::debug!("control client used up its waiting time");
                self.reply(&Reply::error(
                    ErrorKind::Timeout,
                    format!(
                        "this connection has waited {:.1} s for requests in all, the most one \
                         may; closing (connect again)",
                        self.limits.max_idle_total.as_secs_f64()
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
        if !self.watch.working() {
            return self.evicted();
        }
        self.greeted = true;
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
                    features: vec![
                        FEATURE_CHUNKS.to_string(),
                        FEATURE_OPERATIONS.to_string(),
                        FEATURE_PROGRESS.to_string(),
                        FEATURE_NO_WAIT.to_string(),
                        FEATURE_JOB_RECORD.to_string(),
                        FEATURE_VERIFY.to_string(),
                    ],
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
        // One more request gets a reply saying why, rather than a close the client must guess
        // at (the wait for it is the usual, bounded one).
        if self.next_request().is_some() {
            self.reply(&Reply::error(
                ErrorKind::Busy,
                format!(
                    "this connection has served {} requests, the most one may; closing \
                     (connect again)",
                    self.limits.max_requests
                ),
            ));
        }
    }
}
