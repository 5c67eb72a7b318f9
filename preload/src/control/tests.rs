//! The server's sessions over socket pairs, with an engine of their own on the simulated
//! device, and the accept loop over a real socket in a temporary folder.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
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
    engine: Engine,
    region: Mutex<RegionSettings>,
    /// Held by a test to make `get_region` (and `status`) wait: a request that takes long.
    gate: Mutex<()>,
    /// Requests that have reached the gate.
    at_gate: std::sync::atomic::AtomicUsize,
}

fn host() -> &'static TestHost {
    host_over(SimDriver::new(SimConfig::default()).unwrap())
}

fn host_over(d: SimDriver) -> &'static TestHost {
    Box::leak(Box::new(TestHost {
        engine: Engine::new(Arc::new(d)),
        region: Mutex::new(RegionSettings {
            enabled: false,
            tag: "default".into(),
            cpu_backup: false,
            backend: BackupKind::Pinned,
            backend_named: false,
            disk_backup: false,
            chunk: 0,
        }),
        gate: Mutex::new(()),
        at_gate: Default::default(),
    }))
}

impl Host for TestHost {
    fn engine(&self) -> &Engine {
        &self.engine
    }
    fn default_region(&self) -> Result<RegionSettings> {
        self.at_gate
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        drop(self.gate.lock());
        Ok(self.region.lock().clone())
    }
    fn set_default_region(&self, r: RegionSettings) {
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
        let mut c = Conn::open(h, limits());
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
    }
}

/// A resume of a whole tag (every tag if `None`).
fn resume(tag: Option<String>) -> Request {
    Request::Resume {
        tag,
        chunks: None,
        chunk_state: false,
    }
}

fn error_kind(r: &Reply) -> ErrorKind {
    match r {
        Reply::Error(e) => e.kind,
        other => panic!("expected an error reply, got {other:?}"),
    }
}

#[test]
fn every_operation_over_a_connection() {
    let h = host();
    let ptr = h
        .engine
        .alloc(&AllocRequest {
            size: 3 << 20,
            device: 0,
            tag: "kv".into(),
            backup: Some(BackupKind::Mmap),
            chunk: 0,
        })
        .unwrap();
    h.engine.write_bytes(ptr, b"contents").unwrap();
    let mut c = Conn::greeted(h);
    assert_eq!(
        c.ask(&Request::Ping),
        Reply::Pong {
            pid: std::process::id()
        }
    );
    let Reply::Status(s) = c.ask(&Request::Status) else {
        panic!()
    };
    assert_eq!(s.backend, "sim");
    assert_eq!(s.tags.len(), 1);
    assert_eq!(s.bytes_active(), 4 << 20);
    assert_eq!(s.devices.len(), 1);
    let free_before = s.devices[0].free_bytes;

    let Reply::Done(d) = c.ask(&pause(Some("kv".into()))) else {
        panic!()
    };
    assert_eq!((d.op, d.allocations, d.bytes), (Op::Pause, 1, 4 << 20));
    assert_eq!(d.copied_bytes, 3 << 20);
    let Reply::Status(s) = c.ask(&Request::Status) else {
        panic!()
    };
    assert_eq!((s.bytes_active(), s.bytes_paused()), (0, 4 << 20));
    assert_eq!(s.devices[0].free_bytes, free_before + (4 << 20));
    assert!(s.tags[0].last_pause.is_some());

    // Pausing again is a no-op; resuming every tag brings it back.
    let Reply::Done(d) = c.ask(&pause(None)) else {
        panic!()
    };
    assert_eq!(d.allocations, 0);
    let Reply::Done(d) = c.ask(&resume(None)) else {
        panic!()
    };
    assert_eq!((d.op, d.allocations), (Op::Resume, 1));
    let mut back = [0u8; 8];
    h.engine.read_bytes(ptr, &mut back).unwrap();
    assert_eq!(&back, b"contents");

    // The default region.
    let Reply::Region(r) = c.ask(&Request::GetRegion) else {
        panic!()
    };
    assert!(!r.enabled);
    let Reply::Region(r) = c.ask(&Request::SetRegion(RegionUpdate {
        enabled: Some(true),
        tag: Some("weights".into()),
        cpu_backup: Some(true),
        backend: Some(BackupBackend::Mmap),
        ..Default::default()
    })) else {
        panic!()
    };
    assert!(r.enabled && r.cpu_backup && r.tag == "weights");
    assert_eq!(r.backend, BackupBackend::Mmap);
    assert_eq!(h.region.lock().backend, BackupKind::Mmap);
    let Reply::Status(s) = c.ask(&Request::Status) else {
        panic!()
    };
    assert_eq!(s.default_region.unwrap().tag, "weights");

    // Failed operations are replied to and the connection stays open.
    let r = c.ask(&pause(Some(String::new())));
    assert_eq!(error_kind(&r), ErrorKind::InvalidArgument);
    let r = c.ask(&Request::SetRegion(RegionUpdate {
        cpu_backup: Some(false),
        backend: Some(BackupBackend::Pinned),
        ..Default::default()
    }));
    assert_eq!(error_kind(&r), ErrorKind::InvalidArgument);
    assert_eq!(
        h.region.lock().tag,
        "weights",
        "a refused update changes nothing"
    );
    let r = c.ask(&Request::SetRegion(RegionUpdate {
        tag: Some(String::new()),
        ..Default::default()
    }));
    assert_eq!(error_kind(&r), ErrorKind::InvalidArgument);
    assert!(matches!(c.ask(&Request::Ping), Reply::Pong { .. }));

    // A second hello is a protocol error: reply, then close.
    let r = c.ask(&Request::Hello(hello(PROTOCOL_VERSION)));
    assert_eq!(error_kind(&r), ErrorKind::BadRequest);
    c.assert_closed();
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let h = host();
    let mut c = Conn::open(h, limits());
    let mut all = encode(&Request::Hello(hello(PROTOCOL_VERSION)));
    for _ in 0..5 {
        all.extend(encode(&Request::Ping));
    }
    all.extend(encode(&Request::GetRegion));
    c.send_raw(&all);
    assert!(matches!(c.read_reply(), Reply::Hello(_)));
    for _ in 0..5 {
        assert!(matches!(c.read_reply(), Reply::Pong { .. }));
    }
    assert!(matches!(c.read_reply(), Reply::Region(_)));
    drop(c.stream.shutdown(std::net::Shutdown::Write));
    c.assert_closed();
}

#[test]
fn hello_is_required_and_versioned() {
    let h = host();
    let mut c = Conn::open(h, limits());
    assert_eq!(
        error_kind(&c.ask(&Request::Status)),
        ErrorKind::HelloRequired
    );
    c.assert_closed();

    let mut c = Conn::open(h, limits());
    let r = c.ask(&Request::Hello(hello(PROTOCOL_VERSION + 1)));
    assert_eq!(error_kind(&r), ErrorKind::VersionMismatch);
    let Reply::Error(e) = r else { panic!() };
    assert!(e.message.contains("tmsctl"), "{}", e.message);
    c.assert_closed();
}

#[test]
fn garbage_gets_an_error_reply_and_a_close() {
    let h = host();
    for bad in [
        &b"garbage\n"[..],
        b"\n",
        b"{\"op\":\"format_disk\"}\n",
        b"{\"op\":\"pause\",\"tga\":\"kv\"}\n",
        b"\xff\xfe\x00\x01\n",
        b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\n",
    ] {
        // Before and after the hello.
        let mut c = Conn::open(h, limits());
        c.send_raw(bad);
        assert_eq!(
            error_kind(&c.read_reply()),
            ErrorKind::BadRequest,
            "{bad:?}"
        );
        c.assert_closed();
        let mut c = Conn::greeted(h);
        c.send_raw(bad);
        assert_eq!(
            error_kind(&c.read_reply()),
            ErrorKind::BadRequest,
            "{bad:?}"
        );
        c.assert_closed();
    }
}

#[test]
fn oversized_lines_are_refused_without_reading_them_all() {
    let h = host();
    let mut c = Conn::greeted(h);
    // More than the limit, no newline: the server answers as soon as the limit is passed.
    let big = vec![b'x'; MAX_LINE_BYTES + 1];
    c.send_raw(&big);
    assert_eq!(error_kind(&c.read_reply()), ErrorKind::LineTooLong);
    c.assert_closed();
}

#[test]
fn half_lines_slow_clients_and_silence_time_out() {
    let h = host();
    // Half a line, then the client closes its side.
    let mut c = Conn::greeted(h);
    c.send_raw(b"{\"op\":\"sta");
    c.stream.shutdown(std::net::Shutdown::Write).unwrap();
    let r = c.read_reply();
    assert_eq!(error_kind(&r), ErrorKind::BadRequest);
    c.assert_closed();

    // Half a line, then nothing: a timeout within the limit.
    let mut c = Conn::greeted(h);
    let t = Instant::now();
    c.send_raw(b"{\"op\":\"sta");
    assert_eq!(error_kind(&c.read_reply()), ErrorKind::Timeout);
    assert!(t.elapsed() < Duration::from_secs(3));
    c.assert_closed();

    // A client dribbling a byte at a time still has to finish within the limit.
    let mut c = Conn::greeted(h);
    let t = Instant::now();
    for b in b"{\"op\":\"status\"}" {
        // 16 bytes at 40 ms each would take 640 ms: the server gives up at 300 ms (and our
        // writes start failing once it has closed).
        if c.stream.write_all(&[*b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(40));
    }
    assert!(
        t.elapsed() >= Duration::from_millis(280),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(error_kind(&c.read_reply()), ErrorKind::Timeout);
    c.assert_closed();

    // Saying nothing at all, not even hello.
    let mut c = Conn::open(h, limits());
    assert_eq!(error_kind(&c.read_reply()), ErrorKind::Timeout);
    c.assert_closed();
}

#[test]
fn abrupt_disconnects_end_the_session_quietly() {
    let h = host();
    // Ask and vanish before the reply.
    let mut c = Conn::greeted(h);
    c.send_raw(&encode(&Request::Status));
    let Conn {
        stream,
        reader,
        server,
    } = c;
    drop(stream);
    drop(reader);
    server.unwrap().join().unwrap();
    // Vanish before the hello.
    let c = Conn::open(h, limits());
    let Conn {
        stream,
        reader,
        server,
    } = c;
    drop(stream);
    drop(reader);
    server.unwrap().join().unwrap();
}

#[test]
fn the_request_limit_ends_a_connection() {
    let h = host();
    let mut c = Conn::open(
        h,
        Limits {
            max_requests: 3,
            ..limits()
        },
    );
    assert!(matches!(
        c.ask(&Request::Hello(hello(PROTOCOL_VERSION))),
        Reply::Hello(_)
    ));
    for _ in 0..3 {
        assert!(matches!(c.ask(&Request::Ping), Reply::Pong { .. }));
    }
    c.assert_closed();
}

#[test]
fn the_accept_loop_serves_one_client_after_another() {
    let h = host();
    let base = std::env::temp_dir().join(format!("tms-serve-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    dir::prepare(&base, sys::euid()).unwrap();
    let (listener, path) = dir::bind(&base, 4_000_001).unwrap();
    std::thread::spawn(move || serve(&listener, h, limits(), me()));

    // A silent client holds the thread only until its timeout.
    let _silent = UnixStream::connect(&path).unwrap();
    let t = Instant::now();
    for _ in 0..3 {
        let s = UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut w = s;
        w.write_all(&encode(&Request::Hello(hello(PROTOCOL_VERSION))))
            .unwrap();
        w.write_all(&encode(&Request::Ping)).unwrap();
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        assert!(
            matches!(decode_reply(l.as_bytes()), Ok(Reply::Hello(_))),
            "{l}"
        );
        l.clear();
        r.read_line(&mut l).unwrap();
        assert!(
            matches!(decode_reply(l.as_bytes()), Ok(Reply::Pong { .. })),
            "{l}"
        );
    }
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    std::fs::remove_dir_all(&base).unwrap();
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
    dir::prepare(base, sys::euid()).unwrap();
    let (listener, path) = dir::bind_as(base, name).unwrap();
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

use std::path::Path;

#[test]
fn idle_connections_and_a_slow_client_never_delay_a_newcomer() {
    // The production limits: 2 s per request line, 64 connections at once.
    let h = host();
    let (base, path) = server_in(h, "flood", "4000100.1.sock", Limits::default());

    // A slow client: a ping every 1.5 s, each within the 2 s allowed (on a single server
    // thread it held every other client off for as long as it went on).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let slow = {
        let (path, stop) = (path.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut c = Client::greeted(&path);
            let mut pongs = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1500));
                match c.ask(&Request::Ping) {
                    Some(Reply::Pong { .. }) => pongs += 1,
                    _ => break,
                }
            }
            pongs
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    // 200 connections that say nothing (on a single thread: 2 s each, 400 s in all).
    let idle: Vec<UnixStream> = (0..200)
        .map(|_| UnixStream::connect(&path).unwrap())
        .collect();

    // Newcomers over the next 4 s (while the idle ones are open, as they time out, after):
    // each is answered at once.
    let mut worst = Duration::ZERO;
    for _ in 0..8 {
        worst = worst.max(fresh_ping(&path));
        std::thread::sleep(Duration::from_millis(500));
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let pongs = slow.join().unwrap();
    assert!(
        worst < Duration::from_secs(1),
        "a newcomer waited {worst:?}"
    );
    // The slow client itself was served all along: the idle ones (no hello) gave way first.
    assert!(pongs >= 2, "{pongs} pongs");
    drop(idle);
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_full_server_answers_busy_and_idle_connections_make_room() {
    let h = host();
    let l = Limits {
        max_connections: 2,
        request_timeout: Duration::from_secs(5),
        write_timeout: Duration::from_secs(5),
        ..limits()
    };
    let (base, path) = server_in(h, "cap", "4000101.1.sock", l);

    // Two connections serving requests that take long (get_region waits for the gate).
    let gate = h.gate.lock();
    let mut a = Client::greeted(&path);
    let mut b = Client::greeted(&path);
    a.w.write_all(&encode(&Request::GetRegion)).unwrap();
    b.w.write_all(&encode(&Request::GetRegion)).unwrap();
    let t = Instant::now();
    while h.at_gate.load(std::sync::atomic::Ordering::SeqCst) < 2 {
        assert!(t.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(5));
    }

    // A third is refused at once with `busy`, and closed.
    let t = Instant::now();
    let mut c = Client::connect(&path);
    let r = c.reply().expect("a busy reply");
    assert_eq!(error_kind(&r), ErrorKind::Busy);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(ErrorKind::Busy.closes_connection());
    c.assert_closed();

    // Both requests complete; a and b wait again, a longer (b has just had a ping served).
    drop(gate);
    assert!(matches!(a.reply(), Some(Reply::Region(_))));
    assert!(matches!(b.reply(), Some(Reply::Region(_))));
    std::thread::sleep(Duration::from_millis(50));
    assert!(matches!(b.ask(&Request::Ping), Some(Reply::Pong { .. })));

    // A newcomer that has not said hello yet (e) makes room by closing the idle connection
    // that waited longest (a), which gets `busy`; b is still served.
    let mut e = Client::connect(&path);
    let r = a.reply().expect("a busy reply");
    assert_eq!(error_kind(&r), ErrorKind::Busy, "{r:?}");
    a.assert_closed();

    // Now b (greeted) and e (not yet): the next newcomer closes e, the one without a hello,
    // although b has waited longer.
    let t = Instant::now();
    let took = fresh_ping(&path);
    assert!(took < Duration::from_secs(1), "{took:?}");
    let r = e.reply().expect("a busy reply");
    assert_eq!(error_kind(&r), ErrorKind::Busy);
    e.assert_closed();
    assert!(matches!(b.ask(&Request::Ping), Some(Reply::Pong { .. })));
    assert!(t.elapsed() < Duration::from_secs(2));
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_drip_feeding_client_is_closed_after_its_waiting_time() {
    let h = host();
    let mut c = Conn::open(
        h,
        Limits {
            max_idle_total: Duration::from_millis(700),
            ..limits()
        },
    );
    assert!(matches!(
        c.ask(&Request::Hello(hello(PROTOCOL_VERSION))),
        Reply::Hello(_)
    ));
    // Each ping comes within the 300 ms per request, but they add up.
    let t = Instant::now();
    let mut pongs = 0;
    let last = loop {
        std::thread::sleep(Duration::from_millis(200));
        // The server may have given up already: its reply is there to read all the same.
        let _ = c.stream.write_all(&encode(&Request::Ping));
        match c.read_reply() {
            Reply::Pong { .. } => pongs += 1,
            other => break other,
        }
        assert!(pongs < 10, "still open after {pongs} pings");
    };
    assert_eq!(error_kind(&last), ErrorKind::Timeout);
    let Reply::Error(e) = last else { panic!() };
    assert!(e.message.contains("in all"), "{}", e.message);
    assert!((2..=4).contains(&pongs), "{pongs} pongs");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    c.assert_closed();
}

#[test]
fn concurrent_pauses_from_several_clients_are_safe() {
    let h = host();
    let mut ptrs = Vec::new();
    for i in 0..4u8 {
        let p = h
            .engine
            .alloc(&AllocRequest {
                size: 1 << 20,
                device: 0,
                tag: "kv".into(),
                backup: Some(BackupKind::Mmap),
                chunk: 0,
            })
            .unwrap();
        h.engine.write_bytes(p, &[i; 64]).unwrap();
        ptrs.push(p);
    }
    let (base, path) = server_in(h, "concurrent", "4000102.1.sock", limits());
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let path = path.clone();
            std::thread::spawn(move || {
                let mut c = Client::greeted(&path);
                for _ in 0..5 {
                    for r in [pause(Some("kv".into())), resume(None)] {
                        let reply = c.ask(&r);
                        assert!(matches!(reply, Some(Reply::Done(_))), "{reply:?}");
                    }
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    let s = h.engine.stats();
    assert_eq!(s.tags.len(), 1);
    assert_eq!(s.tags[0].active_allocations, 4);
    for (i, p) in ptrs.iter().enumerate() {
        let mut back = [0u8; 64];
        h.engine.read_bytes(*p, &mut back).unwrap();
        assert_eq!(back, [i as u8; 64]);
    }
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_starting_server_removes_only_sockets_nobody_listens_on() {
    let h = host();
    let base = std::env::temp_dir().join(format!("tms-srv-{}-stale", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    dir::prepare(&base, sys::euid()).unwrap();
    // A live server of another pid namespace sharing the folder: the pid in its name does not
    // exist in ours (kill(pid, 0) said "dead" and its socket was removed).
    let (_live, live) = dir::bind_as(&base, "2147483000.4026530000.sock").unwrap();
    // Nobody listens on this one, though its pid (1) exists here: it goes.
    let (l, dead) = dir::bind_as(&base, "1.4026530001.sock").unwrap();
    drop(l);
    let (_, path) = start_in(h, &base, "4000103.1.sock", limits());
    // Served once the cleaning is over (it runs first on the server thread).
    assert!(fresh_ping(&path) < Duration::from_secs(2));
    assert!(live.exists(), "a live listener's socket was removed");
    assert!(!dead.exists(), "a socket nobody listens on was kept");
    assert!(path.exists());
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn pausing_a_tag_no_allocation_ever_had_is_flagged() {
    let h = host();
    let ptr = h
        .engine
        .alloc(&AllocRequest {
            size: 1 << 20,
            device: 0,
            tag: "kv".into(),
            backup: None,
            chunk: 0,
        })
        .unwrap();
    assert!(h.engine.tag_known("kv") && !h.engine.tag_known("vk"));
    let mut c = Conn::greeted(h);
    let mut done = |r: Request| match c.ask(&r) {
        Reply::Done(d) => d,
        other => panic!("{other:?}"),
    };
    let d = done(pause(Some("kv".into())));
    assert_eq!((d.allocations, d.unknown_tag), (1, false));
    // A typo: nothing changes, and the reply says why.
    let d = done(pause(Some("kvv".into())));
    assert_eq!((d.allocations, d.unknown_tag), (0, true));
    let d = done(resume(Some("kvv".into())));
    assert_eq!((d.allocations, d.unknown_tag), (0, true));
    // Every tag: no flag.
    let d = done(resume(None));
    assert_eq!((d.allocations, d.unknown_tag), (1, false));
    // A tag whose allocations are all freed is still one the process had.
    h.engine.free(ptr).unwrap();
    let d = done(pause(Some("kv".into())));
    assert_eq!((d.allocations, d.unknown_tag), (0, false));
    // The library's own calls stay quiet successes.
    assert_eq!(h.engine.pause(Some("kvv")).unwrap().allocations, 0);
    assert_eq!(h.engine.resume(Some("kvv")).unwrap().allocations, 0);
    // Unpauseable allocations' tags count too.
    h.engine
        .alloc_unpauseable(&AllocRequest {
            size: 1 << 20,
            device: 0,
            tag: "pool".into(),
            backup: None,
            chunk: 0,
        })
        .unwrap();
    assert!(h.engine.tag_known("pool"));
    assert!(!done(pause(Some("pool".into()))).unknown_tag);
}

#[test]
fn status_answers_whatever_the_tags() {
    let h = host();
    // Two tags of 5 MiB with the same beginning and length, and a short one.
    let long_a = format!("{}a", "t".repeat(5 << 20));
    let long_b = format!("{}b", "t".repeat(5 << 20));
    for tag in [&long_a, &long_b, &"kv".to_string()] {
        h.engine
            .alloc(&AllocRequest {
                size: 1 << 20,
                device: 0,
                tag: tag.clone(),
                backup: None,
                chunk: 0,
            })
            .unwrap();
    }
    h.region.lock().tag = long_a.clone();
    let mut c = Conn::greeted(h);
    // read_reply enforces the client's limit (MAX_REPLY_BYTES).
    let Reply::Status(s) = c.ask(&Request::Status) else {
        panic!()
    };
    assert_eq!(s.tags.len(), 3);
    assert_eq!(s.tags_omitted, 0);
    let shown: Vec<&str> = s.tags.iter().map(|t| t.tag.as_str()).collect();
    assert!(shown.contains(&"kv"));
    let long: Vec<&str> = shown.iter().copied().filter(|t| *t != "kv").collect();
    assert_eq!(long.len(), 2);
    assert_ne!(long[0], long[1], "two long tags must stay distinguishable");
    for t in &long {
        assert!(t.len() < 1200, "{} bytes", t.len());
        assert!(t.starts_with(&"t".repeat(1000)));
        assert!(
            t.contains(&format!("({} bytes, hash ", long_a.len())),
            "{t}"
        );
    }
    assert_eq!(dispatch::shown_tag(&long_a), s.default_region.unwrap().tag);
    let Reply::Region(r) = c.ask(&Request::GetRegion) else {
        panic!()
    };
    assert_eq!(r.tag, dispatch::shown_tag(&long_a));
    // A tag at the bound is shown whole; one byte more is not; multi-byte characters are cut
    // at a boundary.
    let at = "x".repeat(dispatch::MAX_SHOWN_TAG_BYTES);
    assert_eq!(dispatch::shown_tag(&at), at);
    assert_ne!(dispatch::shown_tag(&format!("{at}x")), format!("{at}x"));
    let wide = "é".repeat(dispatch::MAX_SHOWN_TAG_BYTES);
    assert!(dispatch::shown_tag(&wide).starts_with(&"é".repeat(512)));
}

#[test]
fn status_with_more_tags_than_fit_lists_the_first_and_counts_the_rest() {
    let tags: Vec<tms_proto::TagStatus> = (0..5000)
        .map(|i| tms_proto::TagStatus {
            tag: format!("{i:05}{}", "y".repeat(1000)),
            allocations: 1,
            ..Default::default()
        })
        .collect();
    let status = tms_proto::Status {
        backend: "sim".into(),
        tags,
        ..Default::default()
    };
    assert!(encode(&Reply::Status(Box::new(status.clone()))).len() > tms_proto::MAX_REPLY_BYTES);
    let fitted = dispatch::fit_reply(status, tms_proto::MAX_REPLY_BYTES);
    let line = encode(&Reply::Status(Box::new(fitted.clone())));
    let Ok(Reply::Status(back)) = decode_reply(&line) else {
        panic!("{} bytes do not decode", line.len())
    };
    assert!(fitted.tags_omitted > 0);
    assert_eq!(fitted.tags.len() as u64 + fitted.tags_omitted, 5000);
    assert!(fitted.tags[0].tag.starts_with("00000"));
    assert_eq!(back.tags_omitted, fitted.tags_omitted);
    // Nearly all that fits is used.
    assert!(
        line.len() > tms_proto::MAX_REPLY_BYTES - 4096,
        "{}",
        line.len()
    );
    // A small status is left alone.
    let small = tms_proto::Status::default();
    assert_eq!(dispatch::fit_reply(small.clone(), 1 << 20), small);
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

#[test]
fn a_restrictive_umask_still_gives_a_usable_private_folder_and_socket() {
    in_child("control::tests::restrictive_umask_child");
}

/// The work of the test above; does nothing unless run as its child.
#[test]
fn restrictive_umask_child() {
    use nix::sys::stat::{umask, Mode};
    if std::env::var_os("TMS_TEST_CHILD").is_none() {
        return;
    }
    let h = host();
    for mask in [0o777, 0o077, 0o277, 0o577, 0o700] {
        let base = std::env::temp_dir().join(format!("tms-umask-{}-{mask:o}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let folder = base.join("a/b");
        let old = umask(Mode::from_bits_truncate(mask));
        let r = dir::prepare(&folder, sys::euid())
            .map(|()| start_in(h, &folder, "4000104.1.sock", limits()));
        umask(old);
        let (_, path) = r.unwrap_or_else(|e| panic!("umask {mask:04o}: {e}"));
        for d in [&base, &base.join("a"), &folder] {
            let m = std::fs::symlink_metadata(d).unwrap().permissions().mode() & 0o777;
            assert_eq!(m, 0o700, "umask {mask:04o}: {}", d.display());
        }
        let m = std::fs::symlink_metadata(&path)
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(m, 0o600, "umask {mask:04o}: the socket");
        assert!(fresh_ping(&path) < Duration::from_secs(2));
        std::fs::remove_dir_all(&base).unwrap();
    }
}

// --- chunked allocations ---------------------------------------------------------------------

/// A chunked allocation of `tag`: 8 MiB in chunks of 2 MiB (the sim's granularity), with a
/// host backup, and a pattern that differs from chunk to chunk; returns it and the pattern.
fn chunked(h: &TestHost, tag: &str) -> (u64, Vec<u8>) {
    let ptr = h
        .engine
        .alloc(&AllocRequest {
            size: 8 << 20,
            device: 0,
            tag: tag.into(),
            backup: Some(BackupKind::Mmap),
            chunk: 2 << 20,
        })
        .unwrap();
    let data: Vec<u8> = (0..8u64 << 20)
        .map(|i| (i.wrapping_mul(31) ^ (i >> 21).wrapping_mul(101)) as u8)
        .collect();
    h.engine.write_bytes(ptr, &data).unwrap();
    (ptr, data)
}

fn chunk_op(which: Op, tag: &str, chunks: &[[u64; 2]]) -> Request {
    let (tag, chunks) = (Some(tag.to_string()), Some(chunks.to_vec()));
    match which {
        Op::Pause => Request::Pause {
            tag,
            chunks,
            chunk_state: false,
        },
        Op::Resume => Request::Resume {
            tag,
            chunks,
            chunk_state: false,
        },
    }
}

fn states(c: &mut Conn, tag: &str) -> String {
    match c.ask(&Request::Chunks { tag: tag.into() }) {
        Reply::Chunks(s) => s.states,
        other => panic!("{other:?}"),
    }
}

fn done(r: Reply) -> tms_proto::OpDone {
    match r {
        Reply::Done(d) => d,
        other => panic!("{other:?}"),
    }
}

/// Whole contents back as written (every chunk active).
fn assert_contents(h: &TestHost, ptr: u64, data: &[u8]) {
    let mut back = vec![0u8; data.len()];
    h.engine.read_bytes(ptr, &mut back).unwrap();
    assert!(back == data, "contents changed");
}

#[test]
fn chunks_pause_and_resume_through_the_server() {
    let h = host();
    let (ptr, data) = chunked(h, "kv");
    // The server says it does chunks.
    let mut c = Conn::open(h, limits());
    let Reply::Hello(hello) = c.ask(&Request::Hello(hello(PROTOCOL_VERSION))) else {
        panic!()
    };
    assert!(hello.has(tms_proto::FEATURE_CHUNKS), "{hello:?}");

    let Reply::Chunks(s) = c.ask(&Request::Chunks { tag: "kv".into() }) else {
        panic!()
    };
    assert_eq!(
        s,
        tms_proto::ChunkStatus {
            tag: "kv".into(),
            addr: ptr,
            chunk_size: 2 << 20,
            count: 4,
            states: "1111".into(),
        }
    );

    // Chunks 1 and 2 go: half the device memory, their contents to the backup.
    let Reply::Status(s0) = c.ask(&Request::Status) else {
        panic!()
    };
    let d = done(c.ask(&chunk_op(Op::Pause, "kv", &[[1, 2]])));
    assert_eq!(
        (d.op, d.allocations, d.bytes, d.copied_bytes),
        (Op::Pause, 1, 4 << 20, 4 << 20)
    );
    assert_eq!(d.chunks, Some(vec![[1, 2]]));
    assert_eq!(d.tag.as_deref(), Some("kv"));
    assert!(!d.unknown_tag);
    assert_eq!(states(&mut c, "kv"), "1001");
    let Reply::Status(s) = c.ask(&Request::Status) else {
        panic!()
    };
    let t = &s.tags[0];
    assert_eq!(
        (
            t.allocations,
            t.active_allocations,
            t.paused_allocations,
            t.partial_allocations
        ),
        (1, 0, 0, 1)
    );
    assert_eq!((t.bytes_active, t.bytes_paused), (4 << 20, 4 << 20));
    assert_eq!(
        s.devices[0].free_bytes,
        s0.devices[0].free_bytes + (4 << 20)
    );
    // The active chunks are still there to read, the paused ones are not.
    let mut first = vec![0u8; 2 << 20];
    h.engine.read_bytes(ptr, &mut first).unwrap();
    assert!(first == data[..2 << 20]);
    assert!(h.engine.read_bytes(ptr + (2 << 20), &mut first).is_err());
    // Pausing them again changes nothing.
    let d = done(c.ask(&chunk_op(Op::Pause, "kv", &[[1, 2]])));
    assert_eq!((d.allocations, d.bytes), (0, 0));

    // Back one at a time, in any order, the list normalised in the reply.
    let d = done(c.ask(&chunk_op(Op::Resume, "kv", &[[2, 2], [2, 2]])));
    assert_eq!(
        (d.allocations, d.bytes, d.copied_bytes),
        (1, 2 << 20, 2 << 20)
    );
    assert_eq!(d.chunks, Some(vec![[2, 2]]));
    assert_eq!(states(&mut c, "kv"), "1011");
    done(c.ask(&chunk_op(Op::Resume, "kv", &[[1, 1]])));
    assert_eq!(states(&mut c, "kv"), "1111");
    assert_contents(h, ptr, &data);
    let Reply::Status(s) = c.ask(&Request::Status) else {
        panic!()
    };
    assert_eq!(
        (s.tags[0].active_allocations, s.tags[0].partial_allocations),
        (1, 0)
    );

    // Whole-tag and chunk operations compose: a whole pause, one chunk back, the rest back.
    done(c.ask(&pause(Some("kv".into()))));
    assert_eq!(states(&mut c, "kv"), "0000");
    done(c.ask(&chunk_op(Op::Resume, "kv", &[[0, 0]])));
    assert_eq!(states(&mut c, "kv"), "1000");
    let Reply::Status(s) = c.ask(&Request::Status) else {
        panic!()
    };
    assert_eq!(s.tags[0].partial_allocations, 1);
    assert_eq!(s.bytes_active(), 2 << 20);
    let d = done(c.ask(&resume(Some("kv".into()))));
    assert_eq!((d.allocations, d.bytes), (1, 6 << 20));
    assert_contents(h, ptr, &data);

    // Saved chunk states: chunk 0 paused on its own, then the whole tag with its states
    // recorded; a resume that restores them brings back 1 to 3 only.
    done(c.ask(&chunk_op(Op::Pause, "kv", &[[0, 0]])));
    let d = done(c.ask(&Request::Pause {
        tag: Some("kv".into()),
        chunks: None,
        chunk_state: true,
    }));
    assert_eq!(d.bytes, 6 << 20);
    assert_eq!(states(&mut c, "kv"), "0000");
    let d = done(c.ask(&Request::Resume {
        tag: Some("kv".into()),
        chunks: None,
        chunk_state: true,
    }));
    assert_eq!((d.bytes, d.copied_bytes), (6 << 20, 6 << 20));
    assert_eq!(states(&mut c, "kv"), "0111");
    done(c.ask(&resume(None)));
    assert_eq!(states(&mut c, "kv"), "1111");
    assert_contents(h, ptr, &data);
}

#[test]
fn bad_chunk_requests_are_refused_and_change_nothing() {
    let h = host();
    let (ptr, data) = chunked(h, "kv");
    chunked(h, "two");
    chunked(h, "two");
    h.engine
        .alloc(&AllocRequest {
            size: 2 << 20,
            device: 0,
            tag: "plain".into(),
            backup: None,
            chunk: 0,
        })
        .unwrap();
    let mut c = Conn::greeted(h);
    let refused = |c: &mut Conn, r: Request, kind: ErrorKind, words: &[&str]| {
        let reply = c.ask(&r);
        let Reply::Error(e) = &reply else {
            panic!("{r:?}: {reply:?}")
        };
        assert_eq!(e.kind, kind, "{r:?}: {}", e.message);
        for w in words {
            assert!(e.message.contains(w), "{r:?}: {w:?} not in {}", e.message);
        }
    };
    // Indices the allocation does not have: named, with how many it has.
    for (op, list) in [
        (Op::Pause, vec![[4, 4]]),
        (Op::Pause, vec![[0, 0], [4, 9]]),
        (Op::Resume, vec![[4, 4]]),
    ] {
        refused(
            &mut c,
            chunk_op(op, "kv", &list),
            ErrorKind::InvalidArgument,
            &["chunk 4 ", "it has 4 chunks (0 to 3)", "\"kv\""],
        );
    }
    refused(
        &mut c,
        chunk_op(Op::Pause, "kv", &[[9, 2]]),
        ErrorKind::InvalidArgument,
        &["9-2 runs backwards"],
    );
    refused(
        &mut c,
        chunk_op(Op::Pause, "kv", &[]),
        ErrorKind::InvalidArgument,
        &["empty chunk list"],
    );
    refused(
        &mut c,
        chunk_op(Op::Pause, "kv", &[[0, 1 << 40]]),
        ErrorKind::InvalidArgument,
        &["more than 1048576 chunks"],
    );
    // No tag, an empty one, chunk states with chunks.
    for r in [
        Request::Pause {
            tag: None,
            chunks: Some(vec![[0, 0]]),
            chunk_state: false,
        },
        Request::Resume {
            tag: None,
            chunks: Some(vec![[0, 0]]),
            chunk_state: false,
        },
    ] {
        refused(
            &mut c,
            r,
            ErrorKind::InvalidArgument,
            &["chunks need a tag"],
        );
    }
    refused(
        &mut c,
        chunk_op(Op::Pause, "", &[[0, 0]]),
        ErrorKind::InvalidArgument,
        &["must not be empty"],
    );
    refused(
        &mut c,
        Request::Pause {
            tag: Some("kv".into()),
            chunks: Some(vec![[0, 0]]),
            chunk_state: true,
        },
        ErrorKind::InvalidArgument,
        &["not with chunks"],
    );
    // A tag without a chunked allocation, or with two (both named).
    refused(
        &mut c,
        chunk_op(Op::Pause, "plain", &[[0, 0]]),
        ErrorKind::NotFound,
        &["\"plain\" has no chunked allocation"],
    );
    refused(
        &mut c,
        Request::Chunks {
            tag: "plain".into(),
        },
        ErrorKind::NotFound,
        &["no chunked allocation"],
    );
    let two: Vec<String> = h
        .engine
        .allocations()
        .iter()
        .filter(|a| a.tag == "two")
        .map(|a| format!("{:#x}", a.addr))
        .collect();
    let mut words = vec!["2 chunked allocations"];
    words.extend(two.iter().map(String::as_str));
    refused(
        &mut c,
        chunk_op(Op::Resume, "two", &[[0, 0]]),
        ErrorKind::InvalidArgument,
        &words,
    );
    refused(
        &mut c,
        Request::Chunks { tag: "two".into() },
        ErrorKind::InvalidArgument,
        &words,
    );
    // A tag no allocation ever had: nothing to do, flagged, as for a whole tag; its chunks
    // cannot be listed.
    let d = done(c.ask(&chunk_op(Op::Pause, "kvv", &[[0, 0]])));
    assert_eq!((d.allocations, d.unknown_tag), (0, true));
    refused(
        &mut c,
        Request::Chunks { tag: "kvv".into() },
        ErrorKind::NotFound,
        &["ever had tag \"kvv\""],
    );
    refused(
        &mut c,
        Request::Chunks { tag: "".into() },
        ErrorKind::InvalidArgument,
        &["must not be empty"],
    );
    // The connection stayed open through all of that, and nothing changed.
    assert!(matches!(c.ask(&Request::Ping), Reply::Pong { .. }));
    assert_eq!(states(&mut c, "kv"), "1111");
    assert_contents(h, ptr, &data);
    // Malformed chunk lists are not requests: refused, and the connection closed.
    c.send_raw(b"{\"op\":\"pause\",\"tag\":\"kv\",\"chunks\":\"8-15\"}\n");
    assert_eq!(error_kind(&c.read_reply()), ErrorKind::BadRequest);
    c.assert_closed();
    let mut c = Conn::greeted(h);
    c.send_raw(b"{\"op\":\"resume\",\"tag\":\"kv\",\"chunks\":[[1,2,3]]}\n");
    assert_eq!(error_kind(&c.read_reply()), ErrorKind::BadRequest);
    c.assert_closed();
    assert_contents(h, ptr, &data);
}

#[test]
fn a_chunk_list_too_long_to_send_as_indices_fits_as_ranges() {
    let h = host();
    let (ptr, data) = chunked(h, "kv");
    let mut c = Conn::greeted(h);
    // Every chunk, a million times over: refused by count, not by line length.
    let many = vec![[0u64, 3]; 300_000];
    assert!(encode(&chunk_op(Op::Pause, "kv", &many)).len() > MAX_LINE_BYTES);
    let some = vec![[0u64, 3]; 2000];
    let r = c.ask(&chunk_op(Op::Pause, "kv", &some));
    // 8000 indices counted before duplicates go: within the bound, so it is done.
    assert_eq!(done(r).bytes, 8 << 20);
    assert_eq!(states(&mut c, "kv"), "0000");
    done(c.ask(&resume(None)));
    assert_contents(h, ptr, &data);
}

/// `set_region` makes the check every other way of setting a region makes (a CPU and a disk
/// backup at once are refused, the region left as it was), and replies show a disk backup.
#[test]
fn set_region_refuses_a_cpu_and_a_disk_backup_at_once() {
    let h = host();
    h.region.lock().disk_backup = true;
    let mut c = Conn::greeted(h);
    let Reply::Region(r) = c.ask(&Request::GetRegion) else {
        panic!()
    };
    assert!(r.disk_backup && !r.cpu_backup, "{r:?}");
    let r = c.ask(&Request::SetRegion(RegionUpdate {
        cpu_backup: Some(true),
        ..Default::default()
    }));
    assert_eq!(error_kind(&r), ErrorKind::InvalidArgument);
    let Reply::Error(e) = &r else { panic!() };
    assert!(
        e.message
            .contains("enable_cpu_backup and enable_disk_backup")
            && e.message.contains("unchanged"),
        "{e:?}"
    );
    let now = h.region.lock().clone();
    assert!(now.disk_backup && !now.cpu_backup, "{now:?}");
    // Both in one request: from disk to CPU.
    let Reply::Region(r) = c.ask(&Request::SetRegion(RegionUpdate {
        cpu_backup: Some(true),
        disk_backup: Some(false),
        ..Default::default()
    })) else {
        panic!()
    };
    assert!(r.cpu_backup && !r.disk_backup, "{r:?}");
    let now = h.region.lock().clone();
    assert!(now.check().is_ok() && now.cpu_backup && !now.disk_backup);
}

/// The operations `status` lists for tag `tag` (other tests' requests share the table).
fn running_of(c: &mut Conn, tag: &str) -> Vec<tms_proto::Running> {
    match c.ask(&Request::Status) {
        Reply::Status(s) => s
            .operations
            .into_iter()
            .filter(|r| r.tag.as_deref() == Some(tag))
            .collect(),
        other => panic!("{other:?}"),
    }
}

/// A pause over the socket and one started in the process, both slow (a device link of 32
/// MiB/s): `status` shows each while it runs with its phase and bytes, the one started in the
/// process marked so, and a request queued behind it as waiting; the reply says how much went
/// to disk.
#[test]
fn status_shows_the_progress_of_pauses_and_resumes_whoever_started_them() {
    let sim = SimDriver::new(SimConfig::default()).unwrap();
    sim.set_bandwidth(Some(32 << 20));
    let h = host_over(sim);
    let size: u64 = 16 << 20;
    for tag in ["prog-a", "prog-b"] {
        h.engine
            .alloc(&AllocRequest {
                size,
                device: 0,
                tag: tag.into(),
                backup: Some(BackupKind::Pinned),
                chunk: 0,
            })
            .unwrap();
    }
    let mut watcher = Conn::open(
        h,
        Limits {
            max_requests: 10_000,
            ..limits()
        },
    );
    match watcher.ask(&Request::Hello(hello(PROTOCOL_VERSION))) {
        Reply::Hello(hi) => assert!(hi.has(tms_proto::FEATURE_PROGRESS), "{hi:?}"),
        other => panic!("{other:?}"),
    }
    let poll = |c: &mut Conn, tag: &str, finished: &dyn Fn() -> bool| {
        let mut seen = Vec::new();
        while !finished() {
            seen.extend(running_of(c, tag));
            std::thread::sleep(Duration::from_millis(10));
        }
        seen
    };

    // Over the socket.
    let t = std::thread::spawn(move || {
        let mut c = Conn::greeted(h);
        done(c.ask(&pause(Some("prog-a".into()))))
    });
    let seen = poll(&mut watcher, "prog-a", &|| t.is_finished());
    let d = t.join().unwrap();
    assert_eq!(
        (d.copied_bytes, d.disk_copied_bytes),
        (size, Some(0)),
        "{d:?}"
    );
    let copying: Vec<_> = seen
        .iter()
        .filter(|r| r.bytes_done.is_some_and(|b| b > 0 && b < size))
        .collect();
    assert!(copying.len() >= 3, "{seen:?}");
    for r in &copying {
        assert_eq!(r.op, Op::Pause);
        assert!(!r.in_process, "{r:?}");
        assert_eq!(r.phase, Some(tms_proto::Phase::CopyingToHost), "{r:?}");
        assert_eq!(r.bytes_total, Some(size), "{r:?}");
        assert_eq!(r.backing, Some(tms_proto::Backing::Host), "{r:?}");
        assert!(r.gib_per_s.is_some_and(|g| g > 0.0), "{r:?}");
    }
    assert!(running_of(&mut watcher, "prog-a").is_empty(), "ended");

    // In the process, with a request over the socket queued behind it.
    let t = std::thread::spawn(move || h.engine.pause(Some("prog-b")).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while running_of(&mut watcher, "prog-b").is_empty() {
        assert!(
            Instant::now() < deadline,
            "the pause in the process never showed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let queued = std::thread::spawn(move || {
        let mut c = Conn::greeted(h);
        done(c.ask(&resume(Some("prog-a".into()))))
    });
    let waiting = loop {
        let w = running_of(&mut watcher, "prog-a");
        if !w.is_empty() || t.is_finished() {
            break w;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(waiting.len(), 1, "{waiting:?}");
    assert_eq!(
        (waiting[0].op, waiting[0].phase, waiting[0].bytes_done),
        (Op::Resume, Some(tms_proto::Phase::Waiting), None),
        "{waiting:?}"
    );
    let seen = poll(&mut watcher, "prog-b", &|| t.is_finished());
    let r = t.join().unwrap();
    assert_eq!((r.copied, r.disk_copied), (size, 0));
    let copying: Vec<_> = seen
        .iter()
        .filter(|r| r.bytes_done.is_some_and(|b| b > 0 && b < size))
        .collect();
    assert!(copying.len() >= 3, "{seen:?}");
    for r in &copying {
        assert!(r.in_process, "{r:?}");
        assert_eq!(r.phase, Some(tms_proto::Phase::CopyingToHost), "{r:?}");
    }
    let d = queued.join().unwrap();
    assert_eq!((d.op, d.copied_bytes), (Op::Resume, size));
}
