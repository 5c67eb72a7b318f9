//! What the tests share: tmsctl and libtms.so as built, a sandbox of one's own (its socket folder),
//! a preloaded process, a run of tmsctl and what it printed, and a fake server of the test's own.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const SIZE: u64 = 8 << 20;

pub fn tmsctl() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tmsctl"))
}

pub fn libtms() -> PathBuf {
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
pub struct Sandbox {
    pub tmp: tempfile::TempDir,
    pub dir: PathBuf,
}

pub fn sandbox() -> Sandbox {
    let tmp = tempfile::Builder::new()
        .prefix("tmsctl-test-")
        .tempdir()
        .expect("tempdir");
    let dir = tmp.path().join("s");
    Sandbox { tmp, dir }
}

/// A command with no TMS_* or XDG_RUNTIME_DIR from the test's environment.
pub fn clean(mut cmd: Command, sb: &Sandbox) -> Command {
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
pub struct Proc {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub lines: Receiver<String>,
    pub pid: u32,
    pub ready: Value,
}

impl Proc {
    pub fn start(sb: &Sandbox, env: &[(&str, &str)]) -> Proc {
        Proc::start_with(sb, env, |_| {})
    }

    pub fn start_with(
        sb: &Sandbox,
        env: &[(&str, &str)],
        tweak: impl FnOnce(&mut Command),
    ) -> Proc {
        Proc::start_tagged(sb, "demo", env, tweak)
    }

    /// [`Proc::start_with`], its memory in tag `tag` rather than "demo".
    pub fn start_tagged(
        sb: &Sandbox,
        tag: &str,
        env: &[(&str, &str)],
        tweak: impl FnOnce(&mut Command),
    ) -> Proc {
        let mut cmd = Command::new(tmsctl());
        cmd.args(["__demo-child", "--size", &SIZE.to_string(), "--tag", tag]);
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

    pub fn expect(&mut self, word: &str) -> String {
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

    pub fn cmd(&mut self, c: &str, expect: &str) -> String {
        let i = self.stdin.as_mut().expect("stdin");
        writeln!(i, "{c}").expect("write to the child");
        i.flush().expect("flush");
        self.expect(expect)
    }

    pub fn verify(&mut self) {
        assert_eq!(
            self.cmd("verify", "VERIFY"),
            "ok",
            "pattern of pid {}",
            self.pid
        );
    }

    pub fn assert_alive(&mut self) {
        assert!(
            matches!(self.child.try_wait(), Ok(None)),
            "pid {} died: {:?}",
            self.pid,
            self.child.try_wait()
        );
    }

    pub fn socket(&self) -> PathBuf {
        PathBuf::from(self.ready["socket"].as_str().expect("a control socket"))
    }

    /// Stop it with SIGTERM (how SLURM and Kubernetes stop jobs); check the signal ended it.
    pub fn terminate(mut self) {
        use std::os::unix::process::ExitStatusExt;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("SIGTERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        let st = loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                break st;
            }
            assert!(
                Instant::now() < deadline,
                "pid {} survived SIGTERM",
                self.pid
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(st.signal(), Some(libc::SIGTERM), "{st:?}");
    }

    /// Ask it to exit; wait.
    pub fn exit(mut self) -> std::process::ExitStatus {
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

pub struct Ran {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Ran {
    /// What a finished tmsctl left.
    pub fn of(o: Output) -> Ran {
        Ran {
            code: o.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }

    pub fn dump(&self) -> String {
        format!(
            "exit {}\n--- stdout\n{}--- stderr\n{}---",
            self.code, self.stdout, self.stderr
        )
    }

    pub fn json(&self) -> Value {
        self.json_exit(0)
    }

    /// Exited with `code`, stdout one JSON document: that document.
    pub fn json_exit(&self, code: i32) -> Value {
        assert_eq!(self.code, code, "{}", self.dump());
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}\n{}", self.dump()))
    }

    /// The last line on stderr (`--atomic`'s summary), or "".
    pub fn last_stderr_line(&self) -> String {
        self.stderr.lines().last().unwrap_or_default().to_string()
    }

    /// Failed with `code` and exactly one line on stderr, starting with "tmsctl: ".
    pub fn failed(&self, code: i32) -> &str {
        assert_eq!(self.code, code, "{}", self.dump());
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one line on stderr\n{}", self.dump());
        assert!(lines[0].starts_with("tmsctl: "), "{}", self.dump());
        lines[0]
    }
}

pub fn output_of(mut cmd: Command) -> Output {
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

pub fn ctl(sb: &Sandbox, args: &[&str]) -> Ran {
    ctl_with(&tmsctl(), sb, args, |_| {})
}

/// `exe` (a tmsctl) with `args`, in `sb`'s clean environment, after `tweak`.
pub fn ctl_with(exe: &Path, sb: &Sandbox, args: &[&str], tweak: impl FnOnce(&mut Command)) -> Ran {
    let mut cmd = Command::new(exe);
    cmd.args(args);
    let mut cmd = clean(cmd, sb);
    tweak(&mut cmd);
    Ran::of(output_of(cmd))
}

pub fn ok(sb: &Sandbox, args: &[&str]) -> Ran {
    let r = ctl(sb, args);
    assert_eq!(r.code, 0, "tmsctl {args:?}\n{}", r.dump());
    r
}

pub fn status(sb: &Sandbox, pid: u32) -> Value {
    ok(sb, &["status", "--pid", &pid.to_string(), "--json"]).json()
}

pub fn tag<'a>(s: &'a Value, name: &str) -> &'a Value {
    s["tags"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["tag"] == name))
        .unwrap_or_else(|| panic!("no tag {name} in {s}"))
}

pub fn free(s: &Value) -> u64 {
    s["devices"][0]["free_bytes"].as_u64().expect("device free")
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Our pid namespace's inode (the tests need /proc).
pub fn our_ns() -> u64 {
    tms_proto::pid_namespace().expect("/proc/self/ns/pid")
}

/// `<pid>.<our-ns>.sock`.
pub fn our_name(pid: u32) -> String {
    format!("{pid}.{}.sock", our_ns())
}

/// `sb.dir`, made as the server makes it (mode 0700).
pub fn private_dir(sb: &Sandbox) -> &Path {
    std::fs::create_dir_all(&sb.dir).expect("mkdir");
    std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    &sb.dir
}

/// A private folder (0700) `name` in `sb`'s temporary folder, made now.
pub fn private(sb: &Sandbox, name: &str) -> PathBuf {
    let d = sb.tmp.path().join(name);
    std::fs::create_dir_all(&d).expect("mkdir");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    d
}

/// A stand-in for `/proc` (read under `TMSCTL_TEST_PROC` by tmsctl of a debug build) in which
/// process `pid` started at what the returned function writes, at 1000 now: a pid cannot be
/// reused on demand, so a test replaces a process under its pid by changing its start time.
pub fn fake_proc(sb: &Sandbox, pid: u32) -> (PathBuf, impl Fn(u64) + Send + Clone + 'static) {
    let root = private(sb, "proc");
    let stat = root.join(pid.to_string());
    std::fs::create_dir_all(&stat).expect("mkdir");
    let stat = stat.join("stat");
    // Field 22 (the start time) after the command name and 18 fields.
    let write = move |start: u64| {
        let line = format!("{pid} (fake (x)) S {}{start} 0 0\n", "0 ".repeat(18));
        std::fs::write(&stat, line).expect("write the stat");
    };
    write(1000);
    (root, write)
}

pub type Answer = Arc<dyn Fn(&Value) -> String + Send + Sync>;

/// Read a client's hello on `conn` and answer it as process `pid`; the request lines that follow,
/// or `None` when the client went away first.
pub fn greet(conn: &mut UnixStream, pid: u32) -> Option<std::io::Lines<BufReader<UnixStream>>> {
    greet_with(conn, pid, &[])
}

/// [`greet`], announcing `features` in the hello.
fn greet_with(
    conn: &mut UnixStream,
    pid: u32,
    features: &[&str],
) -> Option<std::io::Lines<BufReader<UnixStream>>> {
    let mut lines = BufReader::new(conn.try_clone().ok()?).lines();
    lines.next()?.ok()?;
    let hello = format!(
        "{{\"reply\":\"hello\",\"protocol\":1,\"pid\":{pid},\"software\":\"fake 1\",\"backend\":\"sim\",\"features\":{}}}\n",
        serde_json::json!(features)
    );
    conn.write_all(hello.as_bytes()).ok()?;
    Some(lines)
}

/// A server of the test's own (in this process, so the kernel reports this process's pid and
/// uid for it), listening on `dir/file`: it answers the hello with `hello_pid` and every
/// request with `answer(request)`, and records the requests.
pub struct Fake {
    pub requests: Arc<Mutex<Vec<Value>>>,
    pub path: PathBuf,
}

impl Fake {
    pub fn start(dir: &Path, file: &str, hello_pid: u32, answer: Answer) -> Fake {
        Fake::start_busy(dir, file, hello_pid, answer, 0)
    }

    /// The same, but the first `busy` connections get a `busy` error and are closed at once,
    /// as a server with no room for them does.
    pub fn start_busy(dir: &Path, file: &str, hello_pid: u32, answer: Answer, busy: usize) -> Fake {
        Fake::serve(dir, file, hello_pid, answer, busy, &[])
    }

    /// [`Fake::start`] of a server announcing `features` in its hello.
    pub fn start_with_features(
        dir: &Path,
        file: &str,
        hello_pid: u32,
        answer: Answer,
        features: &'static [&'static str],
    ) -> Fake {
        Fake::serve(dir, file, hello_pid, answer, 0, features)
    }

    fn serve(
        dir: &Path,
        file: &str,
        hello_pid: u32,
        answer: Answer,
        busy: usize,
        features: &'static [&'static str],
    ) -> Fake {
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
                let Some(lines) = greet_with(&mut conn, hello_pid, features) else {
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
    pub fn ops(&self) -> Vec<String> {
        self.requests
            .lock()
            .expect("log")
            .iter()
            .map(|r| r["op"].as_str().unwrap_or("?").to_string())
            .collect()
    }
}

/// Answers like a server with one tag "kv" of 8 MiB (pid `pid`).
pub fn honest(pid: u32) -> Answer {
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

/// A live process that is not ours to speak for (a `sleep`), killed on drop.
pub struct Victim(pub Child);

impl Victim {
    pub fn start() -> Victim {
        Victim(Command::new("sleep").arg("60").spawn().expect("sleep"))
    }
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A socket of this test process in a folder whose accept queue is full: a connection to it
/// waits in `connect` (a process stopped, or too slow to take its connections).
pub struct FullQueue {
    _listener: std::os::fd::OwnedFd,
    _queued: Vec<std::os::fd::OwnedFd>,
}

impl FullQueue {
    pub fn listen(dir: &Path) -> FullQueue {
        use nix::sys::socket::{
            bind, connect, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr,
        };
        use std::os::fd::AsRawFd;
        let addr = UnixAddr::new(&dir.join(our_name(std::process::id()))).expect("address");
        let listener = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .expect("socket");
        bind(listener.as_raw_fd(), &addr).expect("bind");
        listen(&listener, Backlog::new(0).expect("backlog")).expect("listen");
        // Fill the queue: connections nobody accepts, until one would have to wait.
        let mut queued = Vec::new();
        loop {
            let c = socket(
                AddressFamily::Unix,
                SockType::Stream,
                SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
                None,
            )
            .expect("socket");
            match connect(c.as_raw_fd(), &addr) {
                Ok(()) => queued.push(c),
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => panic!("connect: {e}"),
            }
            assert!(queued.len() < 1000, "the queue never filled");
        }
        FullQueue {
            _listener: listener,
            _queued: queued,
        }
    }
}
