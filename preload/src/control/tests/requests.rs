//! Requests and replies over one connection: every operation, pipelining, the hello, bad
//! input, time limits, disconnects, the request limit, and `set_region`'s checks.

use super::*;

#[test]
fn every_operation_over_a_connection() {
    let h = host();
    let ptr = h.alloc(3 << 20, "kv", Some(BackupKind::Mmap));
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
    let mut c = Conn::greeted_with(
        h,
        Limits {
            max_requests: 3,
            ..limits()
        },
    );
    for _ in 0..3 {
        assert!(matches!(c.ask(&Request::Ping), Reply::Pong { .. }));
    }
    // The fourth is answered with why, then the connection ends.
    let r = c.ask(&Request::Ping);
    assert_eq!(error_kind(&r), ErrorKind::Busy, "{r:?}");
    let Reply::Error(e) = &r else { panic!() };
    assert!(e.message.contains("served 3 requests"), "{e:?}");
    c.assert_closed();
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
    // The tag reserved for NCCL: refused saying so, without the advice on backups.
    let r = c.ask(&Request::SetRegion(RegionUpdate {
        enabled: Some(true),
        tag: Some("nccl".into()),
        ..Default::default()
    }));
    let Reply::Error(e) = &r else { panic!("{r:?}") };
    assert!(
        e.message.contains("reserved")
            && e.message.contains("unchanged")
            && !e.message.contains("backup"),
        "{e:?}"
    );
}

/// Two clients changing different fields of the default region at once (`tmsctl region --tag`
/// and `tmsctl region --enabled`): each change reads the region, changes its field and writes
/// it back, so without one change after the other, the later write puts back the field the
/// earlier one changed.
#[test]
fn concurrent_region_changes_of_different_fields_both_land() {
    use std::sync::atomic::Ordering::SeqCst;
    let h = host();
    let mut a = Conn::greeted(h);
    let mut b = Conn::greeted(h);
    // Writes wait until both changes have been asked for, and have read the region if nothing
    // keeps them apart.
    let write_gate = h.write_gate.lock();
    a.send_raw(&encode(&Request::SetRegion(RegionUpdate {
        tag: Some("kv".into()),
        ..Default::default()
    })));
    b.send_raw(&encode(&Request::SetRegion(RegionUpdate {
        enabled: Some(true),
        ..Default::default()
    })));
    let t0 = Instant::now();
    while h.at_write_gate.load(SeqCst) < 2 && t0.elapsed() < Duration::from_millis(500) {
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(write_gate);
    for c in [&mut a, &mut b] {
        assert!(matches!(c.read_reply(), Reply::Region(_)));
    }
    let now = h.region.lock().clone();
    assert!(now.tag == "kv" && now.enabled, "a change was lost: {now:?}");
    let Reply::Region(r) = a.ask(&Request::GetRegion) else {
        panic!()
    };
    assert!(r.tag == "kv" && r.enabled, "{r:?}");
}

#[test]
fn a_resume_without_waiting_answers_mapped_and_restores_in_the_process() {
    let sim = SimDriver::new(SimConfig::default()).unwrap();
    let h = host_over(sim);
    let mut ptrs = Vec::new();
    for i in 0..3u8 {
        let p = h.alloc(2 << 20, "kv", Some(BackupKind::Pinned));
        h.engine.write_bytes(p, &[i + 1; 64]).unwrap();
        ptrs.push(p);
    }
    let mut c = Conn::greeted(h);
    let Reply::Done(_) = c.ask(&pause(Some("kv".into()))) else {
        panic!()
    };
    let Reply::Done(d) = c.ask(&resume_no_wait("kv")) else {
        panic!()
    };
    assert_eq!((d.op, d.allocations, d.bytes), (Op::Resume, 3, 6 << 20));
    assert!(d.pending_bytes <= d.bytes);
    assert!(h.engine.wait_restored(None, None).unwrap());
    for (i, p) in ptrs.iter().enumerate() {
        let mut back = [0u8; 64];
        h.engine.read_bytes(*p, &mut back).unwrap();
        assert_eq!(back, [i as u8 + 1; 64]);
    }
    // A whole tag only.
    for bad in [
        Request::Resume {
            tag: Some("kv".into()),
            chunks: Some(vec![[0, 0]]),
            chunk_state: false,
            job_record: false,
            no_wait: true,
            verify: false,
        },
        Request::Resume {
            tag: Some("kv".into()),
            chunks: None,
            chunk_state: true,
            job_record: false,
            no_wait: true,
            verify: false,
        },
        // A verified resume waits for what it checks.
        Request::Resume {
            tag: Some("kv".into()),
            chunks: None,
            chunk_state: false,
            job_record: false,
            no_wait: true,
            verify: true,
        },
    ] {
        let Reply::Error(e) = c.ask(&bad) else {
            panic!()
        };
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{}", e.message);
        assert!(
            e.message.contains("whole tag") || e.message.contains("not with no_wait"),
            "{}",
            e.message
        );
    }
}

/// Send `req`; its reply as the JSON it came in (what the wire holds, field by field).
fn ask_wire(c: &mut Conn, req: &Request) -> serde_json::Value {
    c.send_raw(&encode(req));
    let mut line = String::new();
    c.reader.read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
}

/// The numbers of tag `tag` in a status: active bytes, paused bytes, allocations paused wholly
/// or in part.
fn tag_numbers(c: &mut Conn, tag: &str) -> (u64, u64, u64) {
    let Reply::Status(s) = c.ask(&Request::Status) else {
        panic!()
    };
    let t = s.tags.iter().find(|t| t.tag == tag).unwrap();
    (
        t.bytes_active,
        t.bytes_paused,
        t.paused_allocations + t.partial_allocations,
    )
}

/// A pause or resume that fails says in its error reply what it changed all the same: a pause
/// that paused one allocation of two before failing, one, with its bytes; one that failed
/// before pausing anything, and a resume that undid itself, nothing. A client undoing a job's
/// operation decides from that, not from the tag's state, which the program may change.
#[test]
fn a_failed_pause_or_resume_says_what_it_changed() {
    use crate::driver::sim::Prim;
    let sim = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
    let h = host_over_shared(sim.clone());
    for _ in 0..2 {
        h.alloc(2 << 20, "kv", Some(BackupKind::Pinned));
    }
    let mut c = Conn::greeted(h);
    // The second allocation's memory cannot be given back: the first is paused.
    sim.arm_fault(Prim::Unmap, 2, 999);
    let r = ask_wire(&mut c, &pause(Some("kv".into())));
    assert_eq!(r["reply"], "error", "{r}");
    let (active, paused, allocations) = tag_numbers(&mut c, "kv");
    assert_eq!((active, paused, allocations), (2 << 20, 2 << 20, 1));
    assert_eq!(
        r["changed"],
        serde_json::json!({"allocations": 1, "bytes": 2 << 20}),
        "{r}"
    );
    done(c.ask(&resume(Some("kv".into()))));
    // Failed at its first step: nothing changed, and it says so (not left out).
    sim.arm_fault(Prim::Synchronize, 1, 999);
    let r = ask_wire(&mut c, &pause(Some("kv".into())));
    assert_eq!(r["reply"], "error", "{r}");
    assert_eq!(tag_numbers(&mut c, "kv"), (4 << 20, 0, 0));
    assert_eq!(
        r["changed"],
        serde_json::json!({"allocations": 0, "bytes": 0}),
        "{r}"
    );
    // A resume that fails undoes itself: nothing changed.
    done(c.ask(&pause(Some("kv".into()))));
    sim.arm_fault(Prim::Create, 2, 999);
    let r = ask_wire(&mut c, &resume(Some("kv".into())));
    assert_eq!(r["reply"], "error", "{r}");
    assert_eq!(tag_numbers(&mut c, "kv"), (0, 4 << 20, 2));
    assert_eq!(
        r["changed"],
        serde_json::json!({"allocations": 0, "bytes": 0}),
        "{r}"
    );
    // Refused before the engine is asked: nothing changed either.
    let bad = Request::Pause {
        tag: None,
        chunks: Some(vec![[0, 0]]),
        chunk_state: false,
        job_record: false,
    };
    let r = ask_wire(&mut c, &bad);
    assert_eq!(r["kind"], "invalid_argument", "{r}");
    assert_eq!(
        r["changed"],
        serde_json::json!({"allocations": 0, "bytes": 0}),
        "{r}"
    );
    // Other requests' errors say nothing of it.
    let r = ask_wire(&mut c, &Request::Chunks { tag: "kv".into() });
    assert_eq!(r["reply"], "error", "{r}");
    assert!(r.get("changed").is_none(), "{r}");
    done(c.ask(&resume(Some("kv".into()))));
}

/// A pause that reports an earlier non-blocking resume's failure did its work: its error says
/// what it paused (not what the earlier resume had changed).
#[test]
fn a_pause_that_reports_an_earlier_failure_says_what_it_paused() {
    use crate::driver::sim::Prim;
    let (sim, h, mut c) = paused_nw(2);
    sim.hold(Prim::EventSync, None);
    done(c.ask(&resume_no_wait("nw")));
    sim.arm_fault(Prim::EventSync, 1, 999);
    sim.unhold(Prim::EventSync, None);
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.engine.restoring() {
        assert!(Instant::now() < deadline, "the resume never ended");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The failed allocation is unrestored (left mapped); the other may have landed first.
    let (active, _, _) = tag_numbers(&mut c, "nw");
    let r = ask_wire(&mut c, &pause(Some("nw".into())));
    assert_eq!(r["reply"], "error", "{r}");
    assert!(
        r["message"]
            .as_str()
            .is_some_and(|m| m.contains("reported by this pause")),
        "{r}"
    );
    assert_eq!(tag_numbers(&mut c, "nw"), (0, 4 << 20, 2));
    // What was active (restored before the failure) it paused; what the failure left mapped it
    // gave back, which was paused already: no change of state.
    assert_eq!(
        r["changed"],
        serde_json::json!({"allocations": active / (2 << 20), "bytes": active}),
        "{r}"
    );
}
