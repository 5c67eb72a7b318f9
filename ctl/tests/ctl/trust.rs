//! Whom tmsctl trusts, and what it lets through: other users, folders open to others or not folders
//! at all, a server that is not the process named, pid namespaces, rude clients, text that would
//! act on the terminal.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::*;

/// A raw protocol client, for what tmsctl would never send.
struct Raw {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Raw {
    fn connect(path: &Path) -> Raw {
        let stream = UnixStream::connect(path).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        Raw {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            stream,
        }
    }

    fn hello(path: &Path) -> Raw {
        let mut r = Raw::connect(path);
        r.send(b"{\"op\":\"hello\",\"protocol\":1,\"pid\":1,\"software\":\"test\"}\n");
        assert_eq!(r.reply()["reply"], "hello");
        r
    }

    fn send(&mut self, b: &[u8]) {
        self.stream.write_all(b).expect("send");
    }

    fn reply(&mut self) -> Value {
        let mut l = String::new();
        self.reader.read_line(&mut l).expect("read a reply");
        serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: {l:?}"))
    }

    /// The server closed: end of stream (or a reset, when it closed with our bytes unread).
    fn assert_closed(mut self) {
        let mut rest = Vec::new();
        match self.reader.read_to_end(&mut rest) {
            Ok(_) => assert!(rest.is_empty(), "{:?}", String::from_utf8_lossy(&rest)),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        }
    }
}

#[test]
fn another_user_is_refused() {
    if !is_root() {
        eprintln!("skipped: needs root to run the preloaded process as another user (the credential checks themselves are unit-tested in preload/src/control/auth.rs and ctl/src/client.rs)");
        return;
    }
    // The preloaded process runs as nobody (65534) in a folder of its own; we (root) get past
    // the folder's and socket's modes, but not past the server's uid check. The folder is made
    // for it in ours (a folder above it must be root's or ours for tmsctl to look in it, and
    // root's or its own for the library to listen in it).
    let sb = sandbox();
    std::fs::set_permissions(sb.tmp.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::create_dir(&sb.dir).expect("mkdir");
    std::os::unix::fs::chown(&sb.dir, Some(65534), Some(65534)).expect("chown");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let mut p = Proc::start_with(&sb, &[], |c| {
        c.uid(65534).gid(65534);
    });
    let meta = std::fs::metadata(&sb.dir)
        .unwrap_or_else(|e| panic!("the child made no folder: {e}: {}", p.ready));
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), 65534);

    let pid = p.pid.to_string();
    // Its folder is not ours: refused before any socket in it is used.
    let line = ctl(&sb, &["status", "--pid", &pid]).failed(4).to_string();
    assert!(line.contains("permission denied"), "{line}");
    assert!(
        line.contains("uid 0") && line.contains("uid 65534"),
        "{line}"
    );
    ctl(&sb, &["pause", "--pid", &pid]).failed(4);
    // Its socket, linked into a private folder of ours: the server runs as another uid
    // (SO_PEERCRED), so tmsctl refuses it without a word sent.
    let mine = sb.tmp.path().join("mine");
    std::fs::create_dir(&mine).expect("mkdir");
    std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let sock = p.socket();
    std::fs::hard_link(&sock, mine.join(sock.file_name().expect("name"))).expect("link");
    let dir = mine.to_str().expect("utf-8");
    let line = ctl(&sb, &["status", "--socket-dir", dir, "--pid", &pid])
        .failed(4)
        .to_string();
    assert!(
        line.contains("its server runs as uid 65534, not as uid 0"),
        "{line}"
    );

    // The raw reply, before any hello.
    let mut raw = Raw::connect(&p.socket());
    let r = raw.reply();
    assert_eq!(
        (r["reply"].as_str(), r["kind"].as_str()),
        (Some("error"), Some("permission_denied"))
    );
    raw.assert_closed();

    // Nothing was paused and the process is fine.
    p.assert_alive();
    p.verify();
}

#[test]
fn garbage_and_rude_clients_leave_the_process_unharmed() {
    let sb = sandbox();
    let mut p = Proc::start(&sb, &[]);
    let sock = p.socket();

    // Garbage, before and after the hello.
    for bad in [
        &b"garbage\n"[..],
        b"\x00\xff\xfe\n",
        b"{\"op\":\"rm -rf\"}\n",
        b"{\"op\":\"pause\",\"tga\":\"demo\"}\n",
        b"{\"op\":\"pause\",\"tag\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]}\n",
    ] {
        let mut r = Raw::connect(&sock);
        r.send(bad);
        let rep = r.reply();
        assert_eq!(rep["reply"], "error");
        assert!(["bad_request", "hello_required"].contains(&rep["kind"].as_str().unwrap_or("")));
        r.assert_closed();
        let mut r = Raw::hello(&sock);
        r.send(bad);
        assert_eq!(r.reply()["kind"], "bad_request");
        r.assert_closed();
    }
    // Another protocol version.
    let mut r = Raw::connect(&sock);
    r.send(b"{\"op\":\"hello\",\"protocol\":999,\"pid\":1}\n");
    assert_eq!(r.reply()["kind"], "version_mismatch");
    r.assert_closed();

    // An oversized line (1 MiB, no newline): refused once past the limit.
    let mut r = Raw::hello(&sock);
    let big = vec![b'a'; 1 << 20];
    let _ = r.stream.write_all(&big); // the server may close before taking it all
    assert_eq!(r.reply()["kind"], "line_too_long");
    r.assert_closed();

    // Half a line, then gone; a request, then gone before the reply; gone mid-hello.
    for _ in 0..10 {
        let mut r = Raw::hello(&sock);
        r.send(b"{\"op\":\"stat");
        drop(r);
        let mut r = Raw::hello(&sock);
        r.send(b"{\"op\":\"status\"}\n{\"op\":\"pause\",\"tag\":\"nothing-here\"}\n");
        drop(r);
        let mut r = Raw::connect(&sock);
        r.send(b"{\"op\":\"hel");
        drop(r);
    }

    // A slow client (half a line, then silence) delays others only until its timeout.
    let mut slow = Raw::hello(&sock);
    slow.send(b"{\"op\":");
    let t = Instant::now();
    let r = ok(&sb, &["ping", "--timeout", "10"]);
    assert!(r.stdout.contains("pong"));
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(slow.reply()["kind"], "timeout");
    slow.assert_closed();

    // Still alive, still serving, nothing paused, contents intact.
    p.assert_alive();
    let s = status(&sb, p.pid);
    assert_eq!(tag(&s, "demo")["bytes_active"].as_u64(), Some(SIZE));
    p.verify();
    assert!(p.exit().success());
}

#[test]
fn a_server_that_is_not_the_process_named_is_refused() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let me_s = me.to_string();

    // Our own socket name, but the hello claims another pid.
    let liar = Fake::start(dir, &our_name(me), 1, honest(1));
    let line = ctl(&sb, &["ping", "--pid", &me_s]).failed(4).to_string();
    assert!(
        line.contains("permission denied") && line.contains("says it is process 1,"),
        "{line}"
    );
    ctl(&sb, &["pause", "--pid", &me_s]).failed(4);
    ctl(&sb, &["pause"]).failed(4);
    assert!(liar.ops().is_empty(), "{:?}", liar.ops());
    std::fs::remove_file(&liar.path).expect("rm");

    // A socket named after a live victim, whose hello claims the victim's pid: the kernel says
    // another process (this one) serves it.
    let victim = Victim::start();
    let v = victim.pid().to_string();
    let impostor = Fake::start(
        dir,
        &our_name(victim.pid()),
        victim.pid(),
        honest(victim.pid()),
    );
    let line = ctl(&sb, &["pause", "--pid", &v]).failed(4).to_string();
    assert!(
        line.contains(&format!("served by process {me}, not by process {v}")),
        "{line}"
    );
    ctl(&sb, &["resume", "--all"]).failed(4);
    // list shows the refusal, not the impostor's numbers.
    let l = ok(&sb, &["list", "--json"]).json();
    assert_eq!(l.as_array().map(Vec::len), Some(1), "{l}");
    assert!(l[0]["backend"].is_null(), "{l}");
    assert!(
        l[0]["error"]
            .as_str()
            .unwrap_or("")
            .contains("permission denied"),
        "{l}"
    );
    assert!(impostor.ops().is_empty(), "{:?}", impostor.ops());
}

#[test]
fn an_open_socket_folder_is_refused() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id().to_string();
    let fake = Fake::start(
        dir,
        &our_name(std::process::id()),
        std::process::id(),
        honest(std::process::id()),
    );
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    for args in [
        &["list"][..],
        &["status"],
        &["pause", "--pid", &me],
        &["ping", "--all"],
    ] {
        let line = ctl(&sb, args).failed(4).to_string();
        assert!(
            line.contains("permission denied")
                && line.contains(&sb.dir.display().to_string())
                && line.contains("0777"),
            "{args:?}: {line}"
        );
    }
    assert!(fake.ops().is_empty(), "{:?}", fake.ops());
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750)).expect("chmod");
    assert!(ctl(&sb, &["ping"]).failed(4).contains("0750"));
    // The same folder made private: trusted.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    assert!(ok(&sb, &["ping"]).stdout.contains("pong"));
    assert_eq!(fake.ops(), ["ping"]);
}

/// `dir`'s refusal by tmsctl because its ancestor `above` has mode `mode`, writable by `who`.
fn ancestor_refused(line: &str, dir: &Path, above: &Path, mode: &str, who: &str) -> bool {
    line.starts_with("tmsctl: permission denied: refusing the socket folder ")
        && line.contains(&dir.display().to_string())
        && line.ends_with(&format!(
            ": its ancestor {} has mode {mode}: {who} can write to it without the sticky bit, \
             so they could move what is in it away and put their own in its place",
            above.display()
        ))
}

/// A private socket folder of ours in a folder others can write to (no sticky bit): they could
/// swap it for their own at any time, so tmsctl looks in it no more than the library listens
/// in it, and says which folder above it is the trouble. With the sticky bit (like /tmp): used.
#[test]
fn a_socket_folder_below_a_folder_others_can_write_to_is_refused() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let fake = Fake::start(
        dir,
        &our_name(std::process::id()),
        std::process::id(),
        honest(std::process::id()),
    );
    let above = sb.tmp.path();
    let me = std::process::id().to_string();
    for (mode, shown, who) in [
        (0o777, "0777", "group and others"),
        (0o770, "0770", "group"),
        (0o703, "0703", "others"),
    ] {
        std::fs::set_permissions(above, std::fs::Permissions::from_mode(mode)).expect("chmod");
        for args in [
            &["list"][..],
            &["status"],
            &["pause", "--pid", &me],
            &["ping", "--all"],
            &["clean"],
        ] {
            let line = ctl(&sb, args).failed(4).to_string();
            assert!(
                ancestor_refused(&line, dir, above, shown, who),
                "{args:?}: {line}"
            );
        }
    }
    assert!(fake.ops().is_empty(), "{:?}", fake.ops());
    std::fs::set_permissions(above, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    assert!(ok(&sb, &["ping"]).stdout.contains("pong"));
    assert_eq!(fake.ops(), ["ping"]);
    std::fs::set_permissions(above, std::fs::Permissions::from_mode(0o700)).expect("chmod");
}

/// TMS_SOCKET_DIR ending in `/`, its last name a link into a folder anyone can write to: the
/// system follows that link (the `O_NOFOLLOW` open of the folder too), so tmsctl holds it and
/// where it leads to the ancestors' rule, as it does without the slash (where the link itself
/// is refused), and never talks to the server there.
#[test]
fn a_trailing_slash_is_no_way_around_the_ancestors_rule() {
    let sb = sandbox();
    let open = sb.tmp.path().join("open");
    std::fs::create_dir(&open).expect("mkdir");
    let real = open.join("real");
    std::fs::create_dir(&real).expect("mkdir");
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    std::os::unix::fs::symlink(&real, &sb.dir).expect("symlink");
    let fake = Fake::start(
        &real,
        &our_name(std::process::id()),
        std::process::id(),
        honest(std::process::id()),
    );
    let slashed = format!("{}/", sb.dir.display());
    let run = |args: &[&str]| {
        ctl_with(&tmsctl(), &sb, args, |c| {
            c.env("TMS_SOCKET_DIR", &slashed);
        })
    };
    for args in [&["ping"][..], &["list"], &["clean"]] {
        let r = run(args);
        let line = r.failed(4);
        assert!(
            ancestor_refused(line, Path::new(&slashed), &open, "0777", "group and others"),
            "{args:?}: {line}"
        );
    }
    assert!(fake.ops().is_empty(), "{:?}", fake.ops());
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    assert!(run(&["ping"]).stdout.contains("pong"));
    assert_eq!(fake.ops(), ["ping"]);
}

/// The library's side, in a real process: TMS_SOCKET_DIR below a folder anyone can write to
/// gives no socket (nothing is made there) and says why; `tmsctl status --pid` names the same
/// refusal. With the sticky bit, the process listens there and tmsctl reaches it.
#[test]
fn a_process_whose_folder_is_below_a_folder_others_can_write_to_has_no_socket() {
    let sb = sandbox();
    let shared = sb.tmp.path().join("shared");
    std::fs::create_dir(&shared).expect("mkdir");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let its = shared.join("tms");
    let env = [("TMS_SOCKET_DIR", its.to_str().expect("utf-8"))];
    let mut p = Proc::start(&sb, &env);
    assert!(p.ready["socket"].is_null(), "{}", p.ready);
    let why = p.ready["socket_error"].as_str().unwrap_or_default();
    let want = format!(
        "its ancestor {} has mode 0777: group and others can write to it without the sticky \
         bit, so they could move what is in it away and put their own in its place",
        shared.display()
    );
    // As `tms_control_socket` reports it (after its status), and as the library logs it.
    assert!(
        why.ends_with(&format!(
            "no control socket: refusing the socket folder {}: {want}",
            its.display()
        )),
        "{why}"
    );
    assert!(!its.exists(), "the library made its folder there");
    let line = ctl(&sb, &["status", "--pid", &p.pid.to_string()])
        .failed(3)
        .to_string();
    assert!(
        line.contains(&format!("{} (refused", its.display())) && line.contains(&want),
        "{line}"
    );
    p.verify();

    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    let q = Proc::start(&sb, &env);
    assert!(q.socket().starts_with(&its), "{}", q.ready);
    let r = ok(&sb, &["status", "--pid", &q.pid.to_string()]);
    assert!(r.stdout.contains(&q.pid.to_string()), "{}", r.dump());
}

#[test]
fn a_socket_folder_that_is_a_file_or_a_link_is_refused() {
    // A file where the folder should be: not "no process" (exit 3) but a refusal naming it.
    let sb = sandbox();
    std::fs::write(&sb.dir, b"not a folder").expect("write");
    for args in [&["status"][..], &["list"], &["pause", "--pid", "1"]] {
        let line = ctl(&sb, args).failed(4).to_string();
        assert!(
            line.contains(&sb.dir.display().to_string()) && line.contains("not a folder"),
            "{args:?}: {line}"
        );
    }
    // A symbolic link to a private folder of ours.
    let sb = sandbox();
    let real = sb.tmp.path().join("real");
    std::fs::create_dir(&real).expect("mkdir");
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    std::os::unix::fs::symlink(&real, &sb.dir).expect("symlink");
    let line = ctl(&sb, &["list"]).failed(4).to_string();
    assert!(line.contains("symbolic link"), "{line}");
}

#[test]
fn a_foreign_or_unreadable_socket_folder_is_refused() {
    if !is_root() {
        eprintln!("skipped: needs root to give a folder to another uid");
        return;
    }
    // Another user's private folder: refused by owner, even though root could read it.
    let sb = sandbox();
    let dir = private_dir(&sb);
    let _fake = Fake::start(
        dir,
        &our_name(std::process::id()),
        std::process::id(),
        honest(std::process::id()),
    );
    std::os::unix::fs::chown(dir, Some(65534), Some(65534)).expect("chown");
    for args in [&["status"][..], &["list"]] {
        let line = ctl(&sb, args).failed(4).to_string();
        assert!(
            line.contains("permission denied")
                && line.contains("uid 65534")
                && line.contains("uid 0"),
            "{args:?}: {line}"
        );
    }

    // A folder of the user (65534) that the user cannot read (mode 0000): tmsctl run as that
    // user gets EACCES from the kernel, and says so, naming the folder (not "no process").
    let sb = sandbox();
    std::os::unix::fs::chown(sb.tmp.path(), Some(65534), Some(65534)).expect("chown");
    std::fs::create_dir(&sb.dir).expect("mkdir");
    std::os::unix::fs::chown(&sb.dir, Some(65534), Some(65534)).expect("chown");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o000)).expect("chmod");
    for args in [&["status"][..], &["list"], &["ping", "--pid", "1"]] {
        let r = ctl_with(&tmsctl(), &sb, args, |c| {
            c.uid(65534).gid(65534);
        });
        let line = r.failed(4).to_string();
        assert!(
            line.contains("cannot read the socket folder")
                && line.contains(&sb.dir.display().to_string()),
            "{args:?}: {line}"
        );
    }
}

/// No byte of `r`'s output can act on a terminal (only line breaks).
fn assert_inert(r: &Ran) {
    for (what, text) in [("stdout", &r.stdout), ("stderr", &r.stderr)] {
        let bad: Vec<char> = text
            .chars()
            .filter(|c| (c.is_control() && *c != '\n') || ('\u{202a}'..='\u{202e}').contains(c))
            .collect();
        assert!(bad.is_empty(), "raw {bad:?} on {what}\n{}", r.dump());
    }
}

#[test]
fn server_text_is_escaped_before_it_is_printed() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let answer: Answer = Arc::new(move |req: &Value| -> String {
        match req["op"].as_str() {
            Some("status") => serde_json::json!({
                "reply": "error", "kind": "internal",
                "message": "\u{1b}[2J\u{1b}]0;owned\u{7} boom\r\n\u{9b}31m",
            })
            .to_string(),
            Some("pause") => serde_json::json!({
                "reply": "done", "op": "pause", "tag": "\u{1b}[31mred", "allocations": 1,
                "bytes": 4096, "copied_bytes": 0, "seconds": 0.0,
            })
            .to_string(),
            Some("get_region") => serde_json::json!({
                "reply": "region", "enabled": true, "tag": "\u{9b}2J\u{202e}kv",
                "cpu_backup": false, "backend": "pinned",
            })
            .to_string(),
            _ => format!("{{\"reply\":\"pong\",\"pid\":{me}}}"),
        }
    });
    let _fake = Fake::start(dir, &our_name(me), me, answer);

    let r = ctl(&sb, &["status"]);
    r.failed(1);
    assert_inert(&r);
    assert!(
        r.stderr.contains("\\u{1b}[2J\\u{1b}]0;owned\\u{7} boom"),
        "{}",
        r.dump()
    );

    // The tag asked for: a reply about another is refused.
    let r = ok(&sb, &["pause", "--tag", "\u{1b}[31mred"]);
    assert_inert(&r);
    assert!(r.stdout.contains("\\u{1b}[31mred"), "{}", r.dump());
    let r = ok(&sb, &["pause", "--tag", "\u{1b}[31mred", "--json"]);
    assert_inert(&r);
    assert_eq!(
        r.json()["tag"],
        "\u{1b}[31mred",
        "the JSON still carries the value"
    );

    let r = ok(&sb, &["region"]);
    assert_inert(&r);
    assert!(r.stdout.contains("\\u{9b}2J\\u{202e}kv"), "{}", r.dump());
    let r = ok(&sb, &["region", "--json"]);
    assert_inert(&r);
    assert_eq!(r.json()["tag"], "\u{9b}2J\u{202e}kv");

    let r = ok(&sb, &["list"]);
    assert_inert(&r);
    assert!(r.stdout.contains("\\u{1b}[2J"), "{}", r.dump());
}

#[test]
fn pid_means_a_process_of_our_pid_namespace() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let me_s = me.to_string();
    let other_ns = our_ns() + 1;
    let elsewhere_name = format!("{me}.{other_ns}.sock");
    // A process of another namespace whose pid there happens to be ours here.
    let elsewhere = Fake::start(dir, &elsewhere_name, me, honest(me));

    // Not taken for process `me` of ours: refused, naming it.
    let line = ctl(&sb, &["ping", "--pid", &me_s]).failed(3).to_string();
    assert!(
        line.contains(&elsewhere_name) && line.contains("another pid namespace"),
        "{line}"
    );
    let line = ctl(&sb, &["status"]).failed(3).to_string();
    assert!(
        line.contains(&elsewhere_name) && line.contains("other pid namespaces"),
        "{line}"
    );
    ctl(&sb, &["pause", "--all"]).failed(3);
    assert!(elsewhere.ops().is_empty());

    // list shows it, marked.
    let l = ok(&sb, &["list"]);
    assert!(
        l.stdout
            .contains(&format!("pid namespace {other_ns}, not this one")),
        "{}",
        l.dump()
    );
    let l = ok(&sb, &["list", "--json"]).json();
    assert_eq!(l[0]["pidns"].as_u64(), Some(other_ns), "{l}");
    assert_eq!(l[0]["this_pid_namespace"], false, "{l}");
    assert_eq!(l[0]["backend"], "sim", "{l}");

    // An older server's `<pid>.sock` is taken as ours ...
    let legacy = Fake::start(dir, &format!("{me}.sock"), me, honest(me));
    ok(&sb, &["ping", "--pid", &me_s]);
    ok(&sb, &["ping"]);
    assert_eq!(legacy.ops(), ["ping", "ping"]);
    // ... and `<pid>.<our-ns>.sock` preferred to it.
    let named = Fake::start(dir, &our_name(me), me, honest(me));
    ok(&sb, &["ping", "--pid", &me_s]);
    ok(&sb, &["pause", "--all"]);
    assert_eq!(named.ops(), ["ping", "pause"]);
    assert_eq!(legacy.ops().len(), 2);
    let l = ok(&sb, &["list", "--json"]).json();
    let shown: Vec<(Option<u64>, bool)> = l
        .as_array()
        .expect("array")
        .iter()
        .map(|i| (i["pidns"].as_u64(), i["this_pid_namespace"] == true))
        .collect();
    assert_eq!(
        shown,
        [(Some(our_ns()), true), (Some(other_ns), false)],
        "{l}"
    );
}
