//! `status` and what it reports: tags never seen, long tags, more tags than a reply holds,
//! and the progress of pauses and resumes whoever started them.

use super::*;

#[test]
fn pausing_a_tag_no_allocation_ever_had_is_flagged() {
    let h = host();
    let ptr = h.alloc(1 << 20, "kv", None);
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
        h.alloc(1 << 20, tag, None);
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
        h.alloc(size, tag, Some(BackupKind::Pinned));
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

/// A status that lists no operation shows the state the operations left: the pattern "wait
/// until `status` lists none, then read the tags" (tmsctl's users, its own tests) never sees a
/// tag as it was before an operation that ended while the reply was being made. Many short
/// pauses and resumes, a watcher polling as fast as it can.
#[test]
fn a_status_without_operations_shows_what_they_left() {
    let sim = SimDriver::new(SimConfig::default()).unwrap();
    // Operations of a few ms, so that many polls land near their ends.
    sim.set_bandwidth(Some(2 << 30));
    let h = host_over(sim);
    let size: u64 = 4 << 20;
    h.alloc(size, "ended", Some(BackupKind::Pinned));
    let mut watcher = Conn::greeted_with(
        h,
        Limits {
            max_requests: 1_000_000,
            ..limits()
        },
    );
    let status = |c: &mut Conn| match c.ask(&Request::Status) {
        Reply::Status(s) => s,
        other => panic!("{other:?}"),
    };
    let mut checked = 0;
    for round in 0..200 {
        let paused = round % 2 == 0;
        let t = std::thread::spawn(move || {
            let mut c = Conn::greeted(h);
            let t = Some("ended".to_string());
            done(c.ask(&if paused { pause(t) } else { resume(t) }))
        });
        // Polled until the operation has shown and then gone (or ended unseen).
        let mut shown = false;
        let s = loop {
            let s = status(&mut watcher);
            let listed = s
                .operations
                .iter()
                .any(|r| r.tag.as_deref() == Some("ended"));
            if listed {
                shown = true;
            } else if shown || t.is_finished() {
                break s;
            }
        };
        t.join().unwrap();
        if !shown {
            continue;
        }
        checked += 1;
        let tag = s.tags.iter().find(|t| t.tag == "ended").expect("the tag");
        let want = if paused { (0, size) } else { (size, 0) };
        assert_eq!(
            (tag.bytes_active, tag.bytes_paused),
            want,
            "round {round}: {s:?}"
        );
    }
    assert!(
        checked >= 100,
        "only {checked} of 200 operations were seen running"
    );
}

/// Issue 36, item 1: a resume asked over the socket without waiting is shown as the socket's
/// (not "started in the process") while it restores after its reply, and its tag as restoring,
/// not paused; when it fails after the reply, the status shows the failure and the memory it
/// left held as unrestored, until a pause over the socket gives it back (and, nobody having
/// waited, reports the failure).
#[test]
fn a_resume_without_waiting_shows_as_the_sockets_and_its_failure_shows_until_paused() {
    use crate::driver::sim::Prim;
    let (sim, _, mut c) = paused_nw(3);
    let tag_of = |c: &mut Conn| match c.ask(&Request::Status) {
        Reply::Status(s) => (
            s.tags.into_iter().find(|t| t.tag == "nw").unwrap(),
            s.operations,
        ),
        other => panic!("{other:?}"),
    };
    sim.hold(Prim::EventSync, None);
    let d = done(c.ask(&resume_no_wait("nw")));
    assert_eq!(d.allocations, 3);
    let (t, ops) = tag_of(&mut c);
    assert_eq!(
        (
            t.restoring_allocations,
            t.bytes_restoring,
            t.bytes_paused,
            t.bytes_active
        ),
        (3, 6 << 20, 0, 0),
        "{t:?}"
    );
    assert_eq!(ops.len(), 1, "{ops:?}");
    assert!(
        ops[0].op == Op::Resume && !ops[0].in_process,
        "asked over the socket: {ops:?}"
    );
    sim.arm_fault(Prim::EventSync, 1, 999);
    sim.unhold(Prim::EventSync, None);
    let deadline = Instant::now() + Duration::from_secs(10);
    let t = loop {
        let (t, ops) = tag_of(&mut c);
        if ops.is_empty() {
            break t;
        }
        assert!(Instant::now() < deadline, "the resume never ended");
        std::thread::sleep(Duration::from_millis(5));
    };
    // The failed allocation is unrestored; the others may have landed first (restored).
    assert!(
        t.bytes_unrestored >= 2 << 20
            && t.bytes_unrestored + t.bytes_active == 6 << 20
            && t.bytes_paused == 0,
        "{t:?}"
    );
    let msg = t.failed_restore.expect("the failure is shown");
    assert!(msg.contains("failed after it returned"), "{msg}");
    let Reply::Error(e) = c.ask(&pause(Some("nw".into()))) else {
        panic!("the pause reports the failure nobody waited for")
    };
    assert!(
        e.message.contains("reported by this pause"),
        "{}",
        e.message
    );
    let (t, _) = tag_of(&mut c);
    assert_eq!(
        (
            t.bytes_unrestored,
            t.bytes_paused,
            t.failed_restore.as_deref()
        ),
        (0, 6 << 20, None),
        "given back: {t:?}"
    );
    assert_eq!(done(c.ask(&resume(Some("nw".into())))).allocations, 3);
}
