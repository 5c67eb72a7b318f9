//! The demo's child as the parent sees it: started with the library preloaded, its lines read
//! as they come, its commands sent, and it ended.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// A running demo child.
pub(super) struct DemoChild {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Arc<Mutex<String>>,
    /// Disconnected once the child's stderr has been read to its end.
    stderr_done: Receiver<()>,
}

impl DemoChild {
    pub(super) fn spawn(
        lib: &Path,
        backend: &str,
        size: u64,
        tag: &str,
        dir: &Path,
    ) -> anyhow::Result<DemoChild> {
        let exe = std::env::current_exe()?;
        let preload = match std::env::var("LD_PRELOAD") {
            Ok(p) if !p.trim().is_empty() => format!("{}:{p}", lib.display()),
            _ => lib.display().to_string(),
        };
        let mut cmd = Command::new(exe);
        cmd.arg("__demo-child")
            .arg("--size")
            .arg(size.to_string())
            .arg("--tag")
            .arg(tag)
            .arg("--parent")
            .arg(std::process::id().to_string())
            .env("LD_PRELOAD", preload)
            .env("TMS_BACKEND", backend)
            .env("TMS_SOCKET_DIR", dir)
            .env_remove("TMS_CONTROL")
            .env_remove("TMS_INIT_ENABLE")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if backend == "sim" && std::env::var_os("TMS_SIM_CAPACITY").is_none() {
            cmd.env(
                "TMS_SIM_CAPACITY",
                size.saturating_mul(2).max(8 << 30).to_string(),
            );
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting the demo child: {e}"))?;
        let stdout = child.stdout.take();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            if let Some(out) = stdout {
                for l in BufReader::new(out).lines() {
                    let Ok(l) = l else { break };
                    if tx.send(l).is_err() {
                        break;
                    }
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let (done_tx, stderr_done) = mpsc::channel::<()>();
        if let Some(mut err) = child.stderr.take() {
            let sink = stderr.clone();
            std::thread::spawn(move || {
                let _done = done_tx;
                let mut s = String::new();
                let _ = err.read_to_string(&mut s);
                if let Ok(mut g) = sink.lock() {
                    g.push_str(&s);
                }
            });
        }
        Ok(DemoChild {
            stdin: child.stdin.take(),
            child,
            lines: rx,
            stderr,
            stderr_done,
        })
    }

    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stderr_tail(&self) -> String {
        let s = self.stderr.lock().map(|g| g.clone()).unwrap_or_default();
        let t = s.trim();
        if t.is_empty() {
            String::new()
        } else {
            format!(" (child's stderr: {})", t.lines().last().unwrap_or(t))
        }
    }

    /// The child's last line on stderr as [`Self::stderr_tail`] gives it, once the child has
    /// ended (within a bound): for a child that said why it stops and is about to exit.
    pub(super) fn stderr_at_exit(&mut self) -> String {
        if self.wait_for(Duration::from_secs(2)) {
            let _ = self.stderr_done.recv_timeout(Duration::from_secs(1));
        }
        self.stderr_tail()
    }

    /// The next line starting with `word`; an `ERROR` line or the end of output is
    /// `Err((stage, message))`.
    pub(super) fn expect(
        &mut self,
        word: &str,
        timeout: Duration,
    ) -> Result<String, (String, String)> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    if let Some(rest) = l.strip_prefix("ERROR ") {
                        let (stage, msg) = rest.split_once(' ').unwrap_or((rest, ""));
                        return Err((stage.to_string(), msg.to_string()));
                    }
                    if let Some(rest) = l.strip_prefix(word) {
                        return Ok(rest.trim().to_string());
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err((
                        "timeout".into(),
                        format!(
                            "no {word} from the demo child within {:.0} s",
                            timeout.as_secs_f64()
                        ),
                    ))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let st = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                    return Err((
                        "exit".into(),
                        format!("the demo child ended ({st}){}", self.stderr_tail()),
                    ));
                }
            }
        }
    }

    pub(super) fn send(&mut self, cmd: &str) -> anyhow::Result<()> {
        let Some(i) = self.stdin.as_mut() else {
            anyhow::bail!("the demo child's input is closed");
        };
        writeln!(i, "{cmd}")?;
        i.flush()?;
        Ok(())
    }

    /// Ask the child to exit and wait a little; kill it otherwise.
    pub(super) fn finish(mut self) {
        let _ = self.send("exit");
        self.stdin = None;
        self.wait_for(Duration::from_secs(10));
    }

    /// Whether the child ended within `limit`.
    fn wait_for(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for DemoChild {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SIGTERM first: the library removes its control socket on it, and a SIGKILL
            // would leave the socket file behind in the socket folder.
            if let Ok(pid) = i32::try_from(self.child.id()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
            }
            if !self.wait_for(Duration::from_secs(5)) {
                let _ = self.child.kill();
            }
            let _ = self.child.wait();
        }
    }
}
