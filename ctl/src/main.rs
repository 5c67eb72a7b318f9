//! `tmsctl`: drive processes running Torch Memory Saver through their control sockets.

mod client;
mod demo;
mod output;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};
use tms_proto::{BackupBackend, RegionInfo, RegionUpdate, Reply, Request, Status};

use client::{Client, Code, Failure};

/// Shown after every command's help.
pub const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  the process replied with an error (or another failure: a bad reply, a failed demo check)
  2  bad command line (or several processes and neither --pid nor --all)
  3  no such process, or it has no control socket
  4  permission denied (the process belongs to another user)
  5  no answer within --timeout

Errors are one line on stderr, starting with \"tmsctl: \".";

const LONG_ABOUT: &str = "\
Drive processes that run Torch Memory Saver (libtms.so) from outside: list them, show their
pauseable memory, pause and resume it by tag, and change the default region of threads that
have not entered one of their own.

A process listens on a control socket once libtms.so is active in it (it made a pauseable
allocation, or called the library's API): `LD_PRELOAD=libtms.so TMS_INIT_ENABLE=1 python
serve.py`, then `tmsctl pause --tag kv`. Sockets live in $TMS_SOCKET_DIR, else
$XDG_RUNTIME_DIR/tms, else /tmp/tms-<uid>; only the same user can use them.

`tmsctl demo` shows the whole cycle on a child process of its own.";

/// Drive processes that run Torch Memory Saver (libtms.so).
#[derive(Parser, Debug)]
#[command(
    name = "tmsctl",
    version,
    about,
    long_about = LONG_ABOUT,
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Debug)]
struct Global {
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// Seconds to wait for each process's answer (a pause with CPU backup of much memory
    /// takes a while).
    #[arg(long, global = true, value_name = "SECONDS", default_value = "120", value_parser = parse_timeout)]
    timeout: Duration,
    /// Folder of the control sockets [default: $TMS_SOCKET_DIR, else $XDG_RUNTIME_DIR/tms,
    /// else /tmp/tms-<uid>].
    #[arg(long, global = true, value_name = "DIR")]
    socket_dir: Option<PathBuf>,
}

fn parse_timeout(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(v.is_finite() && v > 0.0 && v <= 1e6) {
        return Err(format!(
            "{s:?}: the timeout must be above 0 and at most 1e6 seconds"
        ));
    }
    Ok(Duration::from_secs_f64(v))
}

#[derive(Args, Debug, Clone)]
struct Select {
    /// The process to act on [default: the only process with a control socket].
    #[arg(long, value_name = "PID")]
    pid: Option<u32>,
    /// Every process with a control socket.
    #[arg(long, conflicts_with = "pid")]
    all: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum BackendArg {
    /// Page-locked host memory.
    Pinned,
    /// Pageable anonymous memory.
    Mmap,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// List the processes with a control socket: pid, backend, memory, command line.
    #[command(after_help = EXIT_CODES)]
    List,
    /// Show a process's tags, allocations, bytes active and paused, host backups, device
    /// memory and the last pause and resume.
    #[command(after_help = EXIT_CODES)]
    Status {
        #[command(flatten)]
        sel: Select,
    },
    /// Pause: give the device memory of a tag (or every tag) back, keeping CPU backups where
    /// the allocations asked for them. The device is synchronised first.
    #[command(after_help = EXIT_CODES)]
    Pause {
        #[command(flatten)]
        sel: Select,
        /// Only this tag [default: every tag].
        #[arg(long, value_name = "TAG")]
        tag: Option<String>,
    },
    /// Resume: map memory back at the same addresses and restore CPU backups. Out of memory
    /// leaves the tag paused with its backups; run it again once memory is free.
    #[command(after_help = EXIT_CODES)]
    Resume {
        #[command(flatten)]
        sel: Select,
        /// Only this tag [default: every tag].
        #[arg(long, value_name = "TAG")]
        tag: Option<String>,
    },
    /// Show or change the process-wide default region: what new allocations of threads that
    /// have not entered a region of their own become. Prints the region after any change.
    #[command(after_help = EXIT_CODES)]
    Region {
        #[command(flatten)]
        sel: Select,
        /// Make their allocations pauseable.
        #[arg(long, conflicts_with = "disable")]
        enable: bool,
        /// Make their allocations ordinary (not pauseable).
        #[arg(long)]
        disable: bool,
        /// Tag of their pauseable allocations.
        #[arg(long, value_name = "TAG")]
        tag: Option<String>,
        /// Keep a CPU backup of their contents across pause.
        #[arg(long, conflicts_with = "no_cpu_backup")]
        cpu_backup: bool,
        /// Keep no CPU backup (contents are undefined after resume).
        #[arg(long)]
        no_cpu_backup: bool,
        /// Host memory of the CPU backup.
        #[arg(long, value_enum, value_name = "BACKEND")]
        backend: Option<BackendArg>,
    },
    /// Check that a process answers.
    #[command(after_help = EXIT_CODES)]
    Ping {
        #[command(flatten)]
        sel: Select,
    },
    /// Start a child process with libtms.so preloaded, have it allocate pauseable memory with
    /// a pattern, pause and resume it through the control socket, and print a before/after
    /// table. CUDA where a GPU is usable, else the simulated device (it says which).
    #[command(after_help = EXIT_CODES)]
    Demo(demo::DemoArgs),
    /// The demo's child process (run by `tmsctl demo`, with libtms.so preloaded).
    #[command(name = "__demo-child", hide = true)]
    DemoChild(demo::ChildArgs),
}

/// What one process answered, for both output forms.
struct Outcome {
    json: Value,
    text: String,
}

/// An error already reported on stderr: only the exit code remains.
#[derive(Debug)]
struct Reported(Code);

impl std::fmt::Display for Reported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "failed (exit code {})", self.0 as u8)
    }
}

impl std::error::Error for Reported {}

/// Settings every command shares.
pub struct Ctx {
    /// The socket folder.
    pub dir: PathBuf,
    /// Per-process answer timeout.
    pub timeout: Duration,
    /// JSON output.
    pub json: bool,
}

impl Ctx {
    fn targets(&self, sel: &Select) -> client::Result<Vec<u32>> {
        if let Some(p) = sel.pid {
            return Ok(vec![p]);
        }
        let live = client::live_sockets(&self.dir);
        if live.is_empty() {
            return Err(Failure::new(
                Code::NoProcess,
                format!("no process has a control socket in {}", self.dir.display()),
            ));
        }
        if sel.all || live.len() == 1 {
            return Ok(live);
        }
        let shown: Vec<String> = live.iter().map(u32::to_string).collect();
        Err(Failure::new(
            Code::Usage,
            format!(
                "{} processes have a control socket ({}): pass --pid PID or --all",
                live.len(),
                shown.join(", ")
            ),
        ))
    }

    /// Run `f` against each selected process; print what each answered; report failures on
    /// stderr, one line each.
    fn fan_out(
        &self,
        sel: &Select,
        f: impl Fn(&mut Client) -> client::Result<Outcome>,
    ) -> anyhow::Result<()> {
        let pids = self.targets(sel)?;
        let many = sel.all;
        let mut items = Vec::new();
        let mut first: Option<Code> = None;
        for pid in pids {
            match Client::connect(&self.dir, pid, self.timeout).and_then(|mut c| f(&mut c)) {
                Ok(o) => {
                    if !self.json {
                        print!("{}", o.text);
                        if !o.text.ends_with('\n') {
                            println!();
                        }
                    } else if many {
                        items.push(o.json);
                    } else {
                        println!("{}", o.json);
                    }
                }
                Err(e) => {
                    eprintln!("tmsctl: {}", one_line(&e.message));
                    if many {
                        items.push(json!({"pid": pid, "error": {"exit_code": e.code as u8, "message": e.message}}));
                    }
                    first.get_or_insert(e.code);
                }
            }
        }
        if self.json && many {
            println!("{}", Value::Array(items));
        }
        match first {
            Some(c) => Err(Reported(c).into()),
            None => Ok(()),
        }
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn with_pid<T: serde::Serialize>(pid: u32, v: &T) -> Value {
    let mut j = serde_json::to_value(v).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut j {
        m.insert("pid".into(), json!(pid));
        j
    } else {
        json!({"pid": pid, "value": j})
    }
}

fn status_of(c: &mut Client) -> client::Result<Status> {
    c.ask_for(&Request::Status, |r| match r {
        Reply::Status(s) => Some(*s),
        _ => None,
    })
}

fn list(ctx: &Ctx) -> anyhow::Result<()> {
    let pids = client::live_sockets(&ctx.dir);
    let mut rows = Vec::new();
    for pid in &pids {
        let command = client::command_line(*pid);
        let t = ctx.timeout.min(Duration::from_secs(5));
        let r = Client::connect(&ctx.dir, *pid, t).and_then(|mut c| status_of(&mut c));
        rows.push((*pid, command, r));
    }
    if ctx.json {
        let items: Vec<Value> = rows
            .iter()
            .map(|(pid, command, r)| match r {
                Ok(s) => json!({
                    "pid": pid, "command": command, "backend": s.backend,
                    "socket": client::socket_path(&ctx.dir, *pid),
                    "tags": s.tags.len(), "bytes_active": s.bytes_active(),
                    "bytes_paused": s.bytes_paused(),
                }),
                Err(e) => json!({
                    "pid": pid, "command": command,
                    "socket": client::socket_path(&ctx.dir, *pid),
                    "error": e.message,
                }),
            })
            .collect();
        println!("{}", Value::Array(items));
        return Ok(());
    }
    if rows.is_empty() {
        println!("no process has a control socket in {}", ctx.dir.display());
        return Ok(());
    }
    println!(
        "{:<8} {:<8} {:>5} {:>12} {:>12}  COMMAND",
        "PID", "BACKEND", "TAGS", "ACTIVE", "PAUSED"
    );
    for (pid, command, r) in rows {
        let command: String = command.chars().take(100).collect();
        match r {
            Ok(s) => println!(
                "{:<8} {:<8} {:>5} {:>12} {:>12}  {command}",
                pid,
                s.backend,
                s.tags.len(),
                output::human(s.bytes_active()),
                output::human(s.bytes_paused())
            ),
            Err(e) => println!(
                "{:<8} {:<8} {:>5} {:>12} {:>12}  {command}  ({})",
                pid,
                "-",
                "-",
                "-",
                "-",
                one_line(&e.message)
            ),
        }
    }
    Ok(())
}

fn op(ctx: &Ctx, sel: &Select, req: Request) -> anyhow::Result<()> {
    ctx.fan_out(sel, |c| {
        let d = c.ask_for(&req, |r| match r {
            Reply::Done(d) => Some(d),
            _ => None,
        })?;
        Ok(Outcome {
            json: with_pid(c.pid(), &d),
            text: output::done(c.pid(), &d),
        })
    })
}

fn region(ctx: &Ctx, sel: &Select, update: Option<RegionUpdate>) -> anyhow::Result<()> {
    let req = match update {
        Some(u) => Request::SetRegion(u),
        None => Request::GetRegion,
    };
    ctx.fan_out(sel, |c| {
        let r: RegionInfo = c.ask_for(&req, |r| match r {
            Reply::Region(r) => Some(r),
            _ => None,
        })?;
        Ok(Outcome {
            json: with_pid(c.pid(), &r),
            text: format!("pid {}: default region: {}", c.pid(), output::region(&r)),
        })
    })
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let ctx = Ctx {
        dir: cli
            .global
            .socket_dir
            .clone()
            .unwrap_or_else(|| tms_proto::socket_dir_from_env(client::euid())),
        timeout: cli.global.timeout,
        json: cli.global.json,
    };
    match cli.cmd {
        Cmd::List => list(&ctx),
        Cmd::Status { sel } => ctx.fan_out(&sel, |c| {
            let s = status_of(c)?;
            Ok(Outcome {
                json: serde_json::to_value(&s).unwrap_or(Value::Null),
                text: output::status(&s, &client::command_line(c.pid())),
            })
        }),
        Cmd::Pause { sel, tag } => op(&ctx, &sel, Request::Pause { tag }),
        Cmd::Resume { sel, tag } => op(&ctx, &sel, Request::Resume { tag }),
        Cmd::Region {
            sel,
            enable,
            disable,
            tag,
            cpu_backup,
            no_cpu_backup,
            backend,
        } => {
            let u = RegionUpdate {
                enabled: (enable || disable).then_some(enable),
                tag,
                cpu_backup: (cpu_backup || no_cpu_backup).then_some(cpu_backup),
                backend: backend.map(|b| match b {
                    BackendArg::Pinned => BackupBackend::Pinned,
                    BackendArg::Mmap => BackupBackend::Mmap,
                }),
            };
            let changed = u != RegionUpdate::default();
            region(&ctx, &sel, changed.then_some(u))
        }
        Cmd::Ping { sel } => ctx.fan_out(&sel, |c| {
            let t = Instant::now();
            let pid = c.ask_for(&Request::Ping, |r| match r {
                Reply::Pong { pid } => Some(pid),
                _ => None,
            })?;
            let s = t.elapsed().as_secs_f64();
            Ok(Outcome {
                json: json!({"pid": pid, "seconds": s}),
                text: format!("pid {pid}: pong in {:.2} ms", s * 1e3),
            })
        }),
        Cmd::Demo(a) => demo::run(&ctx, &a),
        Cmd::DemoChild(a) => demo::child(&a),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if let Some(Reported(c)) = e.downcast_ref::<Reported>() {
                return ExitCode::from(*c as u8);
            }
            let code = e.downcast_ref::<Failure>().map_or(Code::Failed, |f| f.code);
            let msg: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            eprintln!("tmsctl: {}", one_line(&msg.join(": ")));
            ExitCode::from(code as u8)
        }
    }
}
