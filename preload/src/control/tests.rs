//! The server's sessions over socket pairs, with an engine of their own on the simulated
//! device, and the accept loop over a real socket in a temporary folder.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tms_proto::{
    decode_reply, encode, BackupBackend, ErrorKind, Hello, Op, RegionUpdate, Reply, Request,
    MAX_LINE_BYTES, PROTOCOL_VERSION,
};

use super::dispatch::Host;
use super::session::{serve_connection, Identity, Limits};
use super::*;
use crate::driver::sim::{SimConfig, SimDriver};
use crate::driver::HostBackend;
use crate::engine::AllocRequest;

struct TestHost {
    engine: Engine,
    region: Mutex<RegionSettings>,
}

fn host() -> &'static TestHost {
    let d = SimDriver::new(SimConfig::default()).unwrap();
    Box::leak(Box::new(TestHost {
        engine: Engine::new(Arc::new(d)),
        region: Mutex::new(RegionSettings {
            enabled: false,
            tag: "default".into(),
            cpu_backup: false,
            backend: HostBackend::Pinned,
        }),
    }))
}

impl Host for TestHost {
    fn engine(&self) -> &Engine {
        &self.engine
    }
    fn default_region(&self) -> Result<RegionSettings> {
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
        let t = std::thread::spawn(move || serve_connection(&server, h, &l, &me()));
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
            backup: Some(HostBackend::Mmap),
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

    let Reply::Done(d) = c.ask(&Request::Pause {
        tag: Some("kv".into()),
    }) else {
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
    let Reply::Done(d) = c.ask(&Request::Pause { tag: None }) else {
        panic!()
    };
    assert_eq!(d.allocations, 0);
    let Reply::Done(d) = c.ask(&Request::Resume { tag: None }) else {
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
    })) else {
        panic!()
    };
    assert!(r.enabled && r.cpu_backup && r.tag == "weights");
    assert_eq!(r.backend, BackupBackend::Mmap);
    assert_eq!(h.region.lock().backend, HostBackend::Mmap);
    let Reply::Status(s) = c.ask(&Request::Status) else {
        panic!()
    };
    assert_eq!(s.default_region.unwrap().tag, "weights");

    // Failed operations are replied to and the connection stays open.
    let r = c.ask(&Request::Pause {
        tag: Some(String::new()),
    });
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
    std::thread::spawn(move || serve(&listener, h, &limits(), &me()));

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
