//! --json: every document carries the schema version; failures are a document too.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::common::*;

/// The one document a failed `--json` command printed on stdout, after checking its exit code
/// and its line on stderr (still printed).
fn json_failure(r: &Ran, code: i32) -> Value {
    r.failed(code);
    assert_eq!(r.stdout.lines().count(), 1, "one line\n{}", r.dump());
    let j: Value = serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}\n{}", r.dump()));
    assert_eq!(j["schema"], 1, "{j}");
    assert_eq!(j["error"]["exit_code"], code, "{j}");
    assert!(j["error"]["message"].is_string(), "{j}");
    j
}

#[test]
fn json_failures_are_a_document_on_stdout() {
    let sb = sandbox();
    // The command as a whole: nothing to talk to.
    let j = json_failure(&ctl(&sb, &["status", "--json"]), 3);
    assert_eq!(j["error"]["name"], "no_process", "{j}");
    assert!(j.get("pid").is_none(), "{j}");
    assert!(
        j["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no process")),
        "{j}"
    );
    let j = json_failure(&ctl(&sb, &["pause", "--all", "--json"]), 3);
    assert_eq!(j["error"]["name"], "no_process", "{j}");
    // A bad command line, wherever --json is on it.
    for args in [
        &["--json", "frobnicate"][..],
        &["--json"],
        &["pause", "--chunks", "1", "--json"],
        &["status", "--json", "--timeout", "0"],
        &["region", "--enable", "--disable", "--json"],
    ] {
        let r = ctl(&sb, args);
        let j = json_failure(&r, 2);
        assert_eq!(j["error"]["name"], "usage", "{args:?}: {j}");
        assert!(
            j["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("--help")),
            "{args:?}: {j}"
        );
    }
    // Without --json, stdout stays empty.
    for args in [&["frobnicate"][..], &["status"]] {
        let r = ctl(&sb, args);
        assert_ne!(r.code, 0, "{}", r.dump());
        assert_eq!(r.stdout, "", "{}", r.dump());
    }
    // The demo fails before it has a report: the failure is the document.
    let r = ctl(
        &sb,
        &[
            "demo",
            "--lib",
            "/nonexistent/libtms.so",
            "--size",
            "4MiB",
            "--json",
        ],
    );
    let j = json_failure(&r, 1);
    assert_eq!(j["error"]["name"], "failed", "{j}");

    // One process that does not answer: a timeout, with its pid.
    let dir = private_dir(&sb);
    let me = std::process::id();
    let path = dir.join(our_name(me));
    let listener = UnixListener::bind(&path).expect("bind");
    let held = std::thread::spawn(move || {
        let conns: Vec<UnixStream> = listener.incoming().take(1).flatten().collect();
        std::thread::sleep(Duration::from_millis(1500));
        drop(conns);
    });
    let r = ctl(
        &sb,
        &[
            "status",
            "--pid",
            &me.to_string(),
            "--timeout",
            "0.5",
            "--json",
        ],
    );
    let j = json_failure(&r, 5);
    assert_eq!(j["error"]["name"], "timeout", "{j}");
    assert_eq!(j["pid"], me, "{j}");
    held.join().expect("join");
    std::fs::remove_file(&path).expect("rm");
}

#[test]
fn json_documents_carry_the_schema_version() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let _fake = Fake::start(dir, &our_name(me), me, honest(me));
    let disk_dir = sb.tmp.path().to_str().expect("utf-8").to_string();
    for args in [
        &["status", "--json"][..],
        &["ping", "--json"],
        &["pause", "--tag", "kv", "--json"],
        &["resume", "--json"],
        &["clean", "--disk-dir", &disk_dir, "--json"],
    ] {
        let j = ok(&sb, args).json();
        assert_eq!(j["schema"], 1, "{args:?}: {j}");
    }
    // The fields of before are all still there.
    let s = ok(&sb, &["status", "--json"]).json();
    assert_eq!(s["pid"], me, "{s}");
    assert_eq!(tag(&s, "kv")["bytes_active"], 8 << 20, "{s}");
    // Arrays stay arrays: each object in them carries it.
    let l = ok(&sb, &["list", "--json"]).json();
    assert_eq!(l.as_array().map(Vec::len), Some(1), "{l}");
    assert_eq!(l[0]["schema"], 1, "{l}");
    assert_eq!(l[0]["pid"], me, "{l}");
    // A tag the process never had (exit 6): the reply, as on success.
    let r = ctl(&sb, &["pause", "--tag", "kvv", "--json"]);
    r.failed(6);
    let j: Value = serde_json::from_str(&r.stdout).expect("json");
    assert_eq!(
        (&j["schema"], &j["unknown_tag"]),
        (&1.into(), &true.into()),
        "{j}"
    );

    // --all with a process that cannot be asked (a socket of a live process that another
    // process serves): the array, that process's failure in it.
    let victim = Victim::start();
    let _impostor = UnixListener::bind(dir.join(our_name(victim.pid()))).expect("bind");
    let r = ctl(&sb, &["status", "--all", "--json"]);
    assert_eq!(r.code, 4, "{}", r.dump());
    let items: Value = serde_json::from_str(&r.stdout).expect("json");
    let items = items.as_array().expect("an array");
    assert_eq!(items.len(), 2, "{items:?}");
    let good = items.iter().find(|i| i["pid"] == me).expect("ours");
    assert_eq!(
        (&good["schema"], good.get("error")),
        (&1.into(), None),
        "{good}"
    );
    let bad = items
        .iter()
        .find(|i| i["pid"] == victim.pid())
        .expect("the victim's");
    assert_eq!(bad["schema"], 1, "{bad}");
    assert_eq!(bad["error"]["exit_code"], 4, "{bad}");
    assert_eq!(bad["error"]["name"], "permission", "{bad}");
    assert!(
        bad["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("served by process")),
        "{bad}"
    );
}

/// A folder whose name is not UTF-8 (Linux allows any bytes but `/` and NUL): `--json` still
/// prints one valid document and exits as the command did, never a panic (serde refuses to
/// serialise such a path, and `json!` unwraps).
#[test]
fn json_output_survives_folder_names_that_are_not_utf8() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let sb = sandbox();
    let odd = sb.tmp.path().join(OsStr::from_bytes(b"disk-\xff\xfe"));
    std::fs::create_dir(&odd).unwrap();
    std::fs::set_permissions(&odd, std::fs::Permissions::from_mode(0o700)).unwrap();
    let sockets = sb.tmp.path().join(OsStr::from_bytes(b"socks-\xff"));
    std::fs::create_dir(&sockets).unwrap();
    std::fs::set_permissions(&sockets, std::fs::Permissions::from_mode(0o700)).unwrap();
    let me = std::process::id();
    let _fake = Fake::start(&sockets, &our_name(me), me, honest(me));
    let run = |args: &[&OsStr]| {
        let mut cmd = clean(Command::new(tmsctl()), &sb);
        cmd.args(args);
        Ran::of(output_of(cmd))
    };
    let s = |x: &'static str| OsStr::new(x);
    for args in [
        vec![s("clean"), s("--json"), s("--disk-dir"), odd.as_os_str()],
        vec![
            s("--socket-dir"),
            sockets.as_os_str(),
            s("list"),
            s("--json"),
        ],
    ] {
        let r = run(&args);
        assert!(!r.stderr.contains("panicked"), "{args:?}: {}", r.dump());
        let j = r.json();
        assert!(j.to_string().contains("\"schema\":1"), "{j}");
    }
}

/// A process named by `--pid` that cannot be reached (gone, or without a socket) fails before
/// any connection: the failure is still about that process, and scripts read which from `pid`.
#[test]
fn json_failures_for_a_named_pid_carry_it() {
    let sb = sandbox();
    let mut gone = Command::new("true").spawn().expect("true");
    let dead = gone.id();
    gone.wait().expect("wait");
    let me = std::process::id();
    for (pid, args) in [
        (dead, &["status", "--json"][..]),
        (dead, &["pause", "--atomic", "--json"]),
        (me, &["ping", "--json"]),
    ] {
        let p = pid.to_string();
        let mut args = args.to_vec();
        args.extend(["--pid", &p]);
        let j = json_failure(&ctl(&sb, &args), 3);
        assert_eq!(j["pid"], pid, "{args:?}: {j}");
    }
}
