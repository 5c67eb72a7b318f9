//! tmsctl against real preloaded processes on the simulated device.
//!
//! The preloaded process is `tmsctl __demo-child` (the demo's child) run with
//! `LD_PRELOAD=target/<profile>/libtms.so TMS_BACKEND=sim`: it allocates pauseable memory with
//! a CPU backup through the library's C ABI (a chunked one with `--chunk SIZE`), writes a
//! pattern, prints `READY {json}` and then takes commands on stdin (`verify [OFFSET LENGTH]`,
//! `malloc SIZE`, `fork`, `exit`). Its SIGPIPE disposition
//! is the default, like a C program's, so a server that let SIGPIPE through would kill it.
//! Every test has its own socket folder (`TMS_SOCKET_DIR`).
//!
//! `libtms.so` must have been built with the same profile first (`scripts/test` runs
//! `cargo build --workspace` before `cargo test --workspace`).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

const SIZE: u64 = 8 << 20;

fn tmsctl() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tmsctl"))
}

fn libtms() -> PathBuf {
    let p = tmsctl()
        .parent()
        .expect("tmsctl has a folder")
        .join("libtms.so");
    assert!(
        p.is_file(),
        "{} does not exist: run `cargo build --workspace` (same profile) before the tests",
        p.display()
    );
    p
}

/// A socket folder of its own (inside a private temporary folder).
struct Sandbox {
    tmp: tempfile::TempDir,
    dir: PathBuf,
}

fn sandbox() -> Sandbox {
    let tmp = tempfile::Builder::new()
        .prefix("tmsctl-test-")
        .tempdir()
        .expect("tempdir");
    let dir = tmp.path().join("s");
    Sandbox { tmp, dir }
}

/// A command with no TMS_* or XDG_RUNTIME_DIR from the test's environment.
fn clean(mut cmd: Command, sb: &Sandbox) -> Command {
    for (k, _) in std::env::vars_os() {
        if k.to_str()
            .is_some_and(|k| k.starts_with("TMS_") || k == "XDG_RUNTIME_DIR" || k == "LD_PRELOAD")
        {
            cmd.env_remove(k);
        }
    }
    cmd.env("TMS_SOCKET_DIR", &sb.dir);
    cmd
}

/// A preloaded process with pauseable memory (the demo child).
struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    pid: u32,
    ready: Value,
}

impl Proc {
    fn start(sb: &Sandbox, env: &[(&str, &str)]) -> Proc {
        Proc::start_with(sb, env, |_| {})
    }

    fn start_with(sb: &Sandbox, env: &[(&str, &str)], tweak: impl FnOnce(&mut Command)) -> Proc {
        let mut cmd = Command::new(tmsctl());
        cmd.args(["__demo-child", "--size", &SIZE.to_string(), "--tag", "demo"]);
        let mut cmd = clean(cmd, sb);
        cmd.env("LD_PRELOAD", libtms())
            .env("TMS_BACKEND", "sim")
            .env("TMS_SIM_CAPACITY", "1GiB")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        tweak(&mut cmd);
        let mut child = cmd.spawn().expect("spawn the demo child");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let pid = child.id();
        let mut p = Proc {
            stdin: child.stdin.take(),
            child,
            lines: rx,
            pid,
            ready: Value::Null,
        };
        let r = p.expect("READY");
        p.ready = serde_json::from_str(&r).expect("READY json");
        p
    }

    fn expect(&mut self, word: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let l = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("waiting for {word} from pid {}: {e}", self.pid));
            assert!(!l.starts_with("ERROR"), "child {}: {l}", self.pid);
            if let Some(rest) = l.strip_prefix(word) {
                return rest.trim().to_string();
            }
        }
    }

    fn cmd(&mut self, c: &str, expect: &str) -> String {
        let i = self.stdin.as_mut().expect("stdin");
        writeln!(i, "{c}").expect("write to the child");
        i.flush().expect("flush");
        self.expect(expect)
    }

    fn verify(&mut self) {
        assert_eq!(
            self.cmd("verify", "VERIFY"),
            "ok",
            "pattern of pid {}",
            self.pid
        );
    }

    fn assert_alive(&mut self) {
        assert!(
            matches!(self.child.try_wait(), Ok(None)),
            "pid {} died: {:?}",
            self.pid,
            self.child.try_wait()
        );
    }

    fn socket(&self) -> PathBuf {
        PathBuf::from(self.ready["socket"].as_str().expect("a control socket"))
    }

    /// Ask it to exit; wait.
    fn exit(mut self) -> std::process::ExitStatus {
        let _ = self.cmd("exit", "BYE");
        self.stdin = None;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st;
            }
            assert!(Instant::now() < deadline, "pid {} did not exit", self.pid);
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

struct Ran {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Ran {
    fn dump(&self) -> String {
        format!(
            "exit {}\n--- stdout\n{}--- stderr\n{}---",
            self.code, self.stdout, self.stderr
        )
    }

    fn json(&self) -> Value {
        assert_eq!(self.code, 0, "{}", self.dump());
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}\n{}", self.dump()))
    }

    /// Failed with `code` and exactly one line on stderr, starting with "tmsctl: ".
    fn failed(&self, code: i32) -> &str {
        assert_eq!(self.code, code, "{}", self.dump());
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one line on stderr\n{}", self.dump());
        assert!(lines[0].starts_with("tmsctl: "), "{}", self.dump());
        lines[0]
    }
}

fn output_of(mut cmd: Command) -> Output {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // An executable a test just copied can be busy for a moment: another test thread's fork
    // may still hold the copy's file open until that child execs.
    let mut tries = 0;
    let mut child = loop {
        match cmd.spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 50 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            r => break r.expect("spawn"),
        }
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{cmd:?} ran for more than 30 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.wait_with_output().expect("output")
}

fn ctl(sb: &Sandbox, args: &[&str]) -> Ran {
    ctl_with(&tmsctl(), sb, args, |_| {})
}

/// `exe` (a tmsctl) with `args`, in `sb`'s clean environment, after `tweak`.
fn ctl_with(exe: &Path, sb: &Sandbox, args: &[&str], tweak: impl FnOnce(&mut Command)) -> Ran {
    let mut cmd = Command::new(exe);
    cmd.args(args);
    let mut cmd = clean(cmd, sb);
    tweak(&mut cmd);
    let o = output_of(cmd);
    Ran {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

fn ok(sb: &Sandbox, args: &[&str]) -> Ran {
    let r = ctl(sb, args);
    assert_eq!(r.code, 0, "tmsctl {args:?}\n{}", r.dump());
    r
}

fn status(sb: &Sandbox, pid: u32) -> Value {
    ok(sb, &["status", "--pid", &pid.to_string(), "--json"]).json()
}

fn tag<'a>(s: &'a Value, name: &str) -> &'a Value {
    s["tags"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["tag"] == name))
        .unwrap_or_else(|| panic!("no tag {name} in {s}"))
}

fn free(s: &Value) -> u64 {
    s["devices"][0]["free_bytes"].as_u64().expect("device free")
}

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

// ---------------------------------------------------------------------------------------------

#[test]
fn help_for_every_subcommand() {
    let sb = sandbox();
    let top = ok(&sb, &["--help"]);
    for word in [
        "list",
        "status",
        "pause",
        "resume",
        "chunks",
        "region",
        "ping",
        "demo",
        "Exit codes",
    ] {
        assert!(top.stdout.contains(word), "{word}\n{}", top.stdout);
    }
    assert!(!top.stdout.contains("__demo-child"));
    for sub in [
        "list", "status", "pause", "resume", "chunks", "region", "ping", "demo",
    ] {
        let r = ok(&sb, &[sub, "--help"]);
        assert!(r.stdout.contains("Exit codes"), "{sub}\n{}", r.stdout);
        assert!(r.stdout.contains("--json"), "{sub}\n{}", r.stdout);
    }
    assert!(ok(&sb, &["--version"]).stdout.starts_with("tmsctl "));
    assert_eq!(ctl(&sb, &["frobnicate"]).code, 2);
    assert_eq!(ctl(&sb, &["pause", "--pid", "1", "--all"]).code, 2);
    assert_eq!(ctl(&sb, &["region", "--enable", "--disable"]).code, 2);
    assert_eq!(ctl(&sb, &["status", "--timeout", "0"]).code, 2);
}

#[test]
fn drives_a_preloaded_process_through_every_operation() {
    let sb = sandbox();
    let mut p = Proc::start(&sb, &[]);
    let pid = p.pid.to_string();
    assert_eq!(p.ready["backend"], "sim");

    // list, in both forms.
    let l = ok(&sb, &["list"]);
    assert!(
        l.stdout.contains(&pid) && l.stdout.contains("__demo-child"),
        "{}",
        l.stdout
    );
    let l = ok(&sb, &["list", "--json"]).json();
    assert_eq!(l[0]["pid"].as_u64(), Some(p.pid as u64));
    assert_eq!(l[0]["backend"], "sim");
    assert_eq!(l[0]["bytes_active"].as_u64(), Some(SIZE));

    assert!(ok(&sb, &["ping"]).stdout.contains("pong"));

    // status: live bytes as allocated.
    let s0 = status(&sb, p.pid);
    assert_eq!(s0["pid"].as_u64(), Some(p.pid as u64));
    assert_eq!(s0["backend"], "sim");
    assert_eq!(tag(&s0, "demo")["bytes_active"].as_u64(), Some(SIZE));
    assert_eq!(tag(&s0, "demo")["bytes_paused"].as_u64(), Some(0));
    let text = ok(&sb, &["status"]).stdout;
    assert!(text.contains("demo") && text.contains("8.00 MiB"), "{text}");

    // pause: the live bytes fall, the device's free memory rises, the backup holds the data.
    let r = ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    assert!(r.stdout.contains("paused tag \"demo\""), "{}", r.stdout);
    let s1 = status(&sb, p.pid);
    assert_eq!(tag(&s1, "demo")["bytes_active"].as_u64(), Some(0));
    assert_eq!(tag(&s1, "demo")["bytes_paused"].as_u64(), Some(SIZE));
    assert_eq!(tag(&s1, "demo")["host_backup_bytes"].as_u64(), Some(SIZE));
    assert_eq!(free(&s1), free(&s0) + SIZE);
    assert!(tag(&s1, "demo")["last_pause"]["seconds"].as_f64().is_some());
    // Pausing again is a no-op.
    let again = ok(&sb, &["pause", "--tag", "demo", "--json"]).json();
    assert_eq!(again["allocations"].as_u64(), Some(0));

    // resume: they rise again and the contents survived.
    let r = ok(&sb, &["resume", "--pid", &pid, "--tag", "demo", "--json"]).json();
    assert_eq!(r["op"], "resume");
    assert_eq!(r["bytes"].as_u64(), Some(SIZE));
    assert_eq!(r["copied_bytes"].as_u64(), Some(SIZE));
    let s2 = status(&sb, p.pid);
    assert_eq!(tag(&s2, "demo")["bytes_active"].as_u64(), Some(SIZE));
    assert_eq!(free(&s2), free(&s0));
    p.verify();

    // resume --no-wait: answered once the memory is mapped; the contents land in the process
    // (its verify reads through the library, after the restore).
    ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    let r = ok(
        &sb,
        &[
            "resume",
            "--pid",
            &pid,
            "--tag",
            "demo",
            "--no-wait",
            "--json",
        ],
    )
    .json();
    assert_eq!(r["bytes"].as_u64(), Some(SIZE));
    assert!(r["pending_bytes"].as_u64().unwrap_or(0) <= SIZE, "{r}");
    p.verify();
    assert_eq!(
        tag(&status(&sb, p.pid), "demo")["bytes_active"].as_u64(),
        Some(SIZE)
    );

    // The default region: off at first, so a plain cudaMalloc passes through (to no CUDA
    // runtime at all here, so it fails); once tmsctl enables it, cudaMalloc is pauseable.
    let r = ok(&sb, &["region", "--json"]).json();
    assert_eq!(r["enabled"], false);
    assert_ne!(p.cmd("malloc 4MiB", "MALLOC").split(' ').next(), Some("0"));
    let r = ok(
        &sb,
        &[
            "region",
            "--enable",
            "--tag",
            "kv",
            "--cpu-backup",
            "--backend",
            "mmap",
            "--json",
        ],
    )
    .json();
    assert_eq!(
        (
            r["enabled"].as_bool(),
            r["tag"].as_str(),
            r["cpu_backup"].as_bool(),
            r["backend"].as_str()
        ),
        (Some(true), Some("kv"), Some(true), Some("mmap"))
    );
    let text = ok(&sb, &["region"]).stdout;
    assert!(
        text.contains("pauseable, tag \"kv\", CPU backup (mmap)"),
        "{text}"
    );
    assert!(p.cmd("malloc 4MiB", "MALLOC").starts_with("0 0x"));
    let s3 = status(&sb, p.pid);
    assert_eq!(tag(&s3, "kv")["bytes_active"].as_u64(), Some(4 << 20));
    assert_eq!(s3["default_region"]["tag"], "kv");

    // Tags are independent; no --tag means every tag.
    ok(&sb, &["pause", "--tag", "kv"]);
    let s4 = status(&sb, p.pid);
    assert_eq!(tag(&s4, "kv")["bytes_paused"].as_u64(), Some(4 << 20));
    assert_eq!(tag(&s4, "demo")["bytes_active"].as_u64(), Some(SIZE));
    let all = ok(&sb, &["pause", "--json"]).json();
    assert_eq!(all["allocations"].as_u64(), Some(1));
    let all = ok(&sb, &["resume"]);
    assert!(all.stdout.contains("every tag"), "{}", all.stdout);
    let s5 = status(&sb, p.pid);
    assert_eq!(tag(&s5, "kv")["bytes_active"].as_u64(), Some(4 << 20));
    assert_eq!(tag(&s5, "demo")["bytes_active"].as_u64(), Some(SIZE));
    p.verify();

    ok(&sb, &["region", "--disable", "--no-cpu-backup"]);
    assert_ne!(p.cmd("malloc 2MiB", "MALLOC").split(' ').next(), Some("0"));

    // An error reply: exit code 1, one line.
    let line = ctl(&sb, &["pause", "--tag", ""]).failed(1).to_string();
    assert!(line.contains("tag must not be empty"), "{line}");
    let line = ctl(&sb, &["region", "--backend", "pinned"])
        .failed(1)
        .to_string();
    assert!(line.contains("without enabling CPU backup"), "{line}");

    // Its socket goes when it exits.
    let sock = p.socket();
    assert!(sock.exists());
    assert!(p.exit().success());
    assert!(!sock.exists(), "socket removed at exit");
    ctl(&sb, &["status"]).failed(3);
}

#[test]
fn two_processes_at_once() {
    let sb = sandbox();
    let mut a = Proc::start(&sb, &[]);
    let mut b = Proc::start(&sb, &[]);
    let line = ctl(&sb, &["status"]).failed(2).to_string();
    assert!(line.contains("--pid") && line.contains("--all"), "{line}");

    let l = ok(&sb, &["list", "--json"]).json();
    assert_eq!(l.as_array().map(Vec::len), Some(2));

    let r = ok(&sb, &["pause", "--all", "--json"]).json();
    assert_eq!(r.as_array().map(Vec::len), Some(2), "{r}");
    for p in [a.pid, b.pid] {
        let s = status(&sb, p);
        assert_eq!(tag(&s, "demo")["bytes_paused"].as_u64(), Some(SIZE));
    }
    // Only one of them resumed.
    ok(&sb, &["resume", "--pid", &a.pid.to_string()]);
    assert_eq!(
        tag(&status(&sb, a.pid), "demo")["bytes_active"].as_u64(),
        Some(SIZE)
    );
    assert_eq!(
        tag(&status(&sb, b.pid), "demo")["bytes_paused"].as_u64(),
        Some(SIZE)
    );
    let text = ok(&sb, &["resume", "--all"]).stdout;
    assert_eq!(text.lines().count(), 2, "{text}");
    let s = ok(&sb, &["status", "--all", "--json"]).json();
    for item in s.as_array().expect("array") {
        assert_eq!(tag(item, "demo")["bytes_active"].as_u64(), Some(SIZE));
    }
    a.verify();
    b.verify();
    assert!(ok(&sb, &["ping", "--all"]).stdout.lines().count() == 2);
}

#[test]
fn failures_have_exit_codes_and_one_line_reasons() {
    let sb = sandbox();
    // Nothing there at all.
    assert!(ctl(&sb, &["status"]).failed(3).contains("no process"));
    assert!(ctl(&sb, &["pause", "--all"])
        .failed(3)
        .contains("no process"));
    let l = ok(&sb, &["list"]);
    assert!(l.stdout.contains("no process"), "{}", l.stdout);
    assert_eq!(ok(&sb, &["list", "--json"]).json(), Value::Array(vec![]));

    // A process that does not exist, and one without a socket (this test).
    let mut gone = Command::new("true").spawn().expect("true");
    let dead = gone.id();
    gone.wait().expect("wait");
    let line = ctl(&sb, &["status", "--pid", &dead.to_string()])
        .failed(3)
        .to_string();
    assert!(line.contains("no such process"), "{line}");
    let me = std::process::id().to_string();
    let line = ctl(&sb, &["ping", "--pid", &me]).failed(3).to_string();
    assert!(line.contains("no control socket"), "{line}");

    // A socket nobody answers on (bound, then the listener dropped): stale.
    std::fs::create_dir_all(&sb.dir).expect("mkdir");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let path = sb.dir.join(format!("{me}.sock"));
    drop(UnixListener::bind(&path).expect("bind"));
    let line = ctl(&sb, &["ping", "--pid", &me]).failed(3).to_string();
    assert!(line.contains("stale"), "{line}");
    std::fs::remove_file(&path).expect("rm");

    // A socket that accepts and never answers: a timeout.
    let listener = UnixListener::bind(&path).expect("bind");
    let held = std::thread::spawn(move || {
        let conns: Vec<UnixStream> = listener.incoming().take(1).flatten().collect();
        std::thread::sleep(Duration::from_millis(1500));
        drop(conns);
    });
    let t = Instant::now();
    let line = ctl(&sb, &["status", "--pid", &me, "--timeout", "0.5"])
        .failed(5)
        .to_string();
    assert!(line.contains("did not answer"), "{line}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    held.join().expect("join");
    std::fs::remove_file(&path).expect("rm");

    // tmsctl demo without a library to preload.
    let r = ctl(
        &sb,
        &["demo", "--lib", "/nonexistent/libtms.so", "--size", "4MiB"],
    );
    assert!(r.failed(1).contains("cannot find libtms.so"));
}

#[test]
fn another_user_is_refused() {
    if !is_root() {
        eprintln!("skipped: needs root to run the preloaded process as another user (the credential checks themselves are unit-tested in preload/src/control/auth.rs and ctl/src/client.rs)");
        return;
    }
    // The preloaded process runs as nobody (65534) in a folder it creates itself; we (root)
    // get past the folder's and socket's modes, but not past the server's uid check.
    let sb = sandbox();
    std::os::unix::fs::chown(sb.tmp.path(), Some(65534), Some(65534)).expect("chown");
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
fn a_fork_child_leaves_the_parents_socket_alone() {
    let sb = sandbox();
    let mut p = Proc::start(&sb, &[]);
    let sock = p.socket();
    // The child exits normally (running atexit handlers) after fork.
    let forked = p.cmd("fork", "FORKED");
    assert!(forked.ends_with(" 0"), "{forked}");
    assert!(sock.exists(), "the parent's socket is still there");
    let entries: Vec<_> = std::fs::read_dir(&sb.dir).expect("ls").flatten().collect();
    assert_eq!(entries.len(), 1, "no socket of the child: {entries:?}");
    let r = ok(&sb, &["ping", "--json"]).json();
    assert_eq!(r["pid"].as_u64(), Some(p.pid as u64));
    ok(&sb, &["pause"]);
    ok(&sb, &["resume"]);
    p.verify();
}

#[test]
fn stale_sockets_are_cleaned() {
    let sb = sandbox();
    std::fs::create_dir_all(&sb.dir).expect("mkdir");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let mut gone = Command::new("true").spawn().expect("true");
    let dead = gone.id();
    gone.wait().expect("wait");
    let stale = sb.dir.join(format!("{dead}.sock"));
    drop(UnixListener::bind(&stale).expect("bind"));
    assert!(stale.exists());
    let mut p = Proc::start(&sb, &[]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while stale.exists() {
        assert!(Instant::now() < deadline, "stale socket still there");
        std::thread::sleep(Duration::from_millis(20));
    }
    p.verify();
}

#[test]
fn no_socket_without_pauseable_memory_or_with_tms_control_0() {
    let sb = sandbox();
    let so = libtms();
    // Programs that never touch CUDA, preloaded, even told every allocation is pauseable.
    for (prog, args) in [
        ("/bin/true", vec![]),
        ("/bin/sh", vec!["-c", "echo hi"]),
        (tmsctl().to_str().expect("utf-8 path"), vec!["--version"]),
    ] {
        let mut cmd = Command::new(prog);
        cmd.args(&args);
        let mut cmd = clean(cmd, &sb);
        cmd.env("LD_PRELOAD", &so)
            .env("TMS_INIT_ENABLE", "1")
            .env("TMS_BACKEND", "sim")
            .env("TMS_LOG", "debug");
        let o = output_of(cmd);
        assert!(o.status.success(), "{prog}: {o:?}");
        assert!(
            o.stderr.is_empty(),
            "{prog}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(!sb.dir.exists(), "{prog} created {}", sb.dir.display());
    }
    // TMS_CONTROL=0: pauseable memory, no socket (and no folder).
    let mut p = Proc::start(&sb, &[("TMS_CONTROL", "0")]);
    assert!(p.ready["socket"].is_null(), "{}", p.ready);
    assert!(
        p.ready["socket_error"]
            .as_str()
            .unwrap_or("")
            .contains("TMS_CONTROL"),
        "{}",
        p.ready
    );
    assert!(!sb.dir.exists());
    p.verify();
}

#[test]
fn a_refused_socket_folder_leaves_the_process_working() {
    let sb = sandbox();
    std::fs::create_dir_all(&sb.dir).expect("mkdir");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut p = Proc::start(&sb, &[]);
    assert!(p.ready["socket"].is_null(), "{}", p.ready);
    let why = p.ready["socket_error"].as_str().unwrap_or("").to_string();
    assert!(why.contains("refusing") && why.contains("0755"), "{why}");
    assert_eq!(std::fs::read_dir(&sb.dir).expect("ls").count(), 0);
    p.verify();
}

#[test]
fn demo_on_the_sim() {
    let sb = sandbox();
    let r = ok(&sb, &["demo", "--backend", "sim", "--size", "6MiB"]);
    for want in ["driver sim", "paused", "resumed", "identical", "demo OK"] {
        assert!(r.stdout.contains(want), "{want}\n{}", r.dump());
    }
    // auto (TMS_BACKEND unset): CUDA where it can start, else the sim, saying why.
    let j = ok(&sb, &["demo", "--size", "4MiB", "--json"]).json();
    assert_eq!(j["ok"], true, "{j}");
    assert_eq!(j["steps"][1]["bytes_paused"].as_u64(), Some(4 << 20));
    if j["backend"] == "sim" {
        assert!(j["fallback_reason"].as_str().is_some(), "{j}");
        assert_eq!(j["given_back_bytes"].as_u64(), Some(4 << 20));
    }
    // The children are gone, and their sockets with them.
    assert_eq!(
        std::fs::read_dir(&sb.dir).map(|d| d.count()).unwrap_or(0),
        0
    );
}

/// A process whose allocation is backed up on disk: status shows the file's bytes per tag (in
/// the table and in JSON), the pause and resume from outside keep the contents, and the file is
/// gone when the process exits.
#[test]
fn status_shows_disk_backups() {
    let sb = sandbox();
    let dir = sb.tmp.path().join("disk");
    std::fs::create_dir(&dir).unwrap();
    let d = dir.to_str().unwrap().to_string();
    let mut p = Proc::start_with(&sb, &[("TMS_DISK_BACKUP_DIR", &d)], |c| {
        c.arg("--disk");
    });
    let pid = p.pid.to_string();
    ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    let s = status(&sb, p.pid);
    assert_eq!(tag(&s, "demo")["disk_backup_bytes"].as_u64(), Some(SIZE));
    assert_eq!(tag(&s, "demo")["host_backup_bytes"].as_u64(), Some(0));
    let text = ok(&sb, &["status", "--pid", &pid]).stdout;
    assert!(
        text.contains("DISK BACKUP") && text.contains("8.00 MiB"),
        "{text}"
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    ok(&sb, &["resume", "--pid", &pid, "--tag", "demo"]);
    p.verify();
    assert!(p.exit().success());
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "the file went with its process"
    );
}

/// Issue 35, item 1: a process whose `TMS_DISK_BACKUP_DIR` does not exist when it starts (as a
/// job's per-rank folder made later) is paused from outside: the folder is made. Wiped and made
/// again while paused, the resume still restores the contents (from the file the process holds),
/// and the next pause puts a new file in the new folder.
#[test]
fn a_disk_folder_missing_at_start_and_wiped_while_paused_works_through_tmsctl() {
    let sb = sandbox();
    let dir = sb.tmp.path().join("job").join("rank0");
    let d = dir.to_str().unwrap().to_string();
    let mut p = Proc::start_with(&sb, &[("TMS_DISK_BACKUP_DIR", &d)], |c| {
        c.arg("--disk");
    });
    assert!(!dir.exists(), "made only when needed");
    let pid = p.pid.to_string();
    let files = || std::fs::read_dir(&dir).unwrap().count();
    ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    assert_eq!(files(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::create_dir(&dir).unwrap();
    ok(&sb, &["resume", "--pid", &pid, "--tag", "demo"]);
    p.verify();
    ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    assert_eq!(files(), 1, "a new file in the new folder");
    ok(&sb, &["resume", "--pid", &pid, "--tag", "demo"]);
    p.verify();
    assert!(p.exit().success());
    assert_eq!(files(), 0, "the file went with its process");
}

/// A disk-backed demo child with its folder of backups, paused from outside (its file exists).
fn paused_on_disk(sb: &Sandbox) -> (Proc, PathBuf) {
    let dir = sb.tmp.path().join("disk");
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap().to_string();
    let p = Proc::start_with(sb, &[("TMS_DISK_BACKUP_DIR", &d)], |c| {
        c.arg("--disk");
    });
    ok(sb, &["pause", "--pid", &p.pid.to_string(), "--tag", "demo"]);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    (p, dir)
}

/// Issue 23, item 5: a fork child that exits normally runs the atexit handlers it inherited;
/// they used to remove the parent's live backup files.
#[test]
fn a_fork_child_leaves_the_parents_disk_backups_alone() {
    let sb = sandbox();
    let (mut p, dir) = paused_on_disk(&sb);
    let forked = p.cmd("fork", "FORKED");
    assert!(forked.ends_with(" 0"), "{forked}");
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        1,
        "the parent's backup file is still there"
    );
    ok(
        &sb,
        &["resume", "--pid", &p.pid.to_string(), "--tag", "demo"],
    );
    p.verify();
    assert!(p.exit().success());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

/// Issue 23, item 5: SIGTERM (how SLURM and Kubernetes stop jobs) removes the backup files and
/// the socket, and still ends the process by the signal.
#[test]
fn sigterm_removes_the_backup_files_and_the_socket() {
    use std::os::unix::process::ExitStatusExt;
    let sb = sandbox();
    let (mut p, dir) = paused_on_disk(&sb);
    let sock = p.socket();
    assert!(sock.exists());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(p.pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let st = loop {
        if let Ok(Some(st)) = p.child.try_wait() {
            break st;
        }
        assert!(Instant::now() < deadline, "pid {} survived SIGTERM", p.pid);
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(st.signal(), Some(libc::SIGTERM), "{st:?}");
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert!(left.is_empty(), "backup files left: {left:?}");
    assert!(!sock.exists(), "the socket was left");
}

/// `tmsctl clean` removes a dead process's backup file and stale socket, and leaves a live
/// process's file and socket, and a FIFO under a backup file's name (without blocking on it).
#[test]
fn clean_removes_what_dead_processes_left() {
    let sb = sandbox();
    let (mut p, dir) = paused_on_disk(&sb);
    let live: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let dead = dir.join("tms-backup-4242-0-0.bin");
    std::fs::write(&dead, b"old").unwrap();
    let fifo = dir.join("tms-backup-4243-0-0.bin");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let mut gone = Command::new("true").spawn().expect("true");
    let dead_pid = gone.id();
    gone.wait().expect("wait");
    let stale = sb.dir.join(format!("{dead_pid}.sock"));
    drop(UnixListener::bind(&stale).expect("bind"));

    let r = ok(&sb, &["clean", "--disk-dir", dir.to_str().unwrap()]);
    assert!(
        r.stdout.contains("removed 1 disk backup file")
            && r.stdout.contains("removed 1 control socket"),
        "{}",
        r.dump()
    );
    assert!(!dead.exists() && !stale.exists(), "{}", r.dump());
    assert!(live[0].exists() && p.socket().exists() && fifo.exists());
    let j = ok(
        &sb,
        &["clean", "--disk-dir", dir.to_str().unwrap(), "--json"],
    )
    .json();
    assert_eq!(
        (
            j["backup_files_removed"].as_u64(),
            j["sockets_removed"].as_u64()
        ),
        (Some(0), Some(0)),
        "{j}"
    );
    let help = ok(&sb, &["clean", "--help"]).stdout;
    assert!(
        help.contains("--disk-dir") && help.contains("nobody listens"),
        "{help}"
    );
    ok(
        &sb,
        &["resume", "--pid", &p.pid.to_string(), "--tag", "demo"],
    );
    p.verify();
}

/// A demo larger than the host's memory fails at once with the numbers (the sim's device memory
/// is host memory), instead of being killed by the kernel after filling it. The host is
/// pretended 64 GiB, so the answer does not depend on this machine's memory.
#[test]
fn demo_larger_than_the_host_fails_with_a_clear_error() {
    let sb = sandbox();
    let t0 = Instant::now();
    let r = ctl_with(
        &tmsctl(),
        &sb,
        &["demo", "--backend", "sim", "--size", "1TiB"],
        |c| {
            c.env("TMS_SIM_HOST_MEMORY", "64GiB");
        },
    );
    assert_ne!(r.code, 0, "{}", r.dump());
    assert!(t0.elapsed() < Duration::from_secs(20), "{}", r.dump());
    let all = format!("{}{}", r.stdout, r.stderr);
    for want in ["out of memory", "host RAM", "68719476736"] {
        assert!(all.contains(want), "{want:?}\n{}", r.dump());
    }
}

// ---------------------------------------------------------------------------------------------
// Trust, pid namespaces, unknown tags, escaping, usage errors, the installed layout.

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Our pid namespace's inode (the tests need /proc).
fn our_ns() -> u64 {
    tms_proto::pid_namespace().expect("/proc/self/ns/pid")
}

/// `<pid>.<our-ns>.sock`.
fn our_name(pid: u32) -> String {
    format!("{pid}.{}.sock", our_ns())
}

/// `sb.dir`, made as the server makes it (mode 0700).
fn private_dir(sb: &Sandbox) -> &Path {
    std::fs::create_dir_all(&sb.dir).expect("mkdir");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    &sb.dir
}

type Answer = Arc<dyn Fn(&Value) -> String + Send + Sync>;

/// Read a client's hello on `conn` and answer it as process `pid`; the request lines that follow,
/// or `None` when the client went away first.
fn greet(conn: &mut UnixStream, pid: u32) -> Option<std::io::Lines<BufReader<UnixStream>>> {
    let mut lines = BufReader::new(conn.try_clone().ok()?).lines();
    lines.next()?.ok()?;
    let hello = format!(
        "{{\"reply\":\"hello\",\"protocol\":1,\"pid\":{pid},\"software\":\"fake 1\",\"backend\":\"sim\"}}\n"
    );
    conn.write_all(hello.as_bytes()).ok()?;
    Some(lines)
}

/// A server of the test's own (in this process, so the kernel reports this process's pid and
/// uid for it), listening on `dir/file`: it answers the hello with `hello_pid` and every
/// request with `answer(request)`, and records the requests.
struct Fake {
    requests: Arc<Mutex<Vec<Value>>>,
    path: PathBuf,
}

impl Fake {
    fn start(dir: &Path, file: &str, hello_pid: u32, answer: Answer) -> Fake {
        Fake::start_busy(dir, file, hello_pid, answer, 0)
    }

    /// The same, but the first `busy` connections get a `busy` error and are closed at once,
    /// as a server with no room for them does.
    fn start_busy(dir: &Path, file: &str, hello_pid: u32, answer: Answer, busy: usize) -> Fake {
        let path = dir.join(file);
        let listener = UnixListener::bind(&path).expect("bind the fake server");
        let requests = Arc::new(Mutex::new(Vec::new()));
        let log = requests.clone();
        std::thread::spawn(move || {
            for (n, conn) in listener.incoming().enumerate() {
                let Ok(mut conn) = conn else { break };
                if n < busy {
                    let _ = conn.write_all(
                        b"{\"reply\":\"error\",\"kind\":\"busy\",\"message\":\"no room for another connection\"}\n",
                    );
                    continue;
                }
                let Some(lines) = greet(&mut conn, hello_pid) else {
                    continue;
                };
                for line in lines {
                    let Ok(line) = line else { break };
                    let req: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
                    let mut reply = answer(&req);
                    log.lock().expect("log").push(req);
                    reply.push('\n');
                    if conn.write_all(reply.as_bytes()).is_err() {
                        break;
                    }
                }
            }
        });
        Fake { requests, path }
    }

    /// The operations it was asked for (after the hello).
    fn ops(&self) -> Vec<String> {
        self.requests
            .lock()
            .expect("log")
            .iter()
            .map(|r| r["op"].as_str().unwrap_or("?").to_string())
            .collect()
    }
}

/// Answers like a server with one tag "kv" of 8 MiB (pid `pid`).
fn honest(pid: u32) -> Answer {
    Arc::new(move |req: &Value| -> String {
        match req["op"].as_str() {
            Some("ping") => format!("{{\"reply\":\"pong\",\"pid\":{pid}}}"),
            Some("status") => serde_json::json!({
                "reply": "status", "pid": pid, "backend": "sim", "retain_cpu_backup": false,
                "memory_margin_bytes": 0, "devices": [],
                "tags": [{"tag": "kv", "allocations": 1, "active_allocations": 1,
                          "paused_allocations": 0, "bytes_requested": 8 << 20,
                          "bytes_active": 8 << 20, "bytes_paused": 0, "host_backup_bytes": 0}],
            })
            .to_string(),
            Some(op @ ("pause" | "resume")) => {
                let tag = req["tag"].as_str();
                let known = tag.is_none_or(|t| t == "kv");
                let mut d = serde_json::json!({
                    "reply": "done", "op": op, "allocations": u64::from(known),
                    "bytes": if known { 8u64 << 20 } else { 0 }, "copied_bytes": 0, "seconds": 0.01,
                });
                if let Some(t) = tag {
                    d["tag"] = t.into();
                }
                if !known {
                    d["unknown_tag"] = true.into();
                }
                d.to_string()
            }
            _ => "{\"reply\":\"error\",\"kind\":\"unsupported\",\"message\":\"not in the fake\"}"
                .to_string(),
        }
    })
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

/// A live process that is not ours to speak for (a `sleep`), killed on drop.
struct Victim(Child);

impl Victim {
    fn start() -> Victim {
        Victim(Command::new("sleep").arg("60").spawn().expect("sleep"))
    }
    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
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
fn an_unknown_tag_is_exit_6_with_a_reason() {
    // The client's side, against a fake server that sets unknown_tag.
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let _fake = Fake::start(dir, &our_name(me), me, honest(me));
    let r = ctl(&sb, &["pause", "--tag", "kvv"]);
    let line = r.failed(6).to_string();
    assert!(
        line.contains(&format!("process {me}"))
            && line.contains("ever had tag \"kvv\"")
            && line.contains("nothing was paused"),
        "{line}"
    );
    assert_eq!(r.stdout, "", "{}", r.dump());
    let line = ctl(&sb, &["resume", "--tag", "kvv"]).failed(6).to_string();
    assert!(line.contains("nothing was resumed"), "{line}");
    let r = ctl(&sb, &["pause", "--tag", "kvv", "--json"]);
    r.failed(6);
    let j: Value = serde_json::from_str(&r.stdout).expect("json");
    assert_eq!(j["unknown_tag"], true, "{j}");
    // A tag it has, and every tag: fine.
    ok(&sb, &["pause", "--tag", "kv"]);
    ok(&sb, &["resume"]);
    // --all: 6 when the unknown tag is the only problem ...
    ctl(&sb, &["pause", "--all", "--tag", "kvv"]).failed(6);
    // ... but another failure (here a stale socket of a live process) takes precedence.
    let victim = Victim::start();
    drop(UnixListener::bind(dir.join(our_name(victim.pid()))).expect("bind"));
    let r = ctl(&sb, &["pause", "--all", "--tag", "kvv"]);
    assert_eq!(r.code, 3, "{}", r.dump());
    assert_eq!(
        r.stderr.lines().count(),
        2,
        "one line per process\n{}",
        r.dump()
    );
    assert!(
        r.stderr.contains("stale") && r.stderr.contains("\"kvv\""),
        "{}",
        r.dump()
    );
    let r = ctl(&sb, &["pause", "--all", "--tag", "kvv", "--json"]);
    assert_eq!(r.code, 3, "{}", r.dump());
    let items: Value = serde_json::from_str(&r.stdout).expect("json");
    assert_eq!(items.as_array().map(Vec::len), Some(2), "{items}");
}

#[test]
fn an_unknown_tag_of_a_real_process_is_exit_6() {
    // Needs the server to set `unknown_tag` (libtms.so of this tree).
    let sb = sandbox();
    let mut p = Proc::start(&sb, &[]);
    let line = ctl(&sb, &["pause", "--tag", "dmeo"]).failed(6).to_string();
    assert!(
        line.contains(&format!("process {}", p.pid)) && line.contains("\"dmeo\""),
        "{line}"
    );
    ctl(&sb, &["resume", "--tag", "dmeo"]).failed(6);
    ctl(&sb, &["pause", "--all", "--tag", "dmeo"]).failed(6);
    // Nothing changed; the real tag still works.
    assert_eq!(
        tag(&status(&sb, p.pid), "demo")["bytes_active"].as_u64(),
        Some(SIZE)
    );
    ok(&sb, &["pause", "--tag", "demo"]);
    ok(&sb, &["resume", "--tag", "demo"]);
    p.verify();
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

#[test]
fn usage_errors_are_one_line() {
    let sb = sandbox();
    for args in [
        &["frobnicate"][..],
        &[],
        &["pause", "--pid", "1", "--all"],
        &["region", "--enable", "--disable"],
        &["status", "--timeout", "0"],
        &["pause", "--pid", "x"],
        &["demo", "--backend", "auto"],
    ] {
        let line = ctl(&sb, args).failed(2).to_string();
        assert!(line.contains("--help"), "{args:?}: {line}");
    }
    let line = ctl(&sb, &["pause", "--tagg", "kv"]).failed(2).to_string();
    assert!(
        line.contains("'tmsctl pause --help'") && line.contains("'--tag'"),
        "{line}"
    );
    let line = ctl(&sb, &["demo", "--backend", "auto"])
        .failed(2)
        .to_string();
    assert!(
        line.contains("cuda-or-sim") && line.contains("'tmsctl demo --help'"),
        "{line}"
    );
    assert!(ctl(&sb, &[]).failed(2).contains("a command is needed"));
}

/// A copy of tmsctl at `root/bin/tmsctl` and of libtms.so at `root/<lib>` (as pip lays out).
fn install(root: &Path, lib: Option<&str>) -> PathBuf {
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).expect("mkdir");
    let exe = bin.join("tmsctl");
    std::fs::copy(tmsctl(), &exe).expect("copy tmsctl");
    if let Some(lib) = lib {
        let to = root.join(lib);
        std::fs::create_dir_all(to.parent().expect("folder")).expect("mkdir");
        std::fs::copy(libtms(), &to).expect("copy libtms.so");
    }
    exe
}

#[test]
fn demo_finds_the_library_where_pip_puts_it() {
    let sb = sandbox();
    for (root, lib) in [
        // pip install . (in a venv, or --user)
        (
            "venv",
            "lib/python3.11/site-packages/torch_memory_saver/libtms.abi3.so",
        ),
        // pip install --target DIR
        ("target", "torch_memory_saver/libtms.abi3.so"),
        // only the existing library's name, beside the package
        (
            "upstream",
            "lib/python3.12/site-packages/torch_memory_saver_hook_mode_preload.abi3.so",
        ),
    ] {
        let root = sb.tmp.path().join(root);
        let exe = install(&root, Some(lib));
        let r = ctl_with(
            &exe,
            &sb,
            &["demo", "--backend", "sim", "--size", "8MiB"],
            |_| {},
        );
        assert_eq!(r.code, 0, "{lib}\n{}", r.dump());
        assert!(r.stdout.contains("demo OK"), "{}", r.dump());
        let used = std::fs::canonicalize(root.join(lib)).expect("canonical");
        assert!(
            r.stdout.contains(&format!("LD_PRELOAD={}", used.display())),
            "{}",
            r.dump()
        );
    }
    // Nowhere: the reason lists what was tried, patterns included.
    let exe = install(&sb.tmp.path().join("bare"), None);
    let line = ctl_with(&exe, &sb, &["demo", "--backend", "sim"], |_| {})
        .failed(1)
        .to_string();
    for want in [
        "cannot find libtms.so",
        "bare/bin/libtms.so",
        "bare/lib/libtms.so",
        "bare/lib/python3*/*-packages/torch_memory_saver/libtms*.so",
        "bare/torch_memory_saver/libtms*.so",
        "torch_memory_saver_hook_mode_preload*.so",
    ] {
        assert!(line.contains(want), "{want}: {line}");
    }
}

#[test]
fn demo_says_which_device_it_chose_and_why() {
    let sb = sandbox();
    let r = ok(&sb, &["demo", "--backend", "sim", "--size", "4MiB"]);
    assert!(
        r.stdout
            .contains("driver sim (the simulated device: --backend sim)"),
        "{}",
        r.dump()
    );
    let r = ctl_with(&tmsctl(), &sb, &["demo", "--size", "4MiB"], |c| {
        c.env("TMS_BACKEND", "sim");
    });
    assert!(r.stdout.contains("TMS_BACKEND=sim"), "{}", r.dump());
    // The default: CUDA if it starts, else the simulated device, named as such.
    let j = ok(&sb, &["demo", "--size", "4MiB", "--json"]).json();
    assert_eq!(j["backend_choice"], "cuda-or-sim", "{j}");
    assert!(
        j["backend_because"]
            .as_str()
            .unwrap_or("")
            .contains("default"),
        "{j}"
    );
    // TMS_BACKEND=auto is the library's: CUDA only.
    let r = ctl_with(&tmsctl(), &sb, &["demo", "--size", "4MiB"], |c| {
        c.env("TMS_BACKEND", "auto");
    });
    if r.code == 0 {
        assert!(
            r.stdout.contains("driver cuda (TMS_BACKEND=auto"),
            "{}",
            r.dump()
        );
    } else {
        let line = r.failed(1);
        assert!(line.contains("CUDA only"), "{line}");
    }
}

#[test]
fn a_busy_server_is_asked_again_until_the_timeout() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let fake = Fake::start_busy(dir, &our_name(me), me, honest(me), 3);
    assert!(ok(&sb, &["ping"]).stdout.contains("pong"));
    assert_eq!(fake.ops(), ["ping"]);
    std::fs::remove_file(&fake.path).expect("rm");

    let _always = Fake::start_busy(dir, &our_name(me), me, honest(me), usize::MAX);
    let t = Instant::now();
    let line = ctl(&sb, &["ping", "--timeout", "0.5"])
        .failed(5)
        .to_string();
    assert!(
        line.contains("no room") && line.contains("--timeout"),
        "{line}"
    );
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

/// A process with a chunked allocation (4 chunks of 2 MiB): chunks paused and resumed from
/// outside, the tag partial in status meanwhile, chunk states shown and saved, the contents
/// kept; bad chunk lists are refused in one line each.
#[test]
fn chunks_of_a_preloaded_process() {
    const CHUNK: u64 = 2 << 20;
    let sb = sandbox();
    let mut p = Proc::start_with(&sb, &[], |c| {
        c.args(["--chunk", "2MiB"]);
    });
    let pid = p.pid.to_string();
    let chunks = |sb: &Sandbox| ok(sb, &["chunks", "--tag", "demo", "--json"]).json();

    let c = chunks(&sb);
    assert_eq!(c["pid"].as_u64(), Some(p.pid as u64));
    assert_eq!(c["chunk_size"].as_u64(), Some(CHUNK));
    assert_eq!(c["count"].as_u64(), Some(4));
    assert_eq!(c["addr"].as_u64(), p.ready["ptr"].as_u64());
    assert_eq!(
        (c["active"].as_str(), c["paused"].as_str()),
        (Some("0-3"), Some(""))
    );
    let text = ok(&sb, &["chunks", "--tag", "demo"]).stdout;
    assert!(
        text.contains("4 chunks of 2.00 MiB (8.00 MiB)")
            && text.contains("active: 4 chunks, 8.00 MiB: 0-3")
            && text.contains("paused: 0 chunks, 0 B"),
        "{text}"
    );

    // Chunks 1 and 2 go: the tag is partial, half its bytes paused, the device has them back.
    let s0 = status(&sb, p.pid);
    let r = ok(
        &sb,
        &["pause", "--pid", &pid, "--tag", "demo", "--chunks", "1-2"],
    );
    assert!(
        r.stdout
            .contains("paused chunks 1-2 of tag \"demo\": 4.00 MiB of device memory released"),
        "{}",
        r.stdout
    );
    let s1 = status(&sb, p.pid);
    let t = tag(&s1, "demo");
    assert_eq!(t["partial_allocations"].as_u64(), Some(1));
    assert_eq!(t["paused_allocations"].as_u64(), Some(0));
    assert_eq!(t["bytes_active"].as_u64(), Some(2 * CHUNK));
    assert_eq!(t["bytes_paused"].as_u64(), Some(2 * CHUNK));
    assert_eq!(free(&s1), free(&s0) + 2 * CHUNK);
    let text = ok(&sb, &["status"]).stdout;
    assert!(text.contains("PARTIAL"), "{text}");
    let c = chunks(&sb);
    assert_eq!(
        (c["active"].as_str(), c["paused"].as_str()),
        (Some("0,3"), Some("1-2"))
    );
    assert_eq!(c["states"], "1001");
    // The active chunks are still there to use.
    assert_eq!(p.cmd("verify 0 2MiB", "VERIFY"), "ok");
    assert_eq!(p.cmd("verify 6MiB 2MiB", "VERIFY"), "ok");
    // Again: nothing to do.
    let r = ok(
        &sb,
        &["pause", "--tag", "demo", "--chunks", "2,1", "--json"],
    )
    .json();
    assert_eq!(r["allocations"].as_u64(), Some(0));
    assert_eq!(r["chunks"], serde_json::json!([[1, 2]]));

    // Bad lists: out of range (the process names it), malformed, no tag (usage, one line).
    let line = ctl(&sb, &["resume", "--tag", "demo", "--chunks", "3-4"])
        .failed(1)
        .to_string();
    assert!(
        line.contains("chunk 4 ") && line.contains("it has 4 chunks (0 to 3)"),
        "{line}"
    );
    for (args, words) in [
        (
            &["pause", "--tag", "demo", "--chunks", "x"][..],
            "is not an index",
        ),
        (
            &["pause", "--tag", "demo", "--chunks", "3-1"],
            "runs backwards",
        ),
        (&["pause", "--tag", "demo", "--chunks", ""], "empty item"),
        (
            &["pause", "--tag", "demo", "--chunks", "0-99999999"],
            "more than 1048576",
        ),
        (&["pause", "--chunks", "1"], "--tag"),
        (&["resume", "--chunks", "1"], "--tag"),
        (
            &[
                "pause",
                "--tag",
                "demo",
                "--chunks",
                "1",
                "--save-chunk-state",
            ],
            "cannot be used with",
        ),
        (&["chunks"], "--tag"),
        (
            &["resume", "--tag", "demo", "--chunks", "1", "--no-wait"],
            "cannot be used with",
        ),
        (
            &["resume", "--no-wait", "--restore-chunk-state"],
            "cannot be used with",
        ),
        (&["resume", "--no-wait", "--atomic"], "cannot be used with"),
    ] {
        let line = ctl(&sb, args).failed(2).to_string();
        assert!(
            line.contains(words) && line.contains("--help"),
            "{args:?}: {line}"
        );
    }
    // A tag without a chunked allocation; a tag no allocation ever had (exit 6, as for a
    // whole tag).
    ok(&sb, &["region", "--enable", "--tag", "kv", "--cpu-backup"]);
    assert!(p.cmd("malloc 2MiB", "MALLOC").starts_with("0 0x"));
    let line = ctl(&sb, &["pause", "--tag", "kv", "--chunks", "0"])
        .failed(1)
        .to_string();
    assert!(line.contains("\"kv\" has no chunked allocation"), "{line}");
    let line = ctl(&sb, &["chunks", "--tag", "kv"]).failed(1).to_string();
    assert!(line.contains("no chunked allocation"), "{line}");
    let line = ctl(&sb, &["pause", "--tag", "demoo", "--chunks", "0"])
        .failed(6)
        .to_string();
    assert!(line.contains("ever had tag \"demoo\""), "{line}");
    // Nothing changed on the way.
    assert_eq!(chunks(&sb)["states"], "1001");

    // Back, and the pattern is whole.
    let r = ok(
        &sb,
        &["resume", "--tag", "demo", "--chunks", "1-2", "--json"],
    )
    .json();
    assert_eq!(r["bytes"].as_u64(), Some(2 * CHUNK));
    assert_eq!(r["copied_bytes"].as_u64(), Some(2 * CHUNK));
    p.verify();
    let t = tag(&status(&sb, p.pid), "demo").clone();
    assert_eq!(t["partial_allocations"].as_u64(), Some(0));
    assert_eq!(t["bytes_active"].as_u64(), Some(SIZE));

    // Saved chunk states: chunk 3 paused alone, then the whole tag with its states saved;
    // restoring them brings back 0 to 2 only, and a plain resume the rest.
    ok(&sb, &["pause", "--tag", "demo", "--chunks", "3"]);
    let r = ok(&sb, &["pause", "--tag", "demo", "--save-chunk-state"]);
    assert!(r.stdout.contains("(chunk states saved)"), "{}", r.stdout);
    assert_eq!(chunks(&sb)["states"], "0000");
    let r = ok(&sb, &["resume", "--tag", "demo", "--restore-chunk-state"]);
    assert!(
        r.stdout.contains("6.00 MiB of device memory re-taken"),
        "{}",
        r.stdout
    );
    assert_eq!(chunks(&sb)["paused"], "3");
    assert_eq!(p.cmd("verify 0 6MiB", "VERIFY"), "ok");
    ok(&sb, &["resume", "--tag", "demo"]);
    assert_eq!(chunks(&sb)["paused"], "");
    p.verify();
    assert!(p.exit().success());
}

/// A pause that outlasts --timeout (a slow device: every synchronization takes 3 s) is
/// reported as sent and still running (exit 7), not as "no answer" (5); `status` lists it
/// while it runs and no longer once it has ended, paused as asked.
#[test]
fn a_pause_longer_than_the_timeout_is_reported_running_and_seen_in_status() {
    let sb = sandbox();
    let mut p = Proc::start(&sb, &[("TMS_SIM_SYNC_DELAY_MS", "3000")]);
    let pid = p.pid.to_string();
    let t = Instant::now();
    let r = ctl(
        &sb,
        &["pause", "--pid", &pid, "--tag", "demo", "--timeout", "1"],
    );
    let line = r.failed(7).to_string();
    assert!(
        t.elapsed() < Duration::from_millis(2900),
        "{:?}",
        t.elapsed()
    );
    assert!(
        line.contains("sent; still running in the process") && line.contains("tmsctl status"),
        "{line}"
    );
    let s = status(&sb, p.pid);
    let ops = s["operations"].as_array().expect("operations in progress");
    assert_eq!(ops.len(), 1, "{s}");
    assert_eq!(ops[0]["op"], "pause");
    assert_eq!(ops[0]["tag"], "demo");
    let text = ok(&sb, &["status", "--pid", &pid]).stdout;
    assert!(
        text.contains("in progress: pause of tag \"demo\""),
        "{text}"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let s = loop {
        let s = status(&sb, p.pid);
        if s.get("operations").is_none() {
            break s;
        }
        assert!(Instant::now() < deadline, "still running: {s}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(tag(&s, "demo")["bytes_paused"], SIZE, "{s}");
    ok(&sb, &["resume", "--pid", &pid, "--tag", "demo"]);
    p.verify();
}

/// A reply about another operation than the one asked for is not printed as its outcome.
#[test]
fn a_reply_about_another_operation_is_refused() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let wrong: Answer = Arc::new(|req: &Value| {
        let op = if req["op"] == "pause" {
            "resume"
        } else {
            "pause"
        };
        format!(
            "{{\"reply\":\"done\",\"op\":\"{op}\",\"tag\":\"kv\",\"allocations\":1,\"bytes\":1,\"copied_bytes\":0,\"seconds\":0.1}}"
        )
    });
    let _fake = Fake::start(dir, &our_name(me), me, wrong);
    let line = ctl(&sb, &["pause", "--tag", "kv"]).failed(1).to_string();
    assert!(line.contains("another operation"), "{line}");
    let other_tag: Answer = Arc::new(|_: &Value| {
        "{\"reply\":\"done\",\"op\":\"pause\",\"tag\":\"other\",\"allocations\":1,\"bytes\":1,\"copied_bytes\":0,\"seconds\":0.1}".to_string()
    });
    std::fs::remove_file(dir.join(our_name(me))).expect("rm");
    let _fake = Fake::start(dir, &our_name(me), me, other_tag);
    let line = ctl(&sb, &["pause", "--tag", "kv"]).failed(1).to_string();
    assert!(line.contains("another operation"), "{line}");
    // A sign is not part of an index.
    let line = ctl(&sb, &["pause", "--tag", "kv", "--chunks", "+1"])
        .failed(2)
        .to_string();
    assert!(line.contains("not an index"), "{line}");
    // Issue 36, item 5: nor is a space.
    let line = ctl(&sb, &["pause", "--tag", "kv", "--chunks", " 1"])
        .failed(2)
        .to_string();
    assert!(line.contains("whitespace is not allowed"), "{line}");
    // Issue 36, item 5: a negative duration is no result to print (it used to be, exit 0).
    let negative: Answer = Arc::new(|_: &Value| {
        "{\"reply\":\"done\",\"op\":\"pause\",\"tag\":\"kv\",\"allocations\":1,\"bytes\":1,\"copied_bytes\":0,\"seconds\":-2.5}".to_string()
    });
    std::fs::remove_file(dir.join(our_name(me))).expect("rm");
    let _fake = Fake::start(dir, &our_name(me), me, negative);
    let line = ctl(&sb, &["pause", "--tag", "kv"]).failed(1).to_string();
    assert!(line.contains("not a duration"), "{line}");
}

/// A process started with a disk backup for its default region: `region` shows it, and asking
/// for a CPU backup as well is refused (the region unchanged) instead of reported as done.
#[test]
fn region_shows_a_disk_backup_and_refuses_a_second_backup() {
    let sb = sandbox();
    let disk = tempfile::tempdir().expect("tempdir");
    let p = Proc::start(
        &sb,
        &[
            ("TMS_INIT_ENABLE_DISK_BACKUP", "1"),
            ("TMS_DISK_BACKUP_DIR", disk.path().to_str().expect("utf-8")),
        ],
    );
    let pid = p.pid.to_string();
    let shown = ok(&sb, &["region", "--pid", &pid]).stdout;
    assert!(shown.contains("disk backup"), "{shown}");
    let line = ctl(&sb, &["region", "--pid", &pid, "--cpu-backup"])
        .failed(1)
        .to_string();
    assert!(line.contains("mutually exclusive"), "{line}");
    let r = ok(&sb, &["region", "--pid", &pid, "--json"]).json();
    assert_eq!(
        (r["disk_backup"].as_bool(), r["cpu_backup"].as_bool()),
        (Some(true), Some(false)),
        "{r}"
    );
    let r = ok(
        &sb,
        &[
            "region",
            "--pid",
            &pid,
            "--cpu-backup",
            "--no-disk-backup",
            "--json",
        ],
    )
    .json();
    assert_eq!(
        (r["disk_backup"].as_bool(), r["cpu_backup"].as_bool()),
        (Some(false), Some(true)),
        "{r}"
    );
}

/// A server that reads the request and closes without a reply is reported at once as such
/// (exit 1), not as a timeout after the whole `--timeout`, and not as "still running".
#[test]
fn a_server_that_closes_without_replying_is_not_a_timeout() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let listener = UnixListener::bind(dir.join(our_name(me))).expect("bind");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { break };
            let Some(mut lines) = greet(&mut conn, me) else {
                continue;
            };
            // Read the request whole, then hang up.
            let _request = lines.next();
        }
    });
    for args in [
        &["pause", "--tag", "kv", "--timeout", "60"][..],
        &["status", "--timeout", "60"][..],
    ] {
        let t0 = Instant::now();
        let r = ctl(&sb, args);
        let line = r.failed(1).to_string();
        assert!(
            line.contains("closed the connection without replying"),
            "{args:?}: {line}"
        );
        assert!(!line.contains("still running"), "{args:?}: {line}");
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{args:?}: took {:?}, as if it waited for the timeout",
            t0.elapsed()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// --json: every document carries the schema version; failures are a document too.

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

    // --all with a process that cannot be asked (a stale socket of a live process): the array,
    // that process's failure in it.
    let victim = Victim::start();
    drop(UnixListener::bind(dir.join(our_name(victim.pid()))).expect("bind"));
    let r = ctl(&sb, &["status", "--all", "--json"]);
    assert_eq!(r.code, 3, "{}", r.dump());
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
    assert_eq!(bad["error"]["exit_code"], 3, "{bad}");
    assert_eq!(bad["error"]["name"], "no_process", "{bad}");
    assert!(
        bad["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("stale")),
        "{bad}"
    );
}

/// A disk-backed process on a slow device (a 4 MiB/s link: 2 s for its 8 MiB each way): `pause
/// --progress` prints progress lines on stderr while it runs (not a terminal: a line about
/// every second) in the words of what happens, `status` shows the running operation with its
/// bytes, and `--timeout 1.5` does not cut an operation that makes progress.
#[test]
fn pause_and_resume_show_progress_and_outlast_the_timeout_while_moving() {
    // Less than the 2 s each way takes; the first progress poll comes at 0.5 s and then every
    // 0.5 s, so bytes must move within 1 s of the request, however loaded the machine.
    const TIMEOUT: &str = "1.5";
    let sb = sandbox();
    let dir = sb.tmp.path().join("disk");
    std::fs::create_dir(&dir).unwrap();
    let d = dir.to_str().unwrap().to_string();
    let mut p = Proc::start_with(
        &sb,
        &[
            ("TMS_DISK_BACKUP_DIR", &d),
            ("TMS_SIM_BANDWIDTH", "4MiB"),
            // Copies in pieces of 1/16 s: progress many times within the timeout.
            ("TMS_STAGING_SLOT", "256KiB"),
        ],
        |c| {
            c.arg("--disk");
        },
    );
    let pid = p.pid.to_string();
    let t = Instant::now();
    let r = ctl(
        &sb,
        &[
            "pause",
            "--pid",
            &pid,
            "--tag",
            "demo",
            "--progress",
            "--timeout",
            TIMEOUT,
        ],
    );
    assert_eq!(r.code, 0, "{}", r.dump());
    assert!(
        t.elapsed() > Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    assert!(
        r.stdout.contains("8.00 MiB written to disk, in "),
        "{}",
        r.dump()
    );
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert!(!lines.is_empty(), "progress lines\n{}", r.dump());
    for l in &lines {
        assert!(l.starts_with("pause of tag \"demo\": "), "{}", r.dump());
    }
    assert!(
        lines
            .iter()
            .any(|l| l.contains("8.0 MiB written to disk") && l.contains("/s, about ")),
        "{}",
        r.dump()
    );
    assert!(
        !r.stderr.contains('\r') && !r.stderr.contains('\u{1b}'),
        "{}",
        r.dump()
    );

    // While a resume runs (shown by nobody), status has it with its progress.
    let resume = [
        "resume",
        "--pid",
        &pid,
        "--tag",
        "demo",
        "--timeout",
        TIMEOUT,
    ];
    let bg = {
        let mut cmd = clean(Command::new(tmsctl()), &sb);
        cmd.args(resume);
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.spawn().expect("tmsctl resume")
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let op = loop {
        let s = status(&sb, p.pid);
        let op = s["operations"].as_array().and_then(|o| {
            o.iter()
                .find(|o| o["bytes_done"].as_u64().is_some_and(|b| b > 0 && b < SIZE))
                .cloned()
        });
        if let Some(op) = op {
            break op;
        }
        assert!(Instant::now() < deadline, "no progress seen: {s}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(op["op"], "resume", "{op}");
    assert_eq!(op["tag"], "demo", "{op}");
    assert_eq!(op["phase"], "reading_from_disk", "{op}");
    assert_eq!(op["backing"], "disk", "{op}");
    assert_eq!(op["bytes_total"].as_u64(), Some(SIZE), "{op}");
    let text = ok(&sb, &["status", "--pid", &pid]).stdout;
    assert!(
        text.contains("in progress: resume of tag \"demo\", asked ")
            && (text.contains("8.0 MiB read from disk") || !text.contains("in progress")),
        "{text}"
    );
    let out = bg.wait_with_output().expect("tmsctl resume");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("8.00 MiB read from disk"), "{stdout}");
    assert_eq!(stderr, "", "no progress shown: stderr is not a terminal");
    p.verify();

    // --no-progress: nothing on stderr, and the wait still outlasts --timeout.
    let r = ctl(
        &sb,
        &[
            "pause",
            "--pid",
            &pid,
            "--tag",
            "demo",
            "--no-progress",
            "--timeout",
            TIMEOUT,
        ],
    );
    assert_eq!((r.code, r.stderr.as_str()), (0, ""), "{}", r.dump());
    ok(&sb, &resume);
    p.verify();
}

/// A server that predates progress reports: tmsctl asks nothing more of it (no status polled
/// on a second connection, no progress shown) and --timeout bounds the whole wait, as before.
#[test]
fn a_server_without_progress_reports_is_waited_for_as_before() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let plain = honest(me);
    let slow: Answer = Arc::new(move |req: &Value| {
        if req["op"] == "pause" {
            std::thread::sleep(Duration::from_millis(2500));
        }
        plain(req)
    });
    let fake = Fake::start(dir, &our_name(me), me, slow);
    let t = Instant::now();
    let line = ctl(
        &sb,
        &["pause", "--tag", "kv", "--progress", "--timeout", "1"],
    )
    .failed(7)
    .to_string();
    assert!(
        t.elapsed() < Duration::from_millis(2400),
        "{:?}",
        t.elapsed()
    );
    assert!(line.contains("no reply came within 1.0 s"), "{line}");
    // The pause is logged once answered.
    let deadline = Instant::now() + Duration::from_secs(10);
    while fake.ops().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(fake.ops(), ["pause"], "no status polled");
}

/// `tmsctl demo` prints each row of its table as soon as its step is done (a slow device: 4 s
/// per pause or resume of its 16 MiB), with the columns lined up.
#[test]
fn the_demo_prints_each_row_as_it_happens() {
    let sb = sandbox();
    let mut cmd = clean(Command::new(tmsctl()), &sb);
    cmd.args(["demo", "--backend", "sim", "--size", "16MiB"])
        .env("TMS_SIM_BANDWIDTH", "4MiB")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let t0 = Instant::now();
    let mut child = cmd.spawn().expect("tmsctl demo");
    let out = child.stdout.take().expect("stdout");
    let mut lines: Vec<(Duration, String)> = Vec::new();
    for l in BufReader::new(out).lines() {
        lines.push((t0.elapsed(), l.expect("a line")));
    }
    let st = child.wait().expect("wait");
    let end = t0.elapsed();
    let all: Vec<&str> = lines.iter().map(|l| l.1.as_str()).collect();
    assert!(st.success(), "{all:#?}");
    let at = |step: &str| {
        lines
            .iter()
            .find(|l| l.1.starts_with(step))
            .unwrap_or_else(|| panic!("no row {step}: {all:#?}"))
    };
    let (head, allocated, paused, resumed) =
        (at("step "), at("allocated "), at("paused "), at("resumed "));
    // Each row came when its step was done, seconds before the next and before the end.
    assert!(
        paused.0 > allocated.0 + Duration::from_secs(2),
        "{lines:#?}"
    );
    assert!(resumed.0 > paused.0 + Duration::from_secs(2), "{lines:#?}");
    assert!(
        end > resumed.0 + Duration::from_secs(2),
        "the check comes after: {lines:#?}"
    );
    assert!(
        lines[0].0 + Duration::from_secs(2) < allocated.0,
        "{lines:#?}"
    );
    // Lined up: every column ends where the header's does.
    for row in [allocated, paused, resumed] {
        let cut = head.1.find("  time").expect("time column") + 2;
        assert_eq!(&row.1[cut - 2..cut], "  ", "{all:#?}");
        assert!(!row.1[..cut].ends_with("   "), "{all:#?}");
    }
    assert!(
        all.contains(&"contents on pause          : 16.00 MiB copied to host memory"),
        "{all:#?}"
    );
    assert_eq!(all.last(), Some(&"demo OK"));
}

/// Three processes, the last (highest pid, asked last) made to fail; `--atomic` must bring the
/// first two back to where they were.
fn three_with_a_faulty_last(sb: &Sandbox, faults: &str) -> Vec<Proc> {
    let a = Proc::start(sb, &[]);
    let b = Proc::start(sb, &[]);
    let c = Proc::start(sb, &[("TMS_SIM_FAULTS", faults)]);
    assert!(
        a.pid < b.pid && b.pid < c.pid,
        "pids not increasing: {} {} {}",
        a.pid,
        b.pid,
        c.pid
    );
    vec![a, b, c]
}

fn demo_bytes_active(sb: &Sandbox, p: &Proc) -> u64 {
    tag(&status(sb, p.pid), "demo")["bytes_active"]
        .as_u64()
        .expect("bytes_active")
}

/// `pause --all --atomic`: the third process's pause fails at its first copy (before anything
/// changed there); the two that
/// paused are resumed again from their backups, every process ends active with its pattern, and
/// the output says so. Without --atomic the same failure leaves the first two paused.
#[test]
fn atomic_pause_is_undone_everywhere_when_one_process_fails() {
    let sb = sandbox();
    let mut ps = three_with_a_faulty_last(&sb, "copy_d2h:1,copy_d2h:2");
    let r = ctl(
        &sb,
        &["pause", "--all", "--atomic", "--tag", "demo", "--json"],
    );
    assert_eq!(r.code, 1, "{}", r.dump());
    let j: Value = serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}\n{}", r.dump()));
    assert_eq!(j["ok"], false, "{j}");
    assert_eq!(j["every_process_as_before"], true, "{j}");
    assert_eq!(j["failed"]["pid"], ps[2].pid, "{j}");
    let items = j["processes"].as_array().expect("processes");
    for p in &ps[..2] {
        let item = items
            .iter()
            .find(|i| i["pid"] == p.pid)
            .unwrap_or_else(|| panic!("pid {} in {j}", p.pid));
        assert_eq!(item["done"]["op"], "pause", "{item}");
        assert_eq!(item["undo"]["op"], "resume", "{item}");
        assert_eq!(item["undo"]["bytes"], SIZE, "{item}");
    }
    let summary = r.stderr.lines().last().unwrap_or_default().to_string();
    assert!(
        summary.contains("failed on process")
            && summary.contains("undone on 2 processes: every process is as before"),
        "{}",
        r.dump()
    );
    for p in ps.iter_mut() {
        assert_eq!(demo_bytes_active(&sb, p), SIZE, "pid {}", p.pid);
        p.verify();
    }
    // Without --atomic the first two stay paused.
    let r = ctl(&sb, &["pause", "--all", "--tag", "demo"]);
    assert_eq!(r.code, 1, "{}", r.dump());
    assert_eq!(demo_bytes_active(&sb, &ps[0]), 0);
}

/// `resume --all --atomic`: the third process cannot resume (out of memory at its create); the
/// two that resumed are paused again, so every process ends paused with its backup; the next
/// atomic resume succeeds everywhere with the patterns intact.
#[test]
fn atomic_resume_is_undone_everywhere_when_one_process_runs_out_of_memory() {
    let sb = sandbox();
    let mut ps = three_with_a_faulty_last(&sb, "create:2:oom");
    ok(&sb, &["pause", "--all", "--tag", "demo"]);
    let r = ctl(&sb, &["resume", "--all", "--atomic", "--tag", "demo"]);
    assert_eq!(r.code, 1, "{}", r.dump());
    assert!(
        r.stderr.contains("out of memory") || r.stderr.contains("OUT_OF_MEMORY"),
        "{}",
        r.dump()
    );
    assert!(
        r.stderr
            .contains("undone on 2 processes: every process is as before"),
        "{}",
        r.dump()
    );
    assert_eq!(
        r.stdout.matches(": undone: paused tag").count(),
        2,
        "{}",
        r.dump()
    );
    assert!(
        r.stdout.contains("nothing to undo (nothing had changed)"),
        "{}",
        r.dump()
    );
    for p in &ps {
        assert_eq!(demo_bytes_active(&sb, p), 0, "pid {}", p.pid);
    }
    let r = ok(
        &sb,
        &["resume", "--all", "--atomic", "--tag", "demo", "--json"],
    );
    let j = r.json();
    assert_eq!(
        (j["ok"].as_bool(), j["processes"].as_array().map(Vec::len)),
        (Some(true), Some(3)),
        "{j}"
    );
    for p in ps.iter_mut() {
        assert_eq!(demo_bytes_active(&sb, p), SIZE, "pid {}", p.pid);
        p.verify();
    }
}

/// `pause --all --atomic --tag demo --timeout 1 --json`, which a slow process makes end with
/// exit 7 (still running): the run and its document.
fn atomic_pause_with_a_1s_timeout(sb: &Sandbox) -> (Ran, Value) {
    let args = "pause --all --atomic --tag demo --timeout 1 --json";
    let r = ctl(sb, &args.split(' ').collect::<Vec<_>>());
    assert_eq!(r.code, 7, "{}", r.dump());
    let j = serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}\n{}", r.dump()));
    (r, j)
}

/// Issue 36, item 2: the third process's pause is still running at --timeout (exit 7; its
/// device synchronizes slowly). The undo waits for it to end, then restores it as the others:
/// every process is as before, and the document says so only then.
#[test]
fn an_atomic_pause_still_running_at_the_timeout_is_waited_for_and_undone() {
    let sb = sandbox();
    let mut ps = vec![Proc::start(&sb, &[]), Proc::start(&sb, &[])];
    ps.push(Proc::start(&sb, &[("TMS_SIM_SYNC_DELAY_MS", "1800")]));
    assert!(
        ps[0].pid < ps[1].pid && ps[1].pid < ps[2].pid,
        "the slow one is asked last"
    );
    let (_, j) = atomic_pause_with_a_1s_timeout(&sb);
    assert_eq!(j["every_process_as_before"], true, "{j}");
    let last = ps.last().unwrap().pid;
    let item = j["processes"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["pid"] == last))
        .unwrap_or_else(|| panic!("no item of {last}: {j}"));
    assert_eq!(item["undo"]["op"], "resume", "undone once it ended: {item}");
    for p in ps.iter_mut() {
        assert_eq!(demo_bytes_active(&sb, p), SIZE, "pid {}", p.pid);
        p.verify();
    }
}

/// Issue 36, item 2: a pause that goes on without moving for --timeout after the others were
/// undone is reported as not undone, and the job as not as before; it then completes.
#[test]
fn an_atomic_pause_that_never_ends_in_time_is_reported_not_as_before() {
    let sb = sandbox();
    let mut a = Proc::start(&sb, &[]);
    let mut slow = Proc::start(&sb, &[("TMS_SIM_SYNC_DELAY_MS", "6000")]);
    assert!(a.pid < slow.pid);
    let (r, j) = atomic_pause_with_a_1s_timeout(&sb);
    assert_eq!(j["every_process_as_before"], false, "{j}");
    assert!(
        r.stderr.contains("NOT every process is as before") && r.stderr.contains("still running"),
        "{}",
        r.dump()
    );
    assert_eq!(demo_bytes_active(&sb, &a), SIZE, "the other is undone");
    a.verify();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = status(&sb, slow.pid);
        if s.get("operations").is_none() {
            assert_eq!(tag(&s, "demo")["bytes_paused"], SIZE, "as reported: {s}");
            break;
        }
        assert!(Instant::now() < deadline, "never ended: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
    ok(
        &sb,
        &["resume", "--pid", &slow.pid.to_string(), "--tag", "demo"],
    );
    slow.verify();
}

/// Issue 36, item 3: a tag with an allocation kept resident was active before the resume, but
/// a pause leaves that one mapped: the undo (a pause) is exact and runs.
#[test]
fn an_atomic_resume_is_undone_where_only_a_resident_allocation_was_active() {
    let sb = sandbox();
    let mut a = Proc::start(&sb, &[]);
    // Its creates: the demo's, the resident one's, then the resume's: out of memory.
    let mut b = Proc::start(&sb, &[("TMS_SIM_FAULTS", "create:3:oom")]);
    assert!(a.pid < b.pid);
    for p in [&mut a, &mut b] {
        let r = p.cmd("resident 2MiB", "RESIDENT");
        assert!(r.starts_with("0 "), "{r}");
    }
    ok(&sb, &["pause", "--all", "--tag", "demo"]);
    assert_eq!(tag(&status(&sb, a.pid), "demo")["resident_allocations"], 1);
    let r = ctl(&sb, &["resume", "--all", "--atomic", "--tag", "demo"]);
    assert_eq!(r.code, 1, "{}", r.dump());
    assert!(
        r.stdout.contains(": undone: paused tag") && !r.stdout.contains("not undone"),
        "{}",
        r.dump()
    );
    assert!(
        r.stderr.contains("every process is as before"),
        "{}",
        r.dump()
    );
    for p in [&a, &b] {
        assert_eq!(
            demo_bytes_active(&sb, p),
            2 << 20,
            "only the resident one: {}",
            p.pid
        );
    }
}

/// Issue 36, item 4: `pause --atomic` records chunk states for its undo in the job's record:
/// the program's (here saved with `--save-chunk-state`) is still there for its restore.
#[test]
fn an_atomic_pause_keeps_the_programs_chunk_state_record() {
    let sb = sandbox();
    let _p = Proc::start_with(&sb, &[], |c| {
        c.args(["--chunk", "2MiB"]);
    });
    let states = |sb: &Sandbox| {
        ok(sb, &["chunks", "--tag", "demo", "--json"]).json()["states"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    ok(&sb, &["pause", "--tag", "demo", "--chunks", "1"]);
    ok(&sb, &["pause", "--tag", "demo", "--save-chunk-state"]);
    ok(&sb, &["resume", "--tag", "demo"]);
    assert_eq!(states(&sb), "1111");
    ok(&sb, &["pause", "--all", "--atomic", "--tag", "demo"]);
    ok(&sb, &["resume", "--tag", "demo"]);
    ok(&sb, &["pause", "--tag", "demo"]);
    ok(&sb, &["resume", "--tag", "demo", "--restore-chunk-state"]);
    assert_eq!(states(&sb), "1011", "the program's record, not the job's");
}

// ---------------------------------------------------------------------------------------------
// Finding the process the user means

/// A private folder (0700) `name` in `sb`'s temporary folder, made now.
fn private(sb: &Sandbox, name: &str) -> PathBuf {
    let d = sb.tmp.path().join(name);
    std::fs::create_dir_all(&d).expect("mkdir");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    d
}

/// tmsctl with its folder from the defaults: no TMS_SOCKET_DIR, XDG_RUNTIME_DIR `xdg`.
fn ctl_xdg(sb: &Sandbox, xdg: &Path, args: &[&str]) -> Ran {
    ctl_with(&tmsctl(), sb, args, |c| {
        c.env_remove("TMS_SOCKET_DIR").env("XDG_RUNTIME_DIR", xdg);
    })
}

#[test]
fn a_process_with_another_xdg_runtime_dir_is_found() {
    let sb = sandbox();
    // The process's XDG_RUNTIME_DIR is not tmsctl's: it listens in run-a/tms.
    let run_a = private(&sb, "run-a");
    let run_b = private(&sb, "run-b");
    let p = Proc::start_with(&sb, &[("XDG_RUNTIME_DIR", run_a.to_str().unwrap())], |c| {
        c.env_remove("TMS_SOCKET_DIR");
    });
    let its_dir = run_a.join("tms");
    assert_eq!(p.socket().parent(), Some(its_dir.as_path()), "{}", p.ready);
    let pid = p.pid.to_string();

    // By --pid.
    let r = ctl_xdg(&sb, &run_b, &["status", "--pid", &pid, "--json"]);
    assert_eq!(r.json()["pid"].as_u64(), Some(p.pid as u64), "{}", r.dump());
    let r = ctl_xdg(&sb, &run_b, &["pause", "--pid", &pid, "--tag", "demo"]);
    assert_eq!(r.code, 0, "{}", r.dump());
    assert!(
        r.stdout.starts_with(&format!("pid {pid}: paused")),
        "{}",
        r.dump()
    );

    // By list: its row, and where it listens.
    let l = ctl_xdg(&sb, &run_b, &["list", "--json"]).json();
    let row = l
        .as_array()
        .and_then(|rows| {
            rows.iter()
                .find(|r| r["pid"].as_u64() == Some(p.pid as u64))
        })
        .unwrap_or_else(|| panic!("no row of {pid} in {l}"));
    assert_eq!(row["socket"].as_str(), p.socket().to_str(), "{row}");
    assert_eq!(row["bytes_paused"].as_u64(), Some(SIZE), "{row}");
    let l = ctl_xdg(&sb, &run_b, &["list"]);
    assert!(
        l.stdout
            .contains(&format!("pid {pid} listens in {}", its_dir.display())),
        "{}",
        l.dump()
    );

    // By status without --pid: its status, or (other processes of this user listening at the
    // same time) the list of those it could be, naming it.
    let r = ctl_xdg(&sb, &run_b, &["status"]);
    if r.code == 0 {
        assert!(
            r.stdout.starts_with(&format!("pid {pid} (")),
            "{}",
            r.dump()
        );
    } else {
        let line = r.failed(2);
        assert!(
            line.contains(&format!("pid {pid} (")) && line.contains(&its_dir.display().to_string()),
            "{line}"
        );
    }
}

#[test]
fn a_process_with_another_tms_socket_dir_is_found_by_pid_and_named() {
    let sb = sandbox();
    let elsewhere = sb.tmp.path().join("elsewhere");
    let p = Proc::start(&sb, &[("TMS_SOCKET_DIR", elsewhere.to_str().unwrap())]);
    assert_eq!(
        p.socket().parent(),
        Some(elsewhere.as_path()),
        "{}",
        p.ready
    );
    let pid = p.pid.to_string();
    // tmsctl's folder (sb.dir, named by its TMS_SOCKET_DIR) holds nothing.
    let r = ok(&sb, &["status", "--pid", &pid, "--json"]).json();
    assert_eq!(r["pid"].as_u64(), Some(p.pid as u64));
    // Without --pid only the named folder counts; the message names the process elsewhere.
    let line = ctl(&sb, &["status"]).failed(3).to_string();
    assert!(
        line.contains(&format!("pid {pid} (")) && line.contains(&elsewhere.display().to_string()),
        "{line}"
    );
    assert!(line.contains("--pid"), "{line}");
}

#[test]
fn another_users_process_is_refused_by_pid() {
    if !is_root() {
        eprintln!("skipped: needs root to start a process as another user (the check itself is unit-tested in ctl/src/find.rs)");
        return;
    }
    let sb = sandbox();
    let mut other = Command::new("sleep");
    other.arg("60").uid(65534).gid(65534);
    let victim = Victim(other.spawn().expect("sleep as 65534"));
    let line = ctl(&sb, &["status", "--pid", &victim.pid().to_string()])
        .failed(4)
        .to_string();
    assert!(
        line.contains(&format!(
            "process {} belongs to uid 65534, not to uid 0",
            victim.pid()
        )),
        "{line}"
    );
}

#[test]
fn pause_and_resume_without_pid_name_the_process() {
    let sb = sandbox();
    let p = Proc::start(&sb, &[]);
    let pid = p.pid.to_string();
    let r = ok(&sb, &["pause", "--tag", "demo"]);
    assert!(
        r.stdout.starts_with(&format!("pid {pid} (")) && r.stdout.contains("__demo-child"),
        "{}",
        r.dump()
    );
    assert!(r.stdout.contains("): paused tag \"demo\""), "{}", r.dump());
    let j = ok(&sb, &["resume", "--tag", "demo", "--json"]).json();
    assert!(
        j["command"].as_str().unwrap_or("").contains("__demo-child"),
        "{j}"
    );
    // --pid named it already.
    let r = ok(&sb, &["pause", "--pid", &pid, "--tag", "demo"]);
    assert!(
        r.stdout.starts_with(&format!("pid {pid}: paused")),
        "{}",
        r.dump()
    );
    ok(&sb, &["resume", "--pid", &pid, "--tag", "demo"]);

    // Several: each is named, and nothing is done.
    let q = Proc::start(&sb, &[]);
    let line = ctl(&sb, &["pause"]).failed(2).to_string();
    for pid in [p.pid, q.pid] {
        assert!(line.contains(&format!("pid {pid} (")), "{line}");
    }
    assert!(line.contains("__demo-child"), "{line}");
    assert_eq!(
        tag(&status(&sb, p.pid), "demo")["bytes_paused"].as_u64(),
        Some(0)
    );
}

#[test]
fn no_socket_messages_name_the_folders_and_what_decides_them() {
    let sb = sandbox();
    // Nothing in tmsctl's folder.
    let line = ctl(&sb, &["status"]).failed(3).to_string();
    assert!(
        line.contains(&sb.dir.display().to_string())
            && line.contains("TMS_SOCKET_DIR")
            && line.contains("XDG_RUNTIME_DIR"),
        "{line}"
    );
    // A process without the library.
    let me = std::process::id().to_string();
    let line = ctl(&sb, &["ping", "--pid", &me]).failed(3).to_string();
    assert!(
        line.contains("no control socket")
            && line.contains("libtms.so is not loaded")
            && line.contains("XDG_RUNTIME_DIR"),
        "{line}"
    );
    // The library, turned off: its folder (by its environment) and TMS_CONTROL are named.
    let its = sb.tmp.path().join("its");
    let off = Proc::start(
        &sb,
        &[
            ("TMS_CONTROL", "0"),
            ("TMS_SOCKET_DIR", its.to_str().unwrap()),
        ],
    );
    let line = ctl(&sb, &["status", "--pid", &off.pid.to_string()])
        .failed(3)
        .to_string();
    assert!(
        line.contains(&format!("TMS_SOCKET_DIR={}", its.display())) && line.contains("TMS_CONTROL"),
        "{line}"
    );
    // A folder the library refused (others may enter it): the refusal is named.
    let open = sb.tmp.path().join("open");
    std::fs::create_dir(&open).expect("mkdir");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let refused = Proc::start(&sb, &[("TMS_SOCKET_DIR", open.to_str().unwrap())]);
    assert!(refused.ready["socket"].is_null(), "{}", refused.ready);
    let line = ctl(&sb, &["status", "--pid", &refused.pid.to_string()])
        .failed(3)
        .to_string();
    assert!(
        line.contains(&open.display().to_string())
            && line.contains("refused")
            && line.contains("0755"),
        "{line}"
    );
    // tmsctl's own folder refused: where it came from is named.
    std::fs::create_dir_all(&sb.dir).expect("mkdir");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let line = ctl(&sb, &["status"]).failed(4).to_string();
    assert!(
        line.contains("from its TMS_SOCKET_DIR") && line.contains("0777"),
        "{line}"
    );
}

#[test]
fn version_names_the_implementation_and_commit() {
    let sb = sandbox();
    let r = ok(&sb, &["--version"]);
    let line = r.stdout.trim_end();
    let head = format!(
        "tmsctl {} (torch-memory-saver, Rust implementation; commit ",
        env!("CARGO_PKG_VERSION")
    );
    let commit = line
        .strip_prefix(&head)
        .and_then(|c| c.strip_suffix(')'))
        .unwrap_or_else(|| panic!("{line:?}"));
    assert!(!commit.is_empty(), "{line:?}");
    // Built from a git checkout: its commit (`git` and `.git` there to say so).
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if root.join(".git").exists() {
        if let Ok(o) = Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(["rev-parse", "--short", "HEAD"])
            .output()
        {
            if o.status.success() {
                assert_eq!(commit, String::from_utf8_lossy(&o.stdout).trim());
            }
        }
    }
}
