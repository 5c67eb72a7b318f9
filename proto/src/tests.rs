use std::ffi::OsString;
use std::path::PathBuf;

use proptest::prelude::*;
use tms_units::{chunk_ranges, format_ranges};

use super::generators::arb_request;
use super::*;

fn hello() -> Hello {
    Hello {
        protocol: PROTOCOL_VERSION,
        pid: 42,
        software: "tmsctl 0.1.0".into(),
        backend: None,
        features: Vec::new(),
    }
}

fn pause(tag: Option<&str>) -> Request {
    Request::Pause {
        tag: tag.map(str::to_string),
        chunks: None,
        chunk_state: false,
        job_record: false,
    }
}

#[test]
fn requests_have_the_documented_shape() {
    let line = |r: &Request| String::from_utf8(encode(r)).unwrap();
    assert_eq!(
        line(&Request::Hello(hello())),
        "{\"op\":\"hello\",\"protocol\":1,\"pid\":42,\"software\":\"tmsctl 0.1.0\"}\n"
    );
    assert_eq!(line(&Request::Ping), "{\"op\":\"ping\"}\n");
    assert_eq!(line(&pause(None)), "{\"op\":\"pause\"}\n");
    assert_eq!(
        line(&Request::Resume {
            tag: Some("kv".into()),
            chunks: None,
            chunk_state: false,
            job_record: false,
            no_wait: false,
            verify: false,
        }),
        "{\"op\":\"resume\",\"tag\":\"kv\"}\n"
    );
    assert_eq!(
        line(&Request::Pause {
            tag: Some("kv".into()),
            chunks: Some(vec![[8, 15], [20, 20]]),
            chunk_state: false,
            job_record: false,
        }),
        "{\"op\":\"pause\",\"tag\":\"kv\",\"chunks\":[[8,15],[20,20]]}\n"
    );
    assert_eq!(
        line(&Request::Resume {
            tag: None,
            chunks: None,
            chunk_state: true,
            job_record: false,
            no_wait: false,
            verify: false,
        }),
        "{\"op\":\"resume\",\"chunk_state\":true}\n"
    );
    assert_eq!(
        line(&Request::Resume {
            tag: Some("kv".into()),
            chunks: None,
            chunk_state: false,
            job_record: false,
            no_wait: true,
            verify: false,
        }),
        "{\"op\":\"resume\",\"tag\":\"kv\",\"no_wait\":true}\n"
    );
    assert_eq!(
        line(&Request::Chunks { tag: "kv".into() }),
        "{\"op\":\"chunks\",\"tag\":\"kv\"}\n"
    );
    assert_eq!(
        line(&Request::SetRegion(RegionUpdate {
            enabled: Some(true),
            backend: Some(BackupBackend::Mmap),
            ..Default::default()
        })),
        "{\"op\":\"set_region\",\"enabled\":true,\"backend\":\"mmap\"}\n"
    );
}

#[test]
fn decoder_accepts_requests_with_and_without_newline() {
    for l in [
        &b"{\"op\":\"status\"}"[..],
        b"{\"op\":\"status\"}\n",
        b"{\"op\":\"status\"}\r\n",
        b"  {\"op\" : \"status\"}  ",
    ] {
        assert_eq!(decode_request(l), Ok(Request::Status), "{l:?}");
    }
    assert_eq!(
        decode_request(b"{\"op\":\"pause\",\"tag\":null}"),
        Ok(pause(None))
    );
}

#[test]
fn hello_of_another_version_still_decodes() {
    // A future client's hello, with fields this version does not know.
    let r = decode_request(b"{\"op\":\"hello\",\"protocol\":7,\"pid\":1,\"future\":[\"x\"]}");
    match r {
        Ok(Request::Hello(h)) => assert_eq!((h.protocol, h.pid, h.software.as_str()), (7, 1, "")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn decoder_rejects_what_is_not_a_request() {
    let bad: &[&[u8]] = &[
        b"",
        b"\n",
        b"   ",
        b"garbage",
        b"{",
        b"[]",
        b"null",
        b"{\"op\":\"format_disk\"}",
        b"{\"tag\":\"kv\"}",
        b"{\"op\":\"pause\",\"tga\":\"kv\"}",
        b"{\"op\":\"pause\",\"tag\":3}",
        b"{\"op\":\"set_region\",\"enable\":true}",
        b"{\"op\":\"set_region\",\"backend\":\"gpu\"}",
        b"{\"op\":\"pause\",\"tag\":\"kv\",\"op\":\"resume\"}",
        b"{\"op\":\"hello\"}",
        b"{\"op\":\"pause\",\"tag\":\"kv\",\"chunks\":\"8-15\"}",
        b"{\"op\":\"pause\",\"tag\":\"kv\",\"chunks\":[8,15]}",
        b"{\"op\":\"pause\",\"tag\":\"kv\",\"chunks\":[[8,15,16]]}",
        b"{\"op\":\"pause\",\"tag\":\"kv\",\"chunks\":[[-1,2]]}",
        b"{\"op\":\"resume\",\"chunk_state\":1}",
        b"{\"op\":\"chunks\"}",
        b"{\"op\":\"chunks\",\"tag\":null}",
        b"{\"op\":\"chunks\",\"tag\":\"kv\",\"chunks\":[[0,1]]}",
        b"\xff\xfe{}",
        b"{\"op\":\"pause\",\"tag\":\"\xff\"}",
    ];
    for l in bad {
        let e = decode_request(l).expect_err(&String::from_utf8_lossy(l));
        assert_eq!(e.kind(), ErrorKind::BadRequest, "{l:?}: {e}");
        assert!(matches!(e.to_reply(), Reply::Error(_)));
    }
}

#[test]
fn operations_without_fields_reject_fields_too() {
    for l in [
        &b"{\"op\":\"ping\",\"x\":1}"[..],
        b"{\"x\":1,\"op\":\"ping\"}",
        b"{\"op\":\"status\",\"tag\":\"kv\"}",
        b"{\"op\":\"get_region\",\"enabled\":true}",
        b"{\"op\":\"get_region\",\"tag\":null}",
        b"{\"op\":\"ping\",\"op\":\"ping\"}",
    ] {
        let e = decode_request(l).expect_err(&String::from_utf8_lossy(l));
        assert_eq!(e.kind(), ErrorKind::BadRequest, "{l:?}: {e}");
        assert!(e.kind().closes_connection());
    }
    let m = decode_request(b"{\"op\":\"ping\",\"x\":1}")
        .unwrap_err()
        .to_string();
    assert!(m.contains("unknown field `x`"), "{m}");
    // The example of docs/tmsctl.md, word for word.
    let m = decode_request(b"{\"op\":\"pause\",\"tga\":\"kv\"}")
        .unwrap_err()
        .to_string();
    assert_eq!(
        m,
        "malformed message: unknown field `tga`, expected one of `tag`, `chunks`, \
         `chunk_state`, `job_record`"
    );
    for (l, r) in [
        (&b"{\"op\":\"ping\"}"[..], Request::Ping),
        (b" { \"op\" : \"status\" }\r\n", Request::Status),
        (b"{\"op\":\"get_region\"}\n", Request::GetRegion),
    ] {
        assert_eq!(decode_request(l), Ok(r));
    }
}

#[test]
fn busy_and_the_new_fields_have_their_wire_form() {
    let busy = Reply::error(ErrorKind::Busy, "full");
    let line = encode(&busy);
    assert_eq!(
        String::from_utf8(line.clone()).unwrap(),
        "{\"reply\":\"error\",\"kind\":\"busy\",\"message\":\"full\"}\n"
    );
    assert_eq!(decode_reply(&line), Ok(busy));
    assert!(ErrorKind::Busy.closes_connection());
    // tags_omitted is left out when 0, and read as 0 from servers that do not send it.
    let s = Status::default();
    let line = String::from_utf8(encode(&Reply::Status(Box::new(s.clone())))).unwrap();
    assert!(!line.contains("tags_omitted"), "{line}");
    let with = Status {
        tags_omitted: 3,
        ..s
    };
    let line = encode(&Reply::Status(Box::new(with.clone())));
    assert_eq!(decode_reply(&line), Ok(Reply::Status(Box::new(with))));
}

#[test]
fn decoder_enforces_the_line_limit() {
    let mut l = b"{\"op\":\"pause\",\"tag\":\"".to_vec();
    l.resize(MAX_LINE_BYTES - 2, b'a');
    l.extend_from_slice(b"\"}");
    assert_eq!(l.len(), MAX_LINE_BYTES);
    assert!(decode_request(&l).is_ok());
    l.insert(25, b'a');
    let e = decode_request(&l).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LineTooLong, "{e}");
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    let mut l = b"{\"op\":\"pause\",\"tag\":".to_vec();
    l.extend(std::iter::repeat_n(b'[', 50_000));
    assert_eq!(
        decode_request(&l).unwrap_err().kind(),
        ErrorKind::BadRequest
    );
}

#[test]
fn messages_quote_little_of_the_input() {
    let mut l = b"{\"op\":\"".to_vec();
    l.extend(std::iter::repeat_n(b'x', 10_000));
    l.extend_from_slice(b"\"}");
    let m = decode_request(&l).unwrap_err().to_string();
    assert!(m.len() < 400, "{} bytes", m.len());
}

/// The tag `nccl`'s numbers and a pause's communicators travel; a tag without them, and a
/// reply of a server that predates them, leave them out and read as none.
#[test]
fn nccl_numbers_are_optional_both_ways() {
    let plain = TagStatus {
        tag: "kv".into(),
        ..Default::default()
    };
    let j = serde_json::to_string(&plain).unwrap();
    assert!(!j.contains("nccl"), "{j}");
    let nccl = TagStatus {
        tag: "nccl".into(),
        nccl: Some(NcclStatus {
            version: Some("2.29.7".into()),
            communicators: 2,
            suspended: 2,
            suspendable_bytes: 1 << 30,
            suspended_bytes: 1 << 30,
            registered_policy: "keep".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let back: TagStatus = serde_json::from_str(&serde_json::to_string(&nccl).unwrap()).unwrap();
    assert_eq!(back, nccl);
    let older: TagStatus = serde_json::from_str(
        r#"{"tag":"kv","allocations":1,"active_allocations":1,"paused_allocations":0,
            "bytes_requested":1,"bytes_active":2,"bytes_paused":0,"host_backup_bytes":0}"#,
    )
    .unwrap();
    assert_eq!(older.nccl, None);
    let done: OpDone = serde_json::from_str(
        r#"{"op":"pause","allocations":1,"bytes":2,"copied_bytes":0,"seconds":0.5}"#,
    )
    .unwrap();
    assert_eq!(done.communicators, 0);
}

#[test]
fn replies_round_trip() {
    let status = Status {
        pid: 7,
        backend: "sim".into(),
        devices: vec![DeviceMemory {
            device: 0,
            free_bytes: 1 << 30,
            total_bytes: 8 << 30,
            error: None,
        }],
        tags: vec![TagStatus {
            tag: "kv".into(),
            allocations: 2,
            bytes_active: 4 << 20,
            last_pause: Some(OpTiming {
                allocations: 2,
                bytes: 4 << 20,
                copied_bytes: 4 << 20,
                seconds: 0.5,
                gib_per_s: 0.0078125,
            }),
            ..Default::default()
        }],
        default_region: Some(RegionInfo {
            enabled: true,
            tag: "default".into(),
            cpu_backup: false,
            backend: BackupBackend::Pinned,
            disk_backup: false,
        }),
        ..Default::default()
    };
    let replies = [
        Reply::Hello(Hello {
            backend: Some("sim".into()),
            ..hello()
        }),
        Reply::Pong { pid: 3 },
        Reply::Status(Box::new(status)),
        Reply::Done(OpDone {
            op: Op::Pause,
            tag: Some("kv".into()),
            chunks: Some(vec![[1, 2]]),
            allocations: 1,
            bytes: 2 << 20,
            copied_bytes: 0,
            disk_copied_bytes: Some(0),
            seconds: 0.25,
            unknown_tag: false,
            pending_bytes: 0,
            communicators: 0,
            unchanged_bytes: 0,
            verified_bytes: 0,
        }),
        Reply::Done(OpDone {
            op: Op::Resume,
            tag: Some("kv".into()),
            chunks: None,
            allocations: 2,
            bytes: 4 << 20,
            copied_bytes: 0,
            disk_copied_bytes: Some(0),
            seconds: 0.01,
            unknown_tag: false,
            pending_bytes: 3 << 20,
            communicators: 0,
            unchanged_bytes: 0,
            verified_bytes: 1 << 20,
        }),
        Reply::Chunks(ChunkStatus {
            tag: "kv".into(),
            addr: 0x7f00_0000_0000,
            chunk_size: 2 << 20,
            count: 4,
            states: "1001".into(),
        }),
        Reply::error(ErrorKind::OutOfMemory, "out of memory: resume"),
    ];
    for r in replies {
        let line = encode(&r);
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(decode_reply(&line).unwrap(), r);
    }
}

/// What a failed pause or resume changed travels in its error reply; a server that predates
/// it sends none (read as not said, never as nothing changed), and a client that predates it
/// reads the reply as before.
#[test]
fn what_a_failed_operation_changed_travels_and_older_peers_still_decode() {
    let changed = Changed {
        allocations: 1,
        bytes: 2 << 20,
        communicators: 0,
    };
    let r = Reply::Error(ErrorReply {
        kind: ErrorKind::Driver,
        message: "cuMemcpyDtoH failed".into(),
        changed: Some(changed),
    });
    let line = encode(&r);
    let text = String::from_utf8(line.clone()).unwrap();
    assert!(
        text.contains("\"changed\":{\"allocations\":1,\"bytes\":2097152}"),
        "{text}"
    );
    assert_eq!(decode_reply(&line), Ok(r));
    let nothing = Reply::Error(ErrorReply {
        kind: ErrorKind::OutOfMemory,
        message: "m".into(),
        changed: Some(Changed::default()),
    });
    let line = encode(&nothing);
    assert!(String::from_utf8(line.clone())
        .unwrap()
        .contains("\"changed\":{"));
    assert_eq!(decode_reply(&line), Ok(nothing));
    // A server that predates it.
    let old = decode_reply(b"{\"reply\":\"error\",\"kind\":\"driver\",\"message\":\"m\"}");
    let Ok(Reply::Error(e)) = old else {
        panic!("{old:?}")
    };
    assert_eq!(e.changed, None);
    // A client that predates it: its error reply had a kind and a message only.
    #[derive(serde::Deserialize)]
    #[serde(tag = "reply", rename_all = "snake_case")]
    enum OldReply {
        Error { kind: ErrorKind, message: String },
    }
    let OldReply::Error { kind, message } = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (kind, message.as_str()),
        (ErrorKind::Driver, "cuMemcpyDtoH failed")
    );
    assert!(changed.communicators == 0 && !changed.is_nothing());
    assert!(Changed::default().is_nothing());
}

#[test]
fn unknown_error_kinds_of_a_newer_server_decode() {
    let r = decode_reply(b"{\"reply\":\"error\",\"kind\":\"quota\",\"message\":\"m\"}").unwrap();
    assert_eq!(r, Reply::error(ErrorKind::Unknown, "m"));
}

#[test]
fn line_buffer_splits_and_limits() {
    let mut b = LineBuffer::new(8);
    b.push(b"ab\ncd");
    assert_eq!(b.next_line(), Some(Ok(b"ab".to_vec())));
    assert_eq!(b.next_line(), None);
    assert_eq!(b.pending(), 2);
    b.push(b"\n\n");
    assert_eq!(b.next_line(), Some(Ok(b"cd".to_vec())));
    assert_eq!(b.next_line(), Some(Ok(Vec::new())));
    b.push(b"12345678");
    assert_eq!(b.next_line(), None);
    b.push(b"\n");
    assert_eq!(b.next_line(), Some(Ok(b"12345678".to_vec())));
    b.push(b"123456789");
    assert!(matches!(
        b.next_line(),
        Some(Err(ProtoError::TooLong { .. }))
    ));
}

#[test]
fn socket_naming() {
    let p = |s: &str| pid_of_socket_file(s);
    assert_eq!(p("1234.sock"), Some(1234));
    for bad in [
        ".sock",
        "0.sock",
        "01.sock",
        "-1.sock",
        "12.sock.tmp",
        ".12.sock",
        "x.sock",
        "99999999999.sock",
    ] {
        assert_eq!(p(bad), None, "{bad}");
    }
    assert_eq!(p(&socket_file_name(77)), Some(77));
    assert_eq!(p("1234.4026531836.sock"), Some(1234));
    for bad in [
        "1.0.sock",
        "1..sock",
        "1.x.sock",
        "1.2.3.sock",
        "2147483648.5.sock",
    ] {
        assert_eq!(SocketName::parse(bad), None, "{bad}");
    }
    let named = SocketName {
        pid: 9,
        pidns: Some(4026531836),
    };
    assert_eq!(SocketName::parse(&named.file_name()), Some(named));
    let ours = SocketName::parse(&socket_file_name(5)).unwrap();
    assert_eq!(ours.pidns, pid_namespace());
    assert!(ours.pidns.is_some(), "Linux has /proc/self/ns/pid");
    let some = |s: &str| Some(OsString::from(s));
    let xdg = tempfile::tempdir().unwrap();
    let me = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(xdg.path()).unwrap());
    let xdg_s = xdg.path().to_str().unwrap();
    assert_eq!(socket_dir(some("/s"), some(xdg_s), me), PathBuf::from("/s"));
    assert_eq!(
        socket_dir(some(""), some(xdg_s), me),
        xdg.path().join("tms")
    );
    // An $XDG_RUNTIME_DIR of another user's, missing or no folder is passed over.
    let other = me.wrapping_add(1);
    assert_eq!(
        socket_dir(None, some(xdg_s), other),
        PathBuf::from(format!("/tmp/tms-{other}"))
    );
    let missing = xdg.path().join("gone");
    assert_eq!(
        socket_dir(None, Some(missing.into_os_string()), me),
        PathBuf::from(format!("/tmp/tms-{me}"))
    );
    let file = xdg.path().join("file");
    std::fs::write(&file, b"").unwrap();
    assert_eq!(
        socket_dir(None, Some(file.into_os_string()), me),
        PathBuf::from(format!("/tmp/tms-{me}"))
    );
    assert_eq!(socket_dir(None, some(""), 5), PathBuf::from("/tmp/tms-5"));
    assert_eq!(socket_dir(None, None, 0), PathBuf::from("/tmp/tms-0"));
}

// --- property tests ------------------------------------------------------------------------
//
// Case counts are fixed here (not taken from PROPTEST_CASES) so every run does the same amount
// of work: 4096 + 2048 + 1024 + 512 + 512 = 8192 generated cases per `cargo test`.

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    /// Arbitrary bytes: the decoder returns (it never panics), and what it accepts is a
    /// request that encodes to a line it accepts again.
    #[test]
    fn decoder_never_panics_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(r) = decode_request(&bytes) {
            prop_assert_eq!(decode_request(&encode(&r)), Ok(r));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// Valid requests with bytes flipped, cut or inserted: closer to what a fuzzer would reach
    /// than random bytes.
    #[test]
    fn decoder_never_panics_on_mutated_requests(
        req in arb_request(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6),
    ) {
        let mut line = encode(&req);
        for (at, byte, how) in edits {
            if line.is_empty() {
                line.push(byte);
                continue;
            }
            let i = at.index(line.len());
            match how {
                0 => line[i] = byte,
                1 => line.truncate(i),
                _ => line.insert(i, byte),
            }
        }
        let _ = decode_request(&line);
        let _ = decode_reply(&line);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Every request survives encode then decode.
    #[test]
    fn requests_round_trip(req in arb_request()) {
        let line = encode(&req);
        prop_assert_eq!(line.iter().filter(|b| **b == b'\n').count(), 1);
        prop_assert_eq!(decode_request(&line), Ok(req));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// However a stream of lines is cut into reads, the buffer yields the same lines.
    #[test]
    fn line_buffer_is_independent_of_chunking(
        lines in prop::collection::vec(prop::collection::vec(any::<u8>().prop_filter("no newline", |b| *b != b'\n'), 0..40), 0..8),
        cuts in prop::collection::vec(1usize..17, 1..64),
    ) {
        let mut stream = Vec::new();
        for l in &lines {
            stream.extend_from_slice(l);
            stream.push(b'\n');
        }
        let mut b = LineBuffer::new(64);
        let mut got = Vec::new();
        let mut rest = &stream[..];
        let mut cuts = cuts.iter().cycle();
        while !rest.is_empty() {
            let n = (*cuts.next().unwrap_or(&1)).min(rest.len());
            b.push(&rest[..n]);
            rest = &rest[n..];
            while let Some(l) = b.next_line() {
                got.push(l.unwrap());
            }
        }
        prop_assert_eq!(got, lines);
        prop_assert_eq!(b.pending(), 0);
    }

    /// A line over the limit is reported as soon as more than the limit has arrived.
    #[test]
    fn line_buffer_reports_long_lines(len in 65usize..300, chunk in 1usize..50) {
        let data = vec![b'x'; len];
        let mut b = LineBuffer::new(64);
        let mut seen = 0;
        let mut reported = None;
        for c in data.chunks(chunk) {
            b.push(c);
            seen += c.len();
            if let Some(r) = b.next_line() {
                prop_assert!(r.is_err());
                reported = Some(seen);
                break;
            }
        }
        let at = reported.expect("reported");
        prop_assert!(at > 64 && at < 65 + chunk);
    }
}

#[test]
fn region_replies_of_older_servers_still_parse() {
    // Before disk backups were reported: no `disk_backup`, read as none.
    let r = decode_reply(
        br#"{"reply":"region","enabled":true,"tag":"t","cpu_backup":true,"backend":"mmap"}"#,
    )
    .unwrap();
    let Reply::Region(r) = r else { panic!("{r:?}") };
    assert!(!r.disk_backup && r.cpu_backup);
    // A client that does not touch it sends no `disk_backup`, which older servers would refuse.
    let line = String::from_utf8(encode(&Request::SetRegion(RegionUpdate {
        cpu_backup: Some(true),
        ..Default::default()
    })))
    .unwrap();
    assert!(!line.contains("disk_backup"), "{line}");
}

#[test]
fn requests_of_older_clients_still_parse() {
    // Before chunks: no `chunks`, no `chunk_state`.
    for (l, want) in [
        (&b"{\"op\":\"pause\"}"[..], pause(None)),
        (b"{\"op\":\"pause\",\"tag\":\"kv\"}", pause(Some("kv"))),
        (
            b"{\"op\":\"resume\",\"tag\":\"kv\"}",
            Request::Resume {
                tag: Some("kv".into()),
                chunks: None,
                chunk_state: false,
                job_record: false,
                no_wait: false,
                verify: false,
            },
        ),
        (
            b"{\"op\":\"pause\",\"tag\":\"kv\",\"chunks\":null,\"chunk_state\":false}",
            pause(Some("kv")),
        ),
    ] {
        assert_eq!(
            decode_request(l),
            Ok(want),
            "{}",
            String::from_utf8_lossy(l)
        );
    }
    assert_eq!(
        decode_request(b"{\"op\":\"pause\",\"tag\":\"kv\",\"chunks\":[[0,3],[9,9]]}"),
        Ok(Request::Pause {
            tag: Some("kv".into()),
            chunks: Some(vec![[0, 3], [9, 9]]),
            chunk_state: false,
            job_record: false,
        })
    );
}

#[test]
fn replies_of_older_servers_still_decode() {
    // A hello without features, a tag status without partial allocations, a done without
    // chunks: what servers that predate chunks send.
    let r = decode_reply(
        b"{\"reply\":\"hello\",\"protocol\":1,\"pid\":9,\"software\":\"libtms 0.1.0\",\
          \"backend\":\"sim\"}",
    );
    let Ok(Reply::Hello(h)) = r else {
        panic!("{r:?}")
    };
    assert!(h.features.is_empty() && !h.has(FEATURE_CHUNKS));
    let r = decode_reply(
        b"{\"reply\":\"status\",\"pid\":9,\"backend\":\"sim\",\"retain_cpu_backup\":false,\
          \"memory_margin_bytes\":0,\"devices\":[],\"tags\":[{\"tag\":\"kv\",\"allocations\":1,\
          \"active_allocations\":1,\"paused_allocations\":0,\"bytes_requested\":1,\
          \"bytes_active\":2097152,\"bytes_paused\":0,\"host_backup_bytes\":0}]}",
    );
    let Ok(Reply::Status(s)) = r else {
        panic!("{r:?}")
    };
    assert_eq!(s.tags[0].partial_allocations, 0);
    let r = decode_reply(
        b"{\"reply\":\"done\",\"op\":\"pause\",\"allocations\":1,\"bytes\":2,\"copied_bytes\":0,\
          \"seconds\":0.5}",
    );
    let Ok(Reply::Done(d)) = r else {
        panic!("{r:?}")
    };
    assert_eq!(d.chunks, None);
    // And this version's hello, read by an older client that knows no features, keeps its
    // other fields: features are only added.
    let mine = Hello {
        features: vec![FEATURE_CHUNKS.into()],
        backend: Some("sim".into()),
        ..hello()
    };
    let line = String::from_utf8(encode(&Reply::Hello(mine.clone()))).unwrap();
    assert!(line.contains("\"features\":[\"chunks\"]"), "{line}");
    assert!(mine.has(FEATURE_CHUNKS));
    assert_eq!(decode_reply(line.as_bytes()), Ok(Reply::Hello(mine)));
    // Without features, the hello is what it always was.
    let plain = String::from_utf8(encode(&Reply::Hello(hello()))).unwrap();
    assert!(!plain.contains("features"), "{plain}");
    // partial_allocations is always sent (a count, like the others).
    let line = String::from_utf8(encode(&TagStatus::default())).unwrap();
    assert!(line.contains("\"partial_allocations\":0"), "{line}");
}

/// Chunk ranges on the wire (what they are: `tms_units::runs`, with its own tests).
#[test]
fn chunk_ranges_on_the_wire() {
    // A request naming a million chunks in ranges fits a line.
    let every_other: Vec<usize> = (0..MAX_CHUNK_INDICES).step_by(2).take(2000).collect();
    let r = Request::Pause {
        tag: Some("kv".into()),
        chunks: Some(chunk_ranges(&every_other)),
        chunk_state: false,
        job_record: false,
    };
    assert!(encode(&r).len() < MAX_LINE_BYTES);
    let all = Request::Pause {
        tag: Some("kv".into()),
        chunks: Some(vec![[0, MAX_CHUNK_INDICES as u64 - 1]]),
        chunk_state: false,
        job_record: false,
    };
    assert_eq!(decode_request(&encode(&all)), Ok(all));
}

#[test]
fn chunk_status_states() {
    let s = ChunkStatus {
        count: 6,
        states: ChunkStatus::states_of(&[true, false, false, true, true, false]),
        ..Default::default()
    };
    assert_eq!(s.states, "100110");
    assert_eq!(s.active(), vec![0, 3, 4]);
    assert_eq!(s.paused(), vec![1, 2, 5]);
    assert_eq!(format_ranges(&s.paused()), "1-2,5");
    // Half a million chunks take about half a megabyte.
    let big = ChunkStatus {
        tag: "kv".into(),
        count: 512 << 10,
        states: ChunkStatus::states_of(&vec![true; 512 << 10]),
        ..Default::default()
    };
    let line = encode(&Reply::Chunks(big.clone()));
    assert!(line.len() < (512 << 10) + 200, "{}", line.len());
    assert_eq!(decode_reply(&line), Ok(Reply::Chunks(big)));
}

#[test]
fn progress_of_running_operations_round_trips_and_older_servers_still_decode() {
    let mut r = Running::new(Op::Pause, Some("kv".into()), None, 3.5);
    // What servers that predate progress send: no new field on the wire.
    let line = String::from_utf8(encode(&r)).unwrap();
    assert_eq!(line, "{\"op\":\"pause\",\"tag\":\"kv\",\"seconds\":3.5}\n");
    r.phase = Some(Phase::WritingToDisk);
    r.bytes_total = Some(64 << 30);
    r.bytes_done = Some(12 << 30);
    r.backing = Some(Backing::Disk);
    r.gib_per_s = Some(1.6);
    let waiting = Running {
        in_process: false,
        phase: Some(Phase::Waiting),
        ..Running::new(Op::Resume, None, Some(vec![[0, 3]]), 0.5)
    };
    let api = Running {
        in_process: true,
        phase: Some(Phase::CopyingToDevice),
        bytes_total: Some(8),
        bytes_done: Some(2),
        backing: Some(Backing::HostAndDisk),
        ..Running::new(Op::Resume, None, None, 1.0)
    };
    let status = Status {
        operations: vec![r.clone(), waiting, api],
        ..Default::default()
    };
    let line = encode(&Reply::Status(Box::new(status.clone())));
    let text = String::from_utf8(line.clone()).unwrap();
    assert!(
        text.contains(
            "\"phase\":\"writing_to_disk\",\"bytes_total\":68719476736,\
             \"bytes_done\":12884901888,\"backing\":\"disk\",\"gib_per_s\":1.6"
        ),
        "{text}"
    );
    assert!(text.contains("\"in_process\":true"), "{text}");
    assert!(text.contains("\"backing\":\"host_and_disk\""), "{text}");
    assert_eq!(decode_reply(&line), Ok(Reply::Status(Box::new(status))));
    // An operation of a server that predates progress: none of it, and nothing else changes.
    let Ok(Reply::Status(s)) = decode_reply(
        b"{\"reply\":\"status\",\"pid\":9,\"backend\":\"sim\",\"retain_cpu_backup\":false,\
          \"memory_margin_bytes\":0,\"devices\":[],\"tags\":[],\
          \"operations\":[{\"op\":\"pause\",\"tag\":\"kv\",\"seconds\":1.2}]}",
    ) else {
        panic!()
    };
    assert_eq!(
        s.operations,
        vec![Running::new(Op::Pause, Some("kv".into()), None, 1.2)]
    );
    // A phase or a backing a newer server adds reads as unknown, not as an error.
    let Ok(Reply::Status(s)) = decode_reply(
        b"{\"reply\":\"status\",\"pid\":9,\"backend\":\"sim\",\"retain_cpu_backup\":false,\
          \"memory_margin_bytes\":0,\"devices\":[],\"tags\":[],\"operations\":[{\"op\":\"pause\",\
          \"seconds\":1.2,\"phase\":\"defragmenting\",\"backing\":\"tape\"}]}",
    ) else {
        panic!()
    };
    assert_eq!(s.operations[0].phase, Some(Phase::Unknown));
    assert_eq!(s.operations[0].backing, Some(Backing::Unknown));
    assert_eq!(Phase::ReadingFromDisk.as_str(), "reading_from_disk");
    // A done of an older server does not say where the copies went.
    let Ok(Reply::Done(d)) = decode_reply(
        b"{\"reply\":\"done\",\"op\":\"pause\",\"allocations\":1,\"bytes\":2,\
          \"copied_bytes\":2,\"seconds\":0.5}",
    ) else {
        panic!()
    };
    assert_eq!(d.disk_copied_bytes, None);
    let hello = Hello {
        features: vec![FEATURE_PROGRESS.into()],
        ..hello()
    };
    assert!(hello.has(FEATURE_PROGRESS) && !hello.has(FEATURE_CHUNKS));
}

/// Issue 36, item 5: a reply with a negative or non-finite duration or rate is refused, not
/// printed as a result.
#[test]
fn replies_with_impossible_durations_are_refused() {
    for seconds in ["-1.5", "-0.001"] {
        let line = format!(
            "{{\"reply\":\"done\",\"op\":\"pause\",\"allocations\":1,\"bytes\":1,\"copied_bytes\":0,\"seconds\":{seconds}}}"
        );
        let e = decode_reply(line.as_bytes()).unwrap_err().to_string();
        assert!(
            e.contains("seconds is") && e.contains("not a duration"),
            "{e}"
        );
    }
    let ok = b"{\"reply\":\"done\",\"op\":\"pause\",\"allocations\":1,\"bytes\":1,\"copied_bytes\":0,\"seconds\":0.25}";
    assert!(decode_reply(ok).is_ok());
    let status = b"{\"reply\":\"status\",\"pid\":1,\"backend\":\"sim\",\"retain_cpu_backup\":false,\"memory_margin_bytes\":0,\"devices\":[],\"tags\":[{\"tag\":\"kv\",\"allocations\":1,\"active_allocations\":1,\"paused_allocations\":0,\"bytes_requested\":1,\"bytes_active\":1,\"bytes_paused\":0,\"host_backup_bytes\":0,\"last_pause\":{\"allocations\":1,\"bytes\":1,\"copied_bytes\":0,\"seconds\":-3.0,\"gib_per_s\":1.0}}]}";
    let e = decode_reply(status).unwrap_err().to_string();
    assert!(e.contains("last_pause is -3"), "{e}");
}

/// `ALL` lists each variant once, in order: the matches, exhaustive, fail to build until a new
/// variant is given its place (the property tests draw kinds and phases from `ALL`).
#[test]
fn all_lists_every_kind_and_phase_once() {
    use crate::{ErrorKind as K, Phase as P};
    for (i, k) in K::ALL.into_iter().enumerate() {
        let at = match k {
            K::BadRequest => 0,
            K::LineTooLong => 1,
            K::Timeout => 2,
            K::VersionMismatch => 3,
            K::HelloRequired => 4,
            K::PermissionDenied => 5,
            K::OutOfMemory => 6,
            K::InvalidArgument => 7,
            K::InvalidState => 8,
            K::NotFound => 9,
            K::Driver => 10,
            K::Unsupported => 11,
            K::Io => 12,
            K::Internal => 13,
            K::Busy => 14,
            K::Unknown => 15,
        };
        assert_eq!(at, i, "{k:?}");
    }
    for (i, p) in P::ALL.into_iter().enumerate() {
        let at = match p {
            P::Waiting => 0,
            P::Preparing => 1,
            P::Synchronizing => 2,
            P::Mapping => 3,
            P::CopyingToHost => 4,
            P::WritingToDisk => 5,
            P::ReadingFromDisk => 6,
            P::CopyingToDevice => 7,
            P::Releasing => 8,
            P::Unknown => 9,
        };
        assert_eq!(at, i, "{p:?}");
    }
}
