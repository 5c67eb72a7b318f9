//! `pause|resume --atomic` against fake servers that are slow: a pause still running at
//! `--timeout`, waiting behind another, interrupted by Ctrl-C, or whose process is replaced
//! under its pid while it is waited for.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::atomic::{assert_undo_refused_as_replaced, item_of, started_after_us};
use crate::common::*;

/// The [`Slow`] server's process was replaced under its pid during the run `r`, and the
/// replacement was asked nothing.
pub fn assert_replaced_and_never_asked(slow: &Slow, r: &Ran) {
    assert!(
        slow.replace.lock().unwrap().replaced(),
        "never replaced\n{}",
        r.dump()
    );
    assert_eq!(
        *slow.asked_since.lock().unwrap(),
        Vec::<String>::new(),
        "{}",
        r.dump()
    );
}

/// A server with `features` (a library without `operations` never lists a running pause in its
/// `status`). Tag "kv" (8 MiB) active; a pause stalls `stall_ms` (synchronizing, nothing
/// moving), then copies for `move_ms` (its bytes moving at every status), then is answered (the
/// tag is paused); a connection is served by a thread of its own, as the real server does.
/// Listens as this test process in `dir`.
pub fn slow_server(
    dir: &std::path::Path,
    features: &'static [&'static str],
    stall_ms: u64,
    move_ms: u64,
) -> Slow {
    slow_server_behind(dir, features, (0, 0), stall_ms, move_ms)
}

/// [`slow_server`] whose pause first waits (listed as `waiting`) behind a pause the program
/// started itself (of tag "other", in-process), which stalls `ahead.0` ms, then copies for
/// `ahead.1` ms.
fn slow_server_behind(
    dir: &std::path::Path,
    features: &'static [&'static str],
    ahead: (u64, u64),
    stall_ms: u64,
    move_ms: u64,
) -> Slow {
    use std::io::{BufRead, BufReader, Write};
    use std::sync::{Arc, Mutex};
    let me = std::process::id();
    let listener = std::os::unix::net::UnixListener::bind(dir.join(our_name(me))).expect("bind");
    let slow = Slow::default();
    let fake = slow.clone();
    let started: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { break };
            let Slow {
                paused: state,
                asked,
                hold,
                answered,
                replace,
                asked_since,
            } = fake.clone();
            let started = started.clone();
            std::thread::spawn(move || {
                let Ok(rd) = conn.try_clone() else { return };
                let mut lines = BufReader::new(rd).lines();
                if lines.next().is_none() {
                    return;
                }
                let hello = format!(
                    "{{\"reply\":\"hello\",\"protocol\":1,\"pid\":{me},\"software\":\"old 1\",\"backend\":\"sim\",\"features\":{}}}\n",
                    serde_json::json!(features)
                );
                if conn.write_all(hello.as_bytes()).is_err() {
                    return;
                }
                // Made to the process that replaced the first (its start time read since).
                let late = replace.lock().unwrap().replaced;
                let mut statuses = 0;
                for line in lines {
                    let Ok(line) = line else { return };
                    let req: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
                    let op = req["op"].as_str().unwrap_or_default().to_string();
                    if late {
                        asked_since.lock().unwrap().push(op);
                    } else if req["op"] == "status" {
                        statuses += 1;
                        replace.lock().unwrap().on_status(statuses);
                    }
                    let pause = req["op"] == "pause";
                    let reply = match req["op"].as_str() {
                        Some("status") => {
                            let p = *state.lock().unwrap();
                            let (a, b) = if p { (0u64, 8u64 << 20) } else { (8 << 20, 0) };
                            let mut ops = Vec::new();
                            if let Some(t) = *started.lock().unwrap() {
                                let ms = t.elapsed().as_millis() as u64;
                                let phase = |ms: u64, stall: u64| match ms.checked_sub(stall) {
                                    None => ("synchronizing", 0),
                                    Some(m) => ("copying_to_host", (m + 1) * 1000),
                                };
                                let seconds = ms as f64 / 1e3;
                                match ms.checked_sub(ahead.0 + ahead.1) {
                                    Some(ms) => {
                                        let (phase, done) = phase(ms, stall_ms);
                                        ops.push(serde_json::json!({
                                            "op": "pause", "tag": "kv", "seconds": seconds,
                                            "phase": phase, "bytes_total": 8u64 << 20,
                                            "bytes_done": done, "backing": "host",
                                        }));
                                    }
                                    None => {
                                        ops.push(serde_json::json!({
                                            "op": "pause", "tag": "kv", "seconds": seconds,
                                            "phase": "waiting",
                                        }));
                                        let (phase, done) = phase(ms, ahead.0);
                                        ops.push(serde_json::json!({
                                            "op": "pause", "tag": "other", "seconds": seconds,
                                            "in_process": true, "phase": phase,
                                            "bytes_total": 8u64 << 20, "bytes_done": done,
                                            "backing": "host",
                                        }));
                                    }
                                }
                            }
                            let mut st = serde_json::json!({
                                "reply": "status", "pid": me, "backend": "sim",
                                "retain_cpu_backup": false, "memory_margin_bytes": 0,
                                "devices": [],
                                "tags": [{"tag": "kv", "allocations": 1,
                                          "active_allocations": u64::from(!p),
                                          "paused_allocations": u64::from(p),
                                          "bytes_requested": 8 << 20, "bytes_active": a,
                                          "bytes_paused": b, "host_backup_bytes": b}],
                            });
                            if features.contains(&"operations") && !ops.is_empty() {
                                st["operations"] = ops.into();
                            }
                            st.to_string()
                        }
                        Some(op @ ("pause" | "resume")) => {
                            if op == "pause" {
                                *started.lock().unwrap() = Some(Instant::now());
                                asked.store(true, std::sync::atomic::Ordering::SeqCst);
                                let deadline = Instant::now() + Duration::from_secs(30);
                                while hold.load(std::sync::atomic::Ordering::SeqCst)
                                    && Instant::now() < deadline
                                {
                                    std::thread::sleep(Duration::from_millis(1));
                                }
                                let ms = ahead.0 + ahead.1 + stall_ms + move_ms;
                                std::thread::sleep(Duration::from_millis(ms));
                            }
                            // Paused before it is listed no more: a status never sees it ended
                            // with nothing changed.
                            *state.lock().unwrap() = op == "pause";
                            if op == "pause" {
                                *started.lock().unwrap() = None;
                            }
                            serde_json::json!({
                                "reply": "done", "op": op, "tag": "kv", "allocations": 1,
                                "bytes": 8u64 << 20, "copied_bytes": 8u64 << 20, "seconds": 0.01,
                            })
                            .to_string()
                        }
                        _ => "{\"reply\":\"error\",\"kind\":\"unsupported\",\"message\":\"no\"}"
                            .to_string(),
                    };
                    if conn.write_all(format!("{reply}\n").as_bytes()).is_err() {
                        return;
                    }
                    if pause {
                        answered.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                }
            });
        }
    });
    slow
}

/// `tmsctl pause --all --atomic --tag kv --timeout <timeout> --json`, the pause the tests of a
/// [`slow_server`] ask for.
fn atomic_pause_kv(timeout: &str) -> [&str; 8] {
    [
        "pause",
        "--all",
        "--atomic",
        "--tag",
        "kv",
        "--timeout",
        timeout,
        "--json",
    ]
}

/// `r`, an atomic pause of a [`slow_server`] (this process) that failed with exit 7, undid it:
/// the process is active again, and the output says every process is as before.
fn assert_undone(r: &Ran, paused: &std::sync::Mutex<bool>) {
    let j = r.json_exit(7);
    assert_eq!(j["every_process_as_before"], true, "{}", r.dump());
    assert_eq!(
        item_of(&j, std::process::id())["undo"]["op"],
        "resume",
        "{j}"
    );
    assert!(!*paused.lock().unwrap(), "undone: active again");
}

/// What [`slow_server`]'s test reads and steers: whether the tag is paused; whether a pause was
/// asked; `hold`, which while set keeps an asked pause from going on (its stall and copy not
/// begun, no reply), so that a test times its Ctrl-C by the pause rather than by the clock;
/// whether the pause's reply was sent; when the process is replaced under its pid (`replace`);
/// the operations asked over connections made since (`asked_since`).
#[derive(Clone, Default)]
pub struct Slow {
    paused: std::sync::Arc<std::sync::Mutex<bool>>,
    asked: std::sync::Arc<std::sync::atomic::AtomicBool>,
    hold: std::sync::Arc<std::sync::atomic::AtomicBool>,
    answered: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub replace: std::sync::Arc<std::sync::Mutex<Replace>>,
    pub asked_since: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

/// When a [`slow_server`] stands for another process given its pid: once one connection has
/// asked for `after` statuses (none where 0), `then` runs (it changes the start time tmsctl
/// reads) and the connections made since count as the other process's.
#[derive(Default)]
pub struct Replace {
    after: usize,
    then: Option<Box<dyn FnOnce() + Send>>,
    replaced: bool,
}

impl Replace {
    /// Replace the process once a connection has asked for `n` statuses, running `then`.
    pub fn after(n: usize, then: impl FnOnce() + Send + 'static) -> Replace {
        Replace {
            after: n,
            then: Some(Box::new(then)),
            replaced: false,
        }
    }

    /// Whether the process was replaced.
    pub fn replaced(&self) -> bool {
        self.replaced
    }

    /// A connection has asked for its `n`th status.
    fn on_status(&mut self, n: usize) {
        if self.after > 0 && n >= self.after && !self.replaced {
            if let Some(then) = self.then.take() {
                then();
            }
            self.replaced = true;
        }
    }
}

/// `tmsctl pause --atomic --tag kv` of `slow`, started with the fake's pause held: returned
/// once the fake was asked.
fn spawn_held_atomic_pause(sb: &Sandbox, slow: &Slow) -> std::process::Child {
    slow.hold.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut cmd = clean(std::process::Command::new(tmsctl()), sb);
    cmd.args(atomic_pause_kv("30"));
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = cmd.spawn().expect("tmsctl");
    wait_for(&slow.asked, "the pause never reached the fake");
    child
}

/// Wait until `flag` is set; `what` fails the test after 20 s.
fn wait_for(flag: &std::sync::atomic::AtomicBool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !flag.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Send `sig` to `child`, one this test started and has not waited for yet.
fn signal(child: &std::process::Child, sig: nix::sys::signal::Signal) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, sig).unwrap_or_else(|e| panic!("{sig}: {e}"));
}

/// Continues (SIGCONT) the process it holds when dropped: a tmsctl that a test stopped goes on
/// to its end even where the test fails on the way.
struct ContinueOnDrop(nix::unistd::Pid);

impl Drop for ContinueOnDrop {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGCONT);
    }
}

/// `tmsctl pause --atomic --tag kv` of `slow`, sent SIGINT (Ctrl-C) once the fake was asked:
/// the fake goes on with the pause only after that.
fn atomic_pause_interrupted_once_asked(sb: &Sandbox, slow: &Slow) -> Ran {
    let child = spawn_held_atomic_pause(sb, slow);
    signal(&child, nix::sys::signal::Signal::SIGINT);
    slow.hold.store(false, std::sync::atomic::Ordering::SeqCst);
    Ran::of(child.wait_with_output().expect("wait for tmsctl"))
}

/// `tmsctl pause --atomic --tag kv` of `slow`, its SIGINT (Ctrl-C) arriving with the fake's
/// quick reply, before tmsctl looks for either: once the fake is asked, tmsctl is stopped
/// (SIGSTOP), the fake answers, the SIGINT is sent, and tmsctl goes on (SIGCONT) to find both,
/// however loaded the machine. (The SIGINT used to be sent as soon as the fake was asked, the
/// reply coming 100 ms later: where this test's thread was held up longer than that, tmsctl
/// had already paused every process, exit 0.)
fn atomic_pause_interrupted_as_it_answers(sb: &Sandbox, slow: &Slow) -> Ran {
    let child = spawn_held_atomic_pause(sb, slow);
    signal(&child, nix::sys::signal::Signal::SIGSTOP);
    let go_on = ContinueOnDrop(nix::unistd::Pid::from_raw(child.id() as i32));
    wait_stopped(child.id());
    slow.hold.store(false, std::sync::atomic::Ordering::SeqCst);
    wait_for(&slow.answered, "the fake never answered the pause");
    signal(&child, nix::sys::signal::Signal::SIGINT);
    drop(go_on);
    Ran::of(child.wait_with_output().expect("wait for tmsctl"))
}

/// Wait until process `pid` is stopped (state `T` in `/proc/PID/stat`).
fn wait_stopped(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The state follows the command name, in parentheses (which the name may hold too).
        if stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('T'))
        {
            return;
        }
        assert!(Instant::now() < deadline, "pid {pid} never stopped: {stat}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A pause still running at --timeout on a server whose `status` cannot list running operations
/// (no `operations` feature): tmsctl cannot see when it ends, so it must not call the process
/// "as before" (the pause lands later and leaves it paused).
#[test]
fn an_atomic_pause_running_on_a_server_without_operations_is_not_called_as_before() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let Slow { paused, .. } = slow_server(dir, &["chunks"], 2500, 0);
    let r = ctl(&sb, &atomic_pause_kv("1"));
    let j = r.json_exit(7);
    // The pause lands after tmsctl has given its verdict.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !*paused.lock().unwrap() {
        assert!(Instant::now() < deadline, "the fake never paused");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(j["every_process_as_before"], false, "{}", r.dump());
    assert!(
        r.stderr.contains("NOT every process is as before"),
        "{}",
        r.dump()
    );
}

/// The pause is still synchronizing at --timeout (exit 7), then copies for 3 s, moving all
/// along. The undo waits while it moves (it gives up only once nothing moved for --timeout),
/// then restores it: the process is as before. (The wait used to share one deadline, set when
/// its connection was made, with every status it asked: it gave up --timeout after the failure
/// while the pause still moved, "the undo failed", and left the process paused.)
#[test]
fn an_atomic_pause_that_moves_past_the_timeout_is_waited_for_and_undone() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let Slow { paused, .. } = slow_server(dir, &["chunks", "operations", "progress"], 1500, 3000);
    assert_undone(&ctl(&sb, &atomic_pause_kv("1")), &paused);
}

/// The pause waits behind one the program started itself, which stalls past --timeout (exit 7)
/// and then copies for 3 s, moving all along while the pause asked for still waits. The undo
/// waits while either moves, as the wait for the reply does, then restores the process: as
/// before. (It watched only the pause asked for, which did not move while it waited: it gave up
/// after --timeout, "nothing moving", and left the process to be paused.)
#[test]
fn an_atomic_pause_waiting_behind_one_that_moves_is_waited_for_and_undone() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let features = &["chunks", "operations", "progress"];
    let Slow { paused, .. } = slow_server_behind(dir, features, (1500, 3000), 0, 100);
    assert_undone(&ctl(&sb, &atomic_pause_kv("1")), &paused);
}

/// Ctrl-C while an `--atomic` pause runs fails that pause rather than ending tmsctl at once
/// (which left the processes done so far paused, and said nothing): tmsctl waits for it to end,
/// undoes it and says so, exit 7.
#[test]
fn ctrl_c_during_an_atomic_pause_undoes_it_and_says_so() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let slow = slow_server(dir, &["chunks", "operations", "progress"], 1500, 500);
    let r = atomic_pause_interrupted_once_asked(&sb, &slow);
    assert!(r.stderr.contains("interrupted (Ctrl-C)"), "{}", r.dump());
    assert_undone(&r, &slow.paused);
}

/// Ctrl-C during an `--atomic` pause whose process answers quickly (within one of tmsctl's
/// waits between checks) still stops the job: the next process is not asked, what was done is
/// undone and said so, exit 7. (It was taken only while a reply was slow to come: after a quick
/// one, tmsctl went on to pause the next process and exited 0 as if no Ctrl-C had come.)
#[test]
fn ctrl_c_during_a_quick_atomic_pause_stops_before_the_next_process() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    // This process is asked first (the lower pid), the real one after it.
    let slow = slow_server(dir, &["chunks"], 0, 0);
    let p = started_after_us(|| Proc::start_tagged(&sb, "kv", &[], |_| {}));
    let r = atomic_pause_interrupted_as_it_answers(&sb, &slow);
    let j = r.json_exit(7);
    assert!(r.stderr.contains("interrupted (Ctrl-C)"), "{}", r.dump());
    assert_eq!(j["every_process_as_before"], true, "{}", r.dump());
    assert!(!*slow.paused.lock().unwrap(), "undone: active again");
    assert_eq!(
        tag(&status(&sb, p.pid), "kv")["bytes_active"].as_u64(),
        Some(SIZE),
        "the next process was not paused\n{}",
        r.dump()
    );
}

/// Ctrl-C during the last process's quick `--atomic` pause still fails the job: that pause is
/// undone and said so, exit 7. (With no process left to ask, tmsctl used to exit 0 as if no
/// Ctrl-C had come.)
#[test]
fn ctrl_c_during_the_last_quick_atomic_pause_undoes_it() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let slow = slow_server(dir, &["chunks"], 0, 0);
    let r = atomic_pause_interrupted_as_it_answers(&sb, &slow);
    assert!(
        r.stderr.contains("interrupted (Ctrl-C) as it answered"),
        "{}",
        r.dump()
    );
    assert_undone(&r, &slow.paused);
}

/// Ctrl-C while `--atomic` waits in `connect` for a process whose accept queue is full ends the
/// wait: the job fails there, nothing sent to it, exit 7. (The interrupted `connect` was tried
/// again with a whole new wait, and the Ctrl-C was not looked at: tmsctl sat out --timeout.)
#[test]
fn ctrl_c_while_connecting_for_an_atomic_pause_ends_the_wait() {
    let sb = sandbox();
    let _full = FullQueue::listen(private_dir(&sb));
    let mut cmd = clean(std::process::Command::new(tmsctl()), &sb);
    cmd.args(atomic_pause_kv("60"));
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = cmd.spawn().expect("tmsctl");
    // In connect (its first field is the system call it waits in).
    let syscall = format!("/proc/{}/syscall", child.id());
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_to_string(&syscall)
        .map_or(true, |s| !s.starts_with(&format!("{} ", libc::SYS_connect)))
    {
        assert!(Instant::now() < deadline, "tmsctl never waited in connect");
        std::thread::sleep(Duration::from_millis(5));
    }
    let t0 = Instant::now();
    // SAFETY: a signal to the child this test started and has not waited for yet.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let r = Ran::of(child.wait_with_output().expect("wait for tmsctl"));
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "tmsctl sat out its --timeout: {:?}",
        t0.elapsed()
    );
    let j = r.json_exit(7);
    assert!(
        r.stderr.contains("interrupted (Ctrl-C) while connecting"),
        "{}",
        r.dump()
    );
    assert_eq!(j["every_process_as_before"], true, "{}", r.dump());
}

/// An `--atomic` pause still running at --timeout (it stalls past it), then moving for 8 s:
/// the undo waits for it, its connection replaced every 5 s. The process ends once the wait
/// has begun, its pid given to another process of the library on the same socket name (its
/// start time changes as the wait's connection asks its 5th status). The wait stops at the
/// next connection: the new process is asked nothing (neither polled nor resumed), and the
/// process is reported not undone, not as before. (Were the wait to connect by the socket's
/// name alone, it would poll the new process until its pause ended and resume it there.)
#[cfg(debug_assertions)]
#[test]
fn the_wait_for_a_running_atomic_pause_stops_at_another_process_given_its_pid() {
    let sb = sandbox();
    let dir = private_dir(&sb);
    let me = std::process::id();
    let (proc_root, write) = fake_proc(&sb, me);
    let slow = slow_server(dir, &["chunks", "operations", "progress"], 1500, 8000);
    // The watch of the pause polls twice a second until --timeout: only the wait asks 5.
    *slow.replace.lock().unwrap() = Replace::after(5, move || write(2000));
    let r = ctl_with(&tmsctl(), &sb, &atomic_pause_kv("1"), |c| {
        c.env("TMSCTL_TEST_PROC", &proc_root);
    });
    let j = r.json_exit(7);
    assert_replaced_and_never_asked(&slow, &r);
    assert_undo_refused_as_replaced(&j, me, &r.dump());
}
