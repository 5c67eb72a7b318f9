//! Hostile input: lines a broken or foreign peer may send, and peers that misbehave on the
//! socket. Each test states what the protocol does with them; none may panic or hang.

use std::io::Write;
use std::iter::repeat_n;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::generators::{arb_reply, arb_request};
use super::*;

/// How long a test waits before it calls a read hung: far beyond any wait the tests give a
/// read, so that only a hang fails it, never a slow machine.
const HANG: Duration = Duration::from_secs(10);

/// The stack of the server's connection threads (`CONN_STACK` of libtms's control server),
/// where requests are decoded.
const SERVER_STACK: usize = 2 << 20;

/// What `f` returns, run on a thread with the server's stack; a failure if it has not returned
/// within [`HANG`].
fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::Builder::new()
        .stack_size(SERVER_STACK)
        .spawn(move || {
            let _ = tx.send(f());
        })
        .unwrap();
    match rx.recv_timeout(HANG) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("no answer within {HANG:?}: it hangs"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("it panicked"),
    }
}

/// The message of the error `line` is refused with, as a request.
fn refused(line: &[u8]) -> String {
    match decode_request(line) {
        Ok(r) => panic!("{:?} decoded: {r:?}", String::from_utf8_lossy(line)),
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::BadRequest, "{e}");
            e.to_string()
        }
    }
}

/// The message of the error `line` is refused with, as a reply.
fn refused_reply(line: &[u8]) -> String {
    match decode_reply(line) {
        Ok(r) => panic!("{:?} decoded: {r:?}", String::from_utf8_lossy(line)),
        Err(e) => e.to_string(),
    }
}

fn assert_says(msg: &str, line: &[u8], says: &str) {
    assert!(
        msg.contains(says),
        "{:?}: {msg:?} does not say {says:?}",
        String::from_utf8_lossy(line)
    );
}

// --- limits -----------------------------------------------------------------------------------

/// A pause request line of exactly `len` bytes (its tag fills it).
fn request_of_len(len: usize) -> Vec<u8> {
    let mut l = br#"{"op":"pause","tag":""#.to_vec();
    l.resize(len - 2, b'a');
    l.extend_from_slice(b"\"}");
    l
}

/// The limit counts every byte but the `\n`, a `\r` before it too, and the buffer that splits
/// the stream into lines and the decoder agree on it: what one passes, the other does not
/// refuse as too long.
#[test]
fn the_line_limit_is_exact_and_the_buffer_and_decoder_agree() {
    let max = MAX_LINE_BYTES;
    for (len, cr) in [(max - 1, true), (max, false), (max, true), (max + 1, false)] {
        let fits = len + usize::from(cr) <= max;
        let mut line = request_of_len(len);
        line.extend_from_slice(if cr { b"\r\n" } else { b"\n" });
        let what = format!("{len} bytes, then {:?}", if cr { "\r\n" } else { "\n" });
        let decoded = decode_request(&line).map(|_| ());
        let mut buf = LineBuffer::new(max);
        buf.push(&line);
        let split = buf.next_line().expect("a whole line is a line or an error");
        if fits {
            assert_eq!(decoded, Ok(()), "{what}");
            assert_eq!(
                decode_request(&split.unwrap()).map(|_| ()),
                decoded,
                "{what}"
            );
            continue;
        }
        let refusals = [
            decoded.expect_err(&format!("{what}: decoded")),
            split.expect_err(&format!("{what}: split off as a line")),
        ];
        for e in refusals {
            assert!(
                matches!(e, ProtoError::TooLong { len, max: m } if len > max && m == max),
                "{what}: {e:?}"
            );
            assert_says(&e.to_string(), &[], "over the limit of 65536");
        }
    }
}

/// A reply may be as long as its limit, and not a byte longer.
#[test]
fn the_reply_limit_is_exact() {
    let base = encode(&Reply::error(ErrorKind::Internal, "")).len() - 1;
    let of_len = |len: usize| encode(&Reply::error(ErrorKind::Internal, "m".repeat(len - base)));
    assert!(decode_reply(&of_len(MAX_REPLY_BYTES)).is_ok());
    let over = MAX_REPLY_BYTES + 1;
    assert_eq!(
        decode_reply(&of_len(over)),
        Err(ProtoError::TooLong {
            len: over,
            max: MAX_REPLY_BYTES
        })
    );
}

/// Bytes pushed one at a time: the limit is reported at the first byte over it, not before,
/// and stays reported: no later newline turns the rest of that line into a request.
#[test]
fn one_byte_at_a_time_the_limit_is_reported_at_the_first_byte_over() {
    let mut buf = LineBuffer::new(MAX_LINE_BYTES);
    for _ in 0..MAX_LINE_BYTES {
        buf.push(b"x");
        assert_eq!(buf.next_line(), None);
    }
    buf.push(b"x");
    let too_long = ProtoError::TooLong {
        len: MAX_LINE_BYTES + 1,
        max: MAX_LINE_BYTES,
    };
    assert_eq!(buf.next_line(), Some(Err(too_long)));
    buf.push(b"\n{\"op\":\"ping\"}\n");
    assert!(matches!(
        buf.next_line(),
        Some(Err(ProtoError::TooLong { .. }))
    ));
}

// --- the socket -------------------------------------------------------------------------------

/// Each byte is written only once the reader asks for more, so every read brings one byte:
/// the frame still arrives whole, and took one read per byte.
#[test]
fn a_frame_split_into_one_byte_reads_arrives_whole() {
    let req = Request::Pause {
        tag: Some("kv".into()),
        chunks: Some(vec![[8, 15]]),
        chunk_state: false,
        job_record: false,
    };
    let line = encode(&req);
    let (r, mut w) = UnixStream::pair().unwrap();
    let (ask, asked) = mpsc::channel::<()>();
    let bytes = line.clone();
    let writer = thread::spawn(move || {
        for b in bytes {
            if asked.recv().is_err() {
                break;
            }
            w.write_all(&[b]).unwrap();
        }
    });
    let (got, reads) = bounded(move || {
        let mut buf = LineBuffer::new(MAX_LINE_BYTES);
        let mut reads = 0;
        let got = buf.read_line(&r, || {
            reads += 1;
            let _ = ask.send(());
            Some(HANG / 2)
        });
        (got, reads)
    });
    assert_eq!(decode_request(&got.unwrap()), Ok(req));
    assert_eq!(reads, line.len());
    writer.join().unwrap();
}

/// A peer that sends one endless line: the read stops at the limit, at most one read past
/// it, rather than buffering whatever the peer sends.
#[test]
fn an_endless_line_is_cut_off_at_the_limit() {
    let (r, mut w) = UnixStream::pair().unwrap();
    let writer = thread::spawn(move || {
        let junk = [b'x'; 4096];
        let mut sent = 0;
        // Until the reader hangs up.
        while w.write_all(&junk).is_ok() {
            sent += junk.len();
        }
        sent
    });
    let (fault, pending) = bounded(move || {
        let mut buf = LineBuffer::new(MAX_LINE_BYTES);
        let fault = buf.read_line(&r, || Some(HANG / 2));
        (fault, buf.pending())
    });
    match fault {
        Err(ReadFault::TooLong(e)) => assert_eq!(e.kind(), ErrorKind::LineTooLong),
        other => panic!("{other:?}"),
    }
    // One read brings at most 16 KiB.
    assert!(pending > MAX_LINE_BYTES && pending <= MAX_LINE_BYTES + (16 << 10));
    let sent = bounded(move || writer.join().unwrap());
    assert!(sent >= pending);
}

#[test]
fn eof_in_the_middle_of_a_line_is_closed_with_its_bytes_pending() {
    let (r, mut w) = UnixStream::pair().unwrap();
    w.write_all(b"{\"op\":\"ping\"}\n{\"op\":\"sta").unwrap();
    drop(w);
    let mut buf = LineBuffer::new(MAX_LINE_BYTES);
    // The longest wait there is is taken as one (not refused as a timeout std cannot set).
    let line = buf.read_line(&r, || Some(Duration::MAX)).unwrap();
    assert_eq!(decode_request(&line), Ok(Request::Ping));
    let fault = buf.read_line(&r, || Some(HANG / 2));
    assert!(
        matches!(fault, Err(ReadFault::Closed { pending: 10 })),
        "{fault:?}"
    );
    let (r, w) = UnixStream::pair().unwrap();
    drop(w);
    let fault = LineBuffer::new(MAX_LINE_BYTES).read_line(&r, || Some(HANG / 2));
    assert!(
        matches!(fault, Err(ReadFault::Closed { pending: 0 })),
        "{fault:?}"
    );
}

/// A peer that stops in the middle of a line and stays connected: each read waits as long as
/// it is given and no longer (quiet), a caller's deadline ends the reads (expired), and the
/// bytes of the line are kept for when the rest comes.
#[test]
fn a_silent_peer_ends_each_read_at_its_wait() {
    let (r, mut w) = UnixStream::pair().unwrap();
    w.write_all(b"{\"op\":").unwrap();
    let (r, mut buf) = bounded(move || {
        let mut buf = LineBuffer::new(MAX_LINE_BYTES);
        let fault = buf.read_line(&r, || Some(Duration::from_millis(50)));
        assert!(matches!(fault, Err(ReadFault::Quiet)), "{fault:?}");
        // A zero wait is the shortest, not none at all (a zero timeout is none to the OS).
        let fault = buf.read_line(&r, || Some(Duration::ZERO));
        assert!(matches!(fault, Err(ReadFault::Quiet)), "{fault:?}");
        let deadline = Instant::now() + Duration::from_millis(100);
        let left =
            || Some(deadline.saturating_duration_since(Instant::now())).filter(|l| !l.is_zero());
        loop {
            match buf.read_line(&r, left) {
                Err(ReadFault::Quiet) => {}
                Err(ReadFault::Expired) => break,
                other => panic!("{other:?}"),
            }
        }
        (r, buf)
    });
    assert_eq!(buf.pending(), 6);
    w.write_all(b"\"ping\"}\n").unwrap();
    let line = buf.read_line(&r, || Some(HANG / 2)).unwrap();
    assert_eq!(decode_request(&line), Ok(Request::Ping));
}

// --- contents ---------------------------------------------------------------------------------

#[test]
fn empty_lines_are_refused_as_empty() {
    for l in [&b""[..], b"\n", b"\r\n", b"\r", b" \t \r\n"] {
        assert_eq!(decode_request(l), Err(ProtoError::Empty));
        assert_eq!(decode_reply(l), Err(ProtoError::Empty));
        assert_eq!(refused(l), "empty line");
    }
}

/// Invalid UTF-8 anywhere, and escapes that make no character, are refused by the parser,
/// which says where.
#[test]
fn invalid_utf8_is_refused_wherever_it_is() {
    for l in [
        &b"{\"op\":\"pause\",\"tag\":\"\xff\"}"[..],
        // An overlong '/', a surrogate encoded as UTF-8, a character cut short.
        b"{\"op\":\"pause\",\"tag\":\"\xc0\xaf\"}",
        b"{\"op\":\"pause\",\"tag\":\"\xed\xa0\x80\"}",
        b"{\"op\":\"pause\",\"tag\":\"\xe2\x82\"}",
        b"{\"op\":\"pause\",\"\xff\":\"kv\"}",
        b"{\"op\":\"pa\xffuse\"}",
        b"{\"op\":\"pause\",\"tag\":\"\\ud800\"}",
        b"{\"op\":\"pause\",\"tag\":\"\\udc00x\"}",
        b"\xef\xbb\xbf{\"op\":\"ping\"}",
        b"\xff{\"op\":\"ping\"}",
    ] {
        assert_says(&refused(l), l, "column");
    }
    let l = b"{\"reply\":\"error\",\"kind\":\"io\",\"message\":\"\xff\"}";
    assert_says(&refused_reply(l), l, "at line 1 column");
}

/// A raw NUL is not JSON (a control character in a string, or no value at all); an escaped
/// one is a character of a tag like any other, and goes back escaped: no raw NUL or newline
/// ever leaves the encoder inside a line.
#[test]
fn nul_bytes_raw_are_refused_and_escaped_are_characters() {
    for l in [
        &b"\0"[..],
        b"\0{\"op\":\"ping\"}",
        b"{\"op\":\"ping\"}\0",
        b"{\"op\":\"ping\"\0}",
        b"{\"op\":\"pause\",\"tag\":\"a\0b\"}",
    ] {
        refused(l);
    }
    assert_says(
        &refused(b"{\"op\":\"pause\",\"tag\":\"a\0b\"}"),
        b"",
        "control character",
    );
    let tagged = Request::Chunks {
        tag: "a\0b\n".into(),
    };
    assert_eq!(
        decode_request(br#"{"op":"chunks","tag":"a\u0000b\n"}"#),
        Ok(tagged.clone())
    );
    let line = encode(&tagged);
    assert!(!line[..line.len() - 1]
        .iter()
        .any(|b| *b == 0 || *b == b'\n'));
    assert_eq!(decode_request(&line), Ok(tagged));
}

/// Every cut of a message short of its end is refused as the end of input it is.
#[test]
fn every_truncation_of_a_message_is_refused() {
    let requests = [
        Request::Hello(Hello {
            protocol: PROTOCOL_VERSION,
            pid: 42,
            software: "tmsctl 0.1.0".into(),
            backend: None,
            features: vec![],
        }),
        Request::Ping,
        Request::Resume {
            tag: Some("kv".into()),
            chunks: Some(vec![[0, 3], [9, 9]]),
            chunk_state: true,
            job_record: true,
            no_wait: true,
            verify: true,
        },
        Request::SetRegion(RegionUpdate {
            enabled: Some(false),
            backend: Some(BackupBackend::Pinned),
            ..Default::default()
        }),
    ];
    let replies = [
        Reply::Pong { pid: 7 },
        Reply::error(ErrorKind::Busy, "full"),
        Reply::Chunks(ChunkStatus {
            tag: "kv".into(),
            addr: 1 << 40,
            chunk_size: 2 << 20,
            count: 3,
            states: "101".into(),
        }),
    ];
    let lines = requests
        .iter()
        .map(encode)
        .chain(replies.iter().map(encode));
    for line in lines {
        for cut in 1..line.len() - 1 {
            let part = &line[..cut];
            assert_says(&refused(part), part, "EOF while parsing");
            assert_says(&refused_reply(part), part, "EOF while parsing");
        }
    }
}

/// Nesting deeper than serde_json's recursion limit (128) is an error, not a stack overflow,
/// on a thread with the stack of the server's connection threads, wherever it is: in a field
/// the hello ignores, in one buffered before the operation is known, where a tag goes, in a
/// reply. Nesting within the limit, where a field is ignored, is accepted.
#[test]
fn deep_nesting_is_an_error_not_a_crash() {
    let nested = |head: &str, open: &str, depth: usize, close: &str, tail: &str| {
        let mut l = head.as_bytes().to_vec();
        l.extend(repeat_n(open.as_bytes(), depth).flatten());
        l.extend(repeat_n(close.as_bytes(), depth).flatten());
        l.extend_from_slice(tail.as_bytes());
        l
    };
    let hello = r#"{"op":"hello","protocol":1,"pid":1,"x":"#;
    bounded(move || {
        let shallow = nested(hello, "[", 100, "]", "}");
        assert!(matches!(decode_request(&shallow), Ok(Request::Hello(_))));
        let deep_requests = [
            nested(hello, "[", 30_000, "]", "}"),
            nested(hello, "{\"a\":", 10_000, "}", "}"),
            nested(r#"{"x":"#, "[", 30_000, "]", r#","op":"ping"}"#),
            nested(r#"{"op":"pause","tag":"#, "[", 60_000, "", ""),
            nested(r#"{"op":"set_region","tag":"#, "[{\"a\":", 9_000, "", ""),
        ];
        for l in deep_requests {
            assert_says(&refused(&l), &l[..60], "recursion limit exceeded");
        }
        let reply = r#"{"reply":"status","future":"#;
        let l = nested(reply, "[", MAX_REPLY_BYTES - reply.len(), "", "");
        assert_says(&refused_reply(&l), &l[..60], "recursion limit exceeded");
    });
}

#[test]
fn numbers_out_of_range_are_refused_with_what_was_expected() {
    let cases: &[(&[u8], &str)] = &[
        (
            br#"{"op":"hello","protocol":1,"pid":4294967296}"#,
            "expected u32",
        ),
        (br#"{"op":"hello","protocol":1,"pid":-1}"#, "expected u32"),
        (br#"{"op":"hello","protocol":1,"pid":1.0}"#, "expected u32"),
        (br#"{"op":"hello","protocol":1,"pid":-0}"#, "expected u32"),
        (
            br#"{"op":"hello","protocol":1e400,"pid":1}"#,
            "number out of range",
        ),
        (
            br#"{"op":"hello","protocol":1e99999999999999999999,"pid":1}"#,
            "number out of range",
        ),
        (
            br#"{"op":"pause","tag":"kv","chunks":[[0,18446744073709551616]]}"#,
            "expected u64",
        ),
        (
            br#"{"op":"pause","tag":"kv","chunks":[[-1,0]]}"#,
            "expected u64",
        ),
    ];
    for (l, says) in cases {
        assert_says(&refused(l), l, says);
    }
    let mut digits = br#"{"op":"hello","protocol":1,"pid":"#.to_vec();
    digits.resize(MAX_LINE_BYTES - 1, b'7');
    digits.push(b'}');
    assert_says(&refused(&digits), b"60,000 digits", "number out of range");
    // Replies: the largest of each kind is a value like any other; past it, refused.
    let done = |n: &str, s: &str| {
        format!(
            r#"{{"reply":"done","op":"pause","allocations":{n},"bytes":1,"copied_bytes":0,"seconds":{s}}}"#
        )
        .into_bytes()
    };
    let Ok(Reply::Done(d)) = decode_reply(&done("18446744073709551615", "1.7976931348623157e308"))
    else {
        panic!()
    };
    assert_eq!((d.allocations, d.seconds), (u64::MAX, f64::MAX));
    let l = done("1", "1e400");
    assert_says(&refused_reply(&l), &l, "number out of range");
    let l = done("18446744073709551616", "1");
    assert_says(&refused_reply(&l), &l, "expected u64");
    // Four megabytes of digits take no longer than any other reply of that size.
    let mut l = done("1", "0.");
    l.truncate(l.len() - 1);
    l.resize(MAX_REPLY_BYTES - 1, b'3');
    l.push(b'}');
    let Ok(Reply::Done(d)) = bounded(move || decode_reply(&l)) else {
        panic!()
    };
    assert_eq!(
        d.seconds,
        1.0 / 3.0,
        "the double nearest the number written"
    );
}

#[test]
fn wrong_types_are_refused_with_what_was_expected() {
    let requests: &[(&[u8], &str)] = &[
        (br#"{"op":1}"#, "expected variant identifier"),
        (br#"{"op":null}"#, "expected variant identifier"),
        (br#"{"op":["ping"]}"#, "expected variant identifier"),
        (br#"{"op":{"ping":null}}"#, "expected variant identifier"),
        (br#"{"op":"pause","tag":3}"#, "expected a string"),
        (br#"{"op":"pause","tag":["kv"]}"#, "expected a string"),
        (br#"{"op":"pause","tag":{"kv":1}}"#, "expected a string"),
        (br#"{"op":"resume","verify":"true"}"#, "expected a boolean"),
        (br#"{"op":"resume","no_wait":0}"#, "expected a boolean"),
        (
            br#"{"op":"pause","tag":"kv","chunks":[[1,"2"]]}"#,
            "expected u64",
        ),
        (
            br#"{"op":"pause","tag":"kv","chunks":{"0":1}}"#,
            "expected a sequence",
        ),
        (br#"{"op":"hello","protocol":"1","pid":1}"#, "expected u32"),
        (
            br#"{"op":"hello","protocol":1,"pid":1,"software":7}"#,
            "expected a string",
        ),
        (
            br#"{"op":"set_region","enabled":"yes"}"#,
            "expected a boolean",
        ),
        (
            br#"{"op":"set_region","backend":1}"#,
            "expected string or map",
        ),
    ];
    for (l, says) in requests {
        assert_says(&refused(l), l, says);
    }
    let replies: &[(&[u8], &str)] = &[
        (br#"{"reply":"pong","pid":"1"}"#, "expected u32"),
        (
            br#"{"reply":"error","kind":0,"message":"m"}"#,
            "expected string or map",
        ),
        (
            br#"{"reply":"error","kind":"io","message":null}"#,
            "expected a string",
        ),
        (
            br#"{"reply":"hello","protocol":1,"pid":1,"features":"chunks"}"#,
            "expected a sequence",
        ),
        (
            br#"{"reply":"chunks","tag":"kv","addr":0,"chunk_size":1,"count":1,"states":1}"#,
            "expected a string",
        ),
        (br#"{"reply":7}"#, "expected variant identifier"),
    ];
    for (l, says) in replies {
        assert_says(&refused_reply(l), l, says);
    }
}

/// Requests refuse what they do not know; replies refuse an unknown reply but ignore unknown
/// fields and read an unknown error kind as such (a newer server's additions).
#[test]
fn unknown_operations_and_fields_are_refused_and_named() {
    for l in [
        &br#"{"op":"Ping"}"#[..],
        br#"{"op":"ping "}"#,
        br#"{"op":""}"#,
        br#"{"op":"ping\u0000"}"#,
    ] {
        assert_says(&refused(l), l, "unknown variant");
    }
    for (l, field) in [
        (
            &br#"{"op":"resume","tag":"kv","force":true}"#[..],
            "`force`",
        ),
        (br#"{"op":"chunks","tag":"kv","all":1}"#, "`all`"),
        (
            br#"{"op":"set_region","enabled":true,"Enabled":true}"#,
            "`Enabled`",
        ),
        (br#"{"op":"status","":0}"#, "``"),
    ] {
        assert_says(&refused(l), l, &format!("unknown field {field}"));
    }
    let l = br#"{"reply":"paused","pid":1}"#;
    assert_says(&refused_reply(l), l, "unknown variant `paused`");
    assert_eq!(
        decode_reply(br#"{"reply":"pong","pid":1,"uptime":{"s":[1]}}"#),
        Ok(Reply::Pong { pid: 1 })
    );
}

#[test]
fn duplicate_keys_are_refused_and_named() {
    let requests: &[&[u8]] = &[
        br#"{"op":"ping","op":"status"}"#,
        br#"{"op":"hello","protocol":1,"protocol":1,"pid":1}"#,
        br#"{"op":"pause","tag":"a","tag":"b"}"#,
        br#"{"op":"resume","verify":false,"verify":true}"#,
        br#"{"op":"chunks","tag":"a","tag":"a"}"#,
        br#"{"op":"set_region","enabled":true,"enabled":false}"#,
    ];
    for l in requests {
        assert_says(&refused(l), l, "duplicate field");
    }
    let replies: &[&[u8]] = &[
        br#"{"reply":"pong","pid":1,"pid":2}"#,
        br#"{"reply":"error","kind":"busy","message":"m","kind":"io"}"#,
        br#"{"reply":"pong","reply":"pong","pid":1}"#,
    ];
    for l in replies {
        assert_says(&refused_reply(l), l, "duplicate field");
    }
}

/// A message is one JSON object. serde also takes an array for a struct or an internally
/// tagged enum, its elements in field order (`["pause","kv"]`): no message of this protocol,
/// and one whose fields have no names to refuse.
#[test]
fn a_message_is_an_object_not_an_array_or_another_value() {
    for l in [
        &br#"["ping"]"#[..],
        br#"["status"]"#,
        br#"["chunks","kv"]"#,
        br#"["hello",1,42]"#,
        br#"["pause","kv"]"#,
        br#"["set_region",true]"#,
        br#" ["ping"]"#,
        br#"[{"op":"ping"}]"#,
        b"[]",
        br#""ping""#,
        b"42",
        b"null",
    ] {
        assert_says(&refused(l), l, "expected a JSON object, found");
    }
    for l in [
        &br#"["pong",7]"#[..],
        br#"["error","busy","m"]"#,
        br#"["hello",1,1]"#,
    ] {
        assert_says(&refused_reply(l), l, "expected a JSON object, found");
    }
    assert_eq!(
        refused(b" \t[\"ping\"]"),
        "malformed message: expected a JSON object, found `[` at column 3"
    );
    assert_eq!(
        refused(b"\xef\xbb\xbf{}"),
        "malformed message: expected a JSON object, found byte 0xef at column 1"
    );
}

#[test]
fn two_messages_on_one_line_are_refused() {
    for l in [
        &br#"{"op":"ping"}{"op":"status"}"#[..],
        br#"{"op":"ping"} {"op":"ping"}"#,
        br#"{"op":"ping"}x"#,
    ] {
        assert_says(&refused(l), l, "trailing characters");
    }
}

/// Messages quote the peer's input (an unknown operation, a field's name): its control
/// characters are shown escaped, so that a message cannot break a log line or drive a terminal.
#[test]
fn messages_show_the_control_characters_they_quote_escaped() {
    let l = br#"{"op":"x\n\u001b[2J\u0000\u0085"}"#;
    let m = refused(l);
    assert!(!m.chars().any(char::is_control), "{m:?}");
    assert_says(&m, l, r"unknown variant `x\n\u{1b}[2J\u{0}\u{85}`");
    let l = br#"{"op":"ping","\r\n":1}"#;
    assert_says(&refused(l), l, r"unknown field `\r\n`");
    // Escapes count in the bound on a message's length.
    let mut l = br#"{"op":""#.to_vec();
    l.extend(repeat_n(&b"\\u0007"[..], 5_000).flatten());
    l.extend_from_slice(br#""}"#);
    let m = refused(&l);
    assert!(
        m.len() < 400 && m.ends_with("..."),
        "{} bytes: {m}",
        m.len()
    );
}

// --- properties -------------------------------------------------------------------------------

/// Pieces of JSON and of this protocol, for lines closer to messages than random bytes are.
const PIECES: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b":",
    b",",
    b" ",
    b"\r",
    b"\"op\"",
    b"\"reply\"",
    b"\"hello\"",
    b"\"ping\"",
    b"\"pong\"",
    b"\"pause\"",
    b"\"resume\"",
    b"\"set_region\"",
    b"\"error\"",
    b"\"done\"",
    b"\"tag\"",
    b"\"chunks\"",
    b"\"pid\"",
    b"\"protocol\"",
    b"\"kind\"",
    b"\"message\"",
    b"\"seconds\"",
    b"\"enabled\"",
    b"\"kv\"",
    b"0",
    b"1",
    b"-1",
    b"0.5",
    b"1e400",
    b"18446744073709551616",
    b"true",
    b"null",
    b"\"\\u0000\"",
    b"\"\\ud800\"",
    b"\"\xff\"",
    b"\0",
];

/// Whatever either decoder accepts encodes to a line it accepts as the same message.
fn accepted_lines_round_trip(line: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(r) = decode_request(line) {
        prop_assert_eq!(decode_request(&encode(&r)), Ok(r));
    }
    if let Ok(r) = decode_reply(line) {
        prop_assert_eq!(decode_reply(&encode(&r)), Ok(r));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Every reply survives encode then decode, as one line.
    #[test]
    fn replies_round_trip(reply in arb_reply()) {
        let line = encode(&reply);
        prop_assert_eq!(line.iter().position(|b| *b == b'\n'), Some(line.len() - 1));
        prop_assert_eq!(decode_reply(&line), Ok(reply));
    }

    /// A request, and a stream of requests, survive encode then decode however the stream is
    /// cut into reads.
    #[test]
    fn request_streams_round_trip_in_any_reads(
        reqs in prop::collection::vec(arb_request(), 1..6),
        cut in 1usize..40,
    ) {
        let stream: Vec<u8> = reqs.iter().flat_map(encode).collect();
        let mut buf = LineBuffer::new(MAX_LINE_BYTES);
        let mut got = Vec::new();
        for piece in stream.chunks(cut) {
            buf.push(piece);
            while let Some(line) = buf.next_line() {
                got.push(decode_request(&line.unwrap()).unwrap());
            }
        }
        prop_assert_eq!(got, reqs);
        prop_assert_eq!(buf.pending(), 0);
    }

    /// Any bytes, cut into reads anyhow and split into lines: nothing panics, and what is
    /// accepted round-trips.
    #[test]
    fn any_bytes_in_any_reads_never_panic(
        bytes in prop::collection::vec(prop_oneof![9 => any::<u8>(), 1 => Just(b'\n')], 0..1024),
        cut in 1usize..64,
    ) {
        let mut buf = LineBuffer::new(256);
        for piece in bytes.chunks(cut) {
            buf.push(piece);
            while let Some(line) = buf.next_line() {
                match line {
                    Ok(line) => accepted_lines_round_trip(&line)?,
                    Err(e) => {
                        prop_assert_eq!(e.kind(), ErrorKind::LineTooLong);
                        return Ok(());
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// Lines made of pieces of JSON and of this protocol: nothing panics, and what is accepted
    /// round-trips.
    #[test]
    fn pieces_of_messages_never_panic(
        pieces in prop::collection::vec(prop::sample::select(PIECES), 0..48),
    ) {
        accepted_lines_round_trip(&pieces.concat())?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Valid replies with bytes changed, cut or inserted (closer to what a fuzzer reaches than
    /// random bytes): nothing panics, and what is accepted round-trips.
    #[test]
    fn mutated_replies_never_panic(
        reply in arb_reply(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6),
    ) {
        let mut line = encode(&reply);
        line.pop();
        for (at, byte, how) in edits {
            let i = at.index(line.len() + 1);
            match how {
                0 if i < line.len() => line[i] = byte,
                1 => line.truncate(i),
                _ => line.insert(i, byte),
            }
        }
        accepted_lines_round_trip(&line)?;
    }

    /// Names in the socket folder are anyone's who can write there: parsing one never panics,
    /// and a name it takes is the very name its result makes.
    #[test]
    fn socket_names_parse_or_not(name in prop_oneof!["[0-9.]{0,24}(\\.sock)?", "\\PC{0,24}"]) {
        if let Some(n) = SocketName::parse(&name) {
            prop_assert!(n.pid > 0 && n.pid <= i32::MAX as u32);
            prop_assert_eq!(n.file_name(), name);
        }
    }

    /// A tag of any characters past the bound is shown cut at a character boundary, within
    /// the bound and a short suffix that names its length.
    #[test]
    fn long_tags_are_shown_within_the_bound(tag in "(?s).{900,1100}") {
        let shown = shown_tag(&tag);
        if tag.len() <= MAX_SHOWN_TAG_BYTES {
            prop_assert_eq!(shown, tag);
        } else {
            let suffix = format!("\u{2026}({} bytes, hash ", tag.len());
            let cut = shown.rfind(&suffix).expect("the suffix");
            prop_assert!(cut + 3 >= MAX_SHOWN_TAG_BYTES && cut <= MAX_SHOWN_TAG_BYTES);
            prop_assert!(tag.starts_with(&shown[..cut]));
            prop_assert!(shown.len() < MAX_SHOWN_TAG_BYTES + 64);
        }
    }
}
