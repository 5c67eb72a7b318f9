//! Chunked allocations through the server: pause and resume of chunks, bad chunk requests,
//! and chunk lists too long to send as indices.

use super::*;

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
            job_record: false,
        },
        Op::Resume => Request::Resume {
            tag,
            chunks,
            chunk_state: false,
            job_record: false,
            no_wait: false,
            verify: false,
        },
    }
}

fn states(c: &mut Conn, tag: &str) -> String {
    match c.ask(&Request::Chunks { tag: tag.into() }) {
        Reply::Chunks(s) => s.states,
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
        job_record: false,
    }));
    assert_eq!(d.bytes, 6 << 20);
    assert_eq!(states(&mut c, "kv"), "0000");
    let d = done(c.ask(&Request::Resume {
        tag: Some("kv".into()),
        chunks: None,
        chunk_state: true,
        job_record: false,
        no_wait: false,
        verify: false,
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
    h.alloc(2 << 20, "plain", None);
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
            job_record: false,
        },
        Request::Resume {
            tag: None,
            chunks: Some(vec![[0, 0]]),
            chunk_state: false,
            job_record: false,
            no_wait: false,
            verify: false,
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
            job_record: false,
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
    // Every chunk, a million times over: refused by count, not by line length.
    let many = vec![[0u64, 3]; 300_000];
    assert!(encode(&chunk_op(Op::Pause, "kv", &many)).len() > MAX_LINE_BYTES);
    // Greeted only now: encoding that list can take longer than the server waits for a
    // request (2 s) on a loaded machine, which then closes the connection.
    let mut c = Conn::greeted(h);
    let some = vec![[0u64, 3]; 2000];
    let r = c.ask(&chunk_op(Op::Pause, "kv", &some));
    // 8000 indices counted before duplicates go: within the bound, so it is done.
    assert_eq!(done(r).bytes, 8 << 20);
    assert_eq!(states(&mut c, "kv"), "0000");
    done(c.ask(&resume(None)));
    assert_contents(h, ptr, &data);
}
