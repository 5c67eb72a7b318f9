//! The control server under test: sessions over socket pairs, with an engine of their own on
//! the simulated device, and the accept loop over a real socket in a temporary folder. The
//! helpers shared by the tests are here; the tests are in one file per topic.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tms_proto::{
    decode_reply, encode, BackupBackend, ErrorKind, Hello, Op, RegionUpdate, Reply, Request,
    MAX_LINE_BYTES, PROTOCOL_VERSION,
};

use super::dispatch::Host;
use super::session::{Identity, Limits, Unwatched};
use super::*;
use crate::backup::BackupKind;
use crate::driver::sim::{SimConfig, SimDriver};
use crate::engine::AllocRequest;

struct TestHost {
    engine: Arc<Engine>,
    region: Mutex<RegionSettings>,
    /// Held by a test to make `get_region` (and `status`) wait: a request that takes long.
    gate: Mutex<()>,
    /// Requests that have reached the gate.
    at_gate: std::sync::atomic::AtomicUsize,
    /// Held by a test to make `set_region`'s write of the default region wait.
    write_gate: Mutex<()>,
    /// Writes of the default region that have reached `write_gate`.
    at_write_gate: std::sync::atomic::AtomicUsize,
}

fn host() -> &'static TestHost {
    host_over(SimDriver::new(SimConfig::default()).unwrap())
}

fn host_over(d: SimDriver) -> &'static TestHost {
    host_over_shared(Arc::new(d))
}

/// [`host_over`] a simulated device the test keeps a hand on (to hold or fail its calls).
fn host_over_shared(d: Arc<SimDriver>) -> &'static TestHost {
    Box::leak(Box::new(TestHost {
        engine: Arc::new(Engine::new(d)),
        region: Mutex::new(RegionSettings {
            enabled: false,
            tag: "default".into(),
            cpu_backup: false,
            backend: BackupKind::Pinned,
            disk_backup: false,
            chunk: 0,
        }),
        gate: Mutex::new(()),
        at_gate: Default::default(),
        write_gate: Mutex::new(()),
        at_write_gate: Default::default(),
    }))
}

impl TestHost {
    /// A pauseable allocation of `size` bytes on device 0, not chunked.
    fn alloc(&self, size: u64, tag: &str, backup: Option<BackupKind>) -> crate::driver::DevPtr {
        self.engine
            .alloc(&AllocRequest {
                size,
                device: 0,
                tag: tag.into(),
                backup,
                chunk: 0,
            })
            .unwrap()
    }
}

impl Host for TestHost {
    fn engine(&self) -> &Engine {
        &self.engine
    }
    fn resume_nonblocking(&self, tag: Option<&str>, label: u64) -> Result<crate::engine::OpReport> {
        Engine::resume_nonblocking_labeled(self.engine.clone(), tag, &[], None, Some(label))
    }
    fn default_region(&self) -> Result<RegionSettings> {
        self.at_gate
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        drop(self.gate.lock());
        Ok(self.region.lock().clone())
    }
    fn set_default_region(&self, r: RegionSettings) {
        self.at_write_gate
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        drop(self.write_gate.lock());
        *self.region.lock() = r;
    }
}

fn limits() -> Limits {
    Limits {
        request_timeout: Duration::from_millis(300),
        write_timeout: Duration::from_millis(300),
        max_requests: 50,
        max_idle_total: Duration::from_secs(10),
        max_connections: 64,
        max_write_total: Duration::from_secs(10),
    }
}

fn me() -> Identity {
    Identity {
        uid: sys::euid(),
        pid: std::process::id(),
        backend: "sim".into(),
    }
}

/// A client end, with the server end served on a thread.
struct Conn {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    server: Option<std::thread::JoinHandle<()>>,
}

impl Conn {
    fn open(h: &'static TestHost, l: Limits) -> Conn {
        let (client, server) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            session::serve_connection(&server, h, &l, &me(), &Unwatched)
        });
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        Conn {
            reader: BufReader::new(client.try_clone().unwrap()),
            stream: client,
            server: Some(t),
        }
    }

    fn greeted(h: &'static TestHost) -> Conn {
        Conn::greeted_with(h, limits())
    }

    /// A connection under limits `l`, its hello answered as this server's.
    fn greeted_with(h: &'static TestHost, l: Limits) -> Conn {
        let mut c = Conn::open(h, l);
        match c.ask(&Request::Hello(hello(PROTOCOL_VERSION))) {
            Reply::Hello(h) => {
                assert_eq!(h.protocol, PROTOCOL_VERSION);
                assert_eq!(h.pid, std::process::id());
                assert_eq!(h.backend.as_deref(), Some("sim"));
            }
            other => panic!("{other:?}"),
        }
        c
    }

    fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    fn read_reply(&mut self) -> Reply {
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        decode_reply(line.as_bytes()).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    }

    fn ask(&mut self, r: &Request) -> Reply {
        self.send_raw(&encode(r));
        self.read_reply()
    }

    /// The server ended the connection: EOF on our side, and its thread returned.
    fn assert_closed(mut self) {
        let mut rest = Vec::new();
        self.reader.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "{:?}", String::from_utf8_lossy(&rest));
        self.server.take().unwrap().join().unwrap();
    }
}

fn hello(protocol: u32) -> Hello {
    Hello {
        protocol,
        pid: std::process::id(),
        software: "test".into(),
        backend: None,
        features: Vec::new(),
    }
}

/// A pause of a whole tag (every tag if `None`).
fn pause(tag: Option<String>) -> Request {
    Request::Pause {
        tag,
        chunks: None,
        chunk_state: false,
        job_record: false,
    }
}

/// A resume of a whole tag (every tag if `None`).
fn resume(tag: Option<String>) -> Request {
    Request::Resume {
        tag,
        chunks: None,
        chunk_state: false,
        job_record: false,
        no_wait: false,
        verify: false,
    }
}

/// A resume of `tag` that returns before the data lands.
fn resume_no_wait(tag: &str) -> Request {
    Request::Resume {
        tag: Some(tag.into()),
        chunks: None,
        chunk_state: false,
        job_record: false,
        no_wait: true,
        verify: false,
    }
}

/// `n` allocations of 2 MiB in the tag "nw", backed up in pinned memory, over a simulated
/// driver the test keeps (to hold and fault its calls), paused over a connection.
fn paused_nw(n: usize) -> (Arc<SimDriver>, &'static TestHost, Conn) {
    let sim = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
    let h = host_over_shared(sim.clone());
    for _ in 0..n {
        h.alloc(2 << 20, "nw", Some(BackupKind::Pinned));
    }
    let mut c = Conn::greeted(h);
    done(c.ask(&pause(Some("nw".into()))));
    (sim, h, c)
}

fn done(r: Reply) -> tms_proto::OpDone {
    match r {
        Reply::Done(d) => d,
        other => panic!("{other:?}"),
    }
}

fn error_kind(r: &Reply) -> ErrorKind {
    match r {
        Reply::Error(e) => e.kind,
        other => panic!("expected an error reply, got {other:?}"),
    }
}

// --- the server over a real socket ------------------------------------------------------------

/// A server in a fresh folder, as `start` runs it (stale sockets cleaned first), under the
/// name `name`; returns the folder and the socket's path.
fn server_in(
    h: &'static TestHost,
    test: &str,
    name: &str,
    l: Limits,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let base = std::env::temp_dir().join(format!("tms-srv-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    start_in(h, &base, name, l)
}

fn start_in(
    h: &'static TestHost,
    base: &Path,
    name: &str,
    l: Limits,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let (listener, path) = listen_in(base, sys::euid(), name).unwrap();
    let folder = base.to_path_buf();
    let ours = name.to_string();
    std::thread::spawn(move || run(&listener, &folder, &ours, h, l, me()));
    (base.to_path_buf(), path)
}

/// A client over the real socket.
struct Client {
    w: UnixStream,
    r: BufReader<UnixStream>,
}

impl Client {
    fn connect(path: &Path) -> Client {
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Client {
            r: BufReader::new(s.try_clone().unwrap()),
            w: s,
        }
    }

    /// The next reply; `None` at end of file (or a reset connection).
    fn reply(&mut self) -> Option<Reply> {
        let mut l = String::new();
        match self.r.read_line(&mut l) {
            Ok(0) => None,
            Ok(_) => Some(decode_reply(l.as_bytes()).unwrap_or_else(|e| panic!("{e}: {l:?}"))),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => None,
            Err(e) => panic!("{e}"),
        }
    }

    /// Send `r` and read its reply; `None` when the server closed the connection instead.
    fn ask(&mut self, r: &Request) -> Option<Reply> {
        if self.w.write_all(&encode(r)).is_err() {
            return None;
        }
        self.reply()
    }

    fn greeted(path: &Path) -> Client {
        let mut c = Client::connect(path);
        let r = c.ask(&Request::Hello(hello(PROTOCOL_VERSION)));
        assert!(matches!(r, Some(Reply::Hello(_))), "{r:?}");
        c
    }

    fn assert_closed(mut self) {
        let mut rest = Vec::new();
        let _ = self.r.read_to_end(&mut rest);
        assert!(rest.is_empty(), "{:?}", String::from_utf8_lossy(&rest));
    }
}

/// Connect, say hello, ping: how long it took.
fn fresh_ping(path: &Path) -> Duration {
    let t = Instant::now();
    let mut c = Client::greeted(path);
    let r = c.ask(&Request::Ping);
    assert!(matches!(r, Some(Reply::Pong { .. })), "{r:?}");
    t.elapsed()
}

/// Runs `test` alone in a child process (this test binary, `--exact`), with `TMS_TEST_CHILD`
/// set: for what changes process-wide state, such as the umask, that parallel tests would see.
fn in_child(test: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--test-threads=1", "--nocapture"])
        .env("TMS_TEST_CHILD", "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
}

mod chunks;
mod requests;
mod server;
mod status;
