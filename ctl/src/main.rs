//! `tmsctl`: drive processes running Torch Memory Saver through their control sockets.

mod atomic;
mod clean;
mod client;
mod demo;
mod find;
mod output;
mod procfs;
mod progress;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};
use tms_proto::{
    BackupBackend, ChunkStatus, Op, RegionInfo, RegionUpdate, Reply, Request, Status,
    FEATURE_CHUNKS, FEATURE_NO_WAIT, FEATURE_PROGRESS, MAX_CHUNK_INDICES,
};
use tms_units::{chunk_ranges, format_chunk_ranges, format_ranges};

use client::{Client, Code, Failure, Socket};

/// Shown after every command's help.
pub const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  the process replied with an error (or another failure: a bad reply, a failed demo check)
  2  bad command line (or several processes and neither --pid nor --all)
  3  no such process, or it has no control socket
  4  permission denied: the process belongs to another user, or tmsctl does not trust the
     socket folder (not ours, open to others, unreadable) or the server (another uid or pid)
  5  no answer (or no room at the server) within --timeout; for pause and resume: the request
     was not sent whole (nothing was asked)
  6  pause/resume --tag T (with or without --chunks): no allocation of the process ever had
     tag T (nothing changed)
  7  pause/resume: sent, and not answered within --timeout (with a process that reports
     progress: nothing moved for --timeout): still running in the process (or waiting there
     for another pause or resume); it ends there on its own, and `tmsctl status` lists it
     (\"in progress\") until it has ended

With --all every process is tried in turn: the exit code is the first failure's (1 to 5, 7),
else 6 if a process did not know the tag, else 0.
Errors are one line on stderr each, starting with \"tmsctl: \". With --json the error is on
stdout too, as the command's one JSON document: {\"schema\": 1, \"error\": {\"exit_code\": 5,
\"name\": \"timeout\", \"message\": \"...\"}}, with \"pid\" when it is about one process (with --all
each process that failed is such an object in the array). Names: 1 failed, 2 usage,
3 no_process, 4 permission, 5 timeout, 7 running; for 6 the reply is printed as on success,
with \"unknown_tag\": true.";

const LONG_ABOUT: &str = "\
Drive processes that run Torch Memory Saver (libtms.so) from outside: list them, show their
pauseable memory, pause and resume it by tag or by chunks of a tag's chunked allocation
(`tmsctl pause --tag kv --chunks 8-15`; `tmsctl chunks --tag kv` shows which are active), and
change the default region of threads that have not entered one of their own.

A process listens on a control socket once libtms.so is active in it (it made a pauseable
allocation, or called the library's API): `LD_PRELOAD=libtms.so TMS_INIT_ENABLE=1 python
serve.py`, then `tmsctl pause --tag kv`. Sockets live in $TMS_SOCKET_DIR, else
$XDG_RUNTIME_DIR/tms, else /tmp/tms-<uid>, of each process's own environment; only the same
user can use them (tmsctl refuses a folder that is not its user's or that others can enter,
and a server that runs as another user or is not the process its socket names). tmsctl looks
in its own folder, worked out the same way, and through /proc in the folders its user's
processes listen in: --pid P finds P's socket wherever P listens (P must be tmsctl's user's),
and without --pid the processes listening elsewhere count too, unless --socket-dir or
TMS_SOCKET_DIR names tmsctl's folder (then only that one is looked in). --pid means a pid of
tmsctl's own pid namespace; `tmsctl list` shows the sockets of other namespaces too.

`tmsctl demo` shows the whole cycle on a child process of its own.";

/// Drive processes that run Torch Memory Saver (libtms.so).
#[derive(Parser, Debug)]
#[command(
    name = "tmsctl",
    version = tms_proto::BUILD_INFO,
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
    /// Print JSON instead of text: one document on stdout, an object with "schema": 1 (for
    /// `list` and --all an array of such objects, one per process), or on failure the error
    /// as such an object (see the exit codes below).
    #[arg(long, global = true)]
    json: bool,
    /// Seconds to wait for each process's answer. For pause and resume, with a process whose
    /// library reports progress, the seconds without progress instead: the wait goes on for as
    /// long as the operation (or the one it waits behind) copies bytes or changes phase, so a
    /// pause of hundreds of GiB to disk is never cut short, and ends once nothing has moved
    /// for this long (exit code 7: still running); with an older library, the whole wait.
    #[arg(long, global = true, value_name = "SECONDS", default_value = "120", value_parser = parse_timeout)]
    timeout: Duration,
    /// Folder of the control sockets [default: $TMS_SOCKET_DIR, else $XDG_RUNTIME_DIR/tms,
    /// else /tmp/tms-<uid>]. Named here or by TMS_SOCKET_DIR, it is the only folder looked in
    /// without --pid; else the folders /proc shows tmsctl's user's processes listening in count
    /// too.
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
    /// The process to act on, by its pid in tmsctl's pid namespace: a process of tmsctl's user,
    /// its socket found wherever it listens [default: the only process with a control socket;
    /// pause and resume name it by its command line, and with several tmsctl names each and
    /// stops].
    #[arg(long, value_name = "PID")]
    pid: Option<u32>,
    /// Every process with a control socket (of tmsctl's pid namespace), in turn.
    #[arg(long, conflicts_with = "pid")]
    all: bool,
}

/// Every process or none.
#[derive(Args, Debug, Clone, Copy)]
struct Atomic {
    /// Every process or none: act on the processes in turn, and if one fails, undo the
    /// operation on those that succeeded (a pause by resuming what it paused, from the backups it
    /// wrote; a resume by pausing again what it resumed), so that every process ends as before.
    /// The exit code is the failure's; the output says what was undone, and what could not be
    /// undone exactly (a resume of a tag that was partly active before). Meant for --all.
    #[arg(long)]
    atomic: bool,
}

/// Whether pause and resume show their progress.
#[derive(Args, Debug, Clone, Copy)]
struct ShowProgress {
    /// Show progress on stderr while it runs (bytes copied of the total, where to, rate, time
    /// left), also when stderr is not a terminal (a line about every second there; on a
    /// terminal, the default, one line rewritten in place). Needs a process whose library
    /// reports progress.
    #[arg(long, overrides_with = "no_progress")]
    progress: bool,
    /// Show no progress, even on a terminal.
    #[arg(long)]
    no_progress: bool,
}

/// Chunk indices from the command line (`8-15,20`): sorted, each once.
#[derive(Clone, Debug)]
struct ChunkList(Vec<usize>);

fn parse_chunk_list(s: &str) -> Result<ChunkList, String> {
    tms_units::parse_ranges(s, MAX_CHUNK_INDICES)
        .map(ChunkList)
        .map_err(|e| e.to_string())
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
    /// List the processes with a control socket: pid, backend, memory, command line (sockets of
    /// other pid namespaces are listed too, marked; so are the processes that /proc shows
    /// listening in other folders, and where, unless --socket-dir or TMS_SOCKET_DIR names one).
    #[command(after_help = EXIT_CODES)]
    List,
    /// Show a process's tags, allocations (all, paused, and partial: chunked allocations
    /// with some chunks paused), bytes active and paused (chunks counted), host and disk
    /// backups, device memory and the last pause and resume.
    #[command(after_help = EXIT_CODES)]
    Status {
        #[command(flatten)]
        sel: Select,
    },
    /// Pause: give the device memory of a tag (or every tag, or some chunks of a tag's chunked
    /// allocation) back, keeping CPU backups where the allocations asked for them. The device
    /// is synchronised first.
    #[command(after_help = EXIT_CODES)]
    Pause {
        #[command(flatten)]
        sel: Select,
        /// Only this tag [default: every tag]. A tag that no allocation of the process ever had
        /// changes nothing and exits with code 6.
        #[arg(long, value_name = "TAG")]
        tag: Option<String>,
        /// Only these chunks of the tag's chunked allocation (the tag must have exactly one;
        /// needs --tag): indices from 0 and inclusive ranges, such as 8-15,20. Chunks paused
        /// already are left alone. `tmsctl chunks --tag TAG` shows them.
        #[arg(long, value_name = "LIST", requires = "tag", value_parser = parse_chunk_list)]
        chunks: Option<ChunkList>,
        /// First record which allocations (and chunks of chunked ones) are active, so that
        /// `resume --restore-chunk-state` brings back only those.
        #[arg(long, conflicts_with = "chunks")]
        save_chunk_state: bool,
        #[command(flatten)]
        show: ShowProgress,
        #[command(flatten)]
        atomic: Atomic,
    },
    /// Resume: map memory back at the same addresses and restore CPU backups (of a tag, every
    /// tag, or some chunks of a tag's chunked allocation). Out of memory leaves what was to be
    /// resumed paused with its backups; run it again once memory is free.
    #[command(after_help = EXIT_CODES)]
    Resume {
        #[command(flatten)]
        sel: Select,
        /// Only this tag [default: every tag]. A tag that no allocation of the process ever had
        /// changes nothing and exits with code 6.
        #[arg(long, value_name = "TAG")]
        tag: Option<String>,
        /// Only these chunks of the tag's chunked allocation (the tag must have exactly one;
        /// needs --tag): indices from 0 and inclusive ranges, such as 8-15,20. Chunks active
        /// already are left alone.
        #[arg(long, value_name = "LIST", requires = "tag", value_parser = parse_chunk_list)]
        chunks: Option<ChunkList>,
        /// Of chunked allocations, resume only the chunks that `pause --save-chunk-state`
        /// recorded active (every chunk of an allocation without such a record).
        #[arg(long, conflicts_with = "chunks")]
        restore_chunk_state: bool,
        /// Answer once the memory is mapped: the contents are still being restored in the
        /// process when tmsctl exits (the output says how much). The process's next pause,
        /// resume or wait reports a failure of that restore; its allocations then stay paused
        /// with their backups. A whole tag only (not with --chunks, --restore-chunk-state or
        /// --atomic).
        #[arg(long, conflicts_with_all = ["chunks", "restore_chunk_state", "atomic"])]
        no_wait: bool,
        #[command(flatten)]
        show: ShowProgress,
        #[command(flatten)]
        atomic: Atomic,
    },
    /// Show the chunks of a tag's chunked allocation (the tag must have exactly one): chunk
    /// size and count, and which are active and which paused, as ranges that --chunks takes.
    #[command(after_help = EXIT_CODES)]
    Chunks {
        #[command(flatten)]
        sel: Select,
        /// The tag.
        #[arg(long, value_name = "TAG")]
        tag: String,
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
        /// Keep a disk backup of their contents across pause (not with a CPU backup: turn that
        /// off with --no-cpu-backup in the same command).
        #[arg(long, conflicts_with_all = ["no_disk_backup", "cpu_backup"])]
        disk_backup: bool,
        /// Keep no disk backup (with --cpu-backup, to switch a disk-backed region to CPU).
        #[arg(long)]
        no_disk_backup: bool,
    },
    /// Check that a process answers.
    #[command(after_help = EXIT_CODES)]
    Ping {
        #[command(flatten)]
        sel: Select,
    },
    /// Remove what processes that died left behind: disk backup files no live process holds
    /// (in --disk-dir, or its subfolder tms-backups-<uid> where others can write to it), and
    /// control sockets nobody listens on (in the socket folder). A process that is stopped by
    /// SIGKILL, or by a signal whose handler its host replaced, leaves them; the next process
    /// that uses the folder removes them too. Files of live processes are never touched.
    #[command(after_help = EXIT_CODES)]
    Clean(clean::CleanArgs),
    /// Start a child process with libtms.so preloaded, have it allocate pauseable memory with
    /// a pattern, pause and resume it through the control socket, and print a before/after
    /// table. By default CUDA where a GPU is usable, else the simulated device (--backend;
    /// it says which it used and why).
    #[command(after_help = EXIT_CODES)]
    Demo(demo::DemoArgs),
    /// Print the completion script of a shell for tmsctl on stdout, made from tmsctl's own
    /// command-line definition (bash: `tmsctl completions bash >
    /// ~/.local/share/bash-completion/completions/tmsctl`; zsh: as `_tmsctl` in a folder of
    /// $fpath; fish: `~/.config/fish/completions/tmsctl.fish`).
    #[command(after_help = EXIT_CODES)]
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print a manual page (roff) on stdout, made from tmsctl's own command-line definition:
    /// tmsctl(1), or tmsctl-COMMAND(1) for a command (`tmsctl man pause | man -l -`); or write
    /// them all into a folder (--out-dir).
    #[command(after_help = EXIT_CODES)]
    Man {
        /// The command whose page to print [default: the page of tmsctl itself].
        #[arg(value_name = "COMMAND", value_parser = parse_man_page)]
        command: Option<String>,
        /// Write every page into DIR instead (made if missing): tmsctl.1, and tmsctl-COMMAND.1
        /// for each command.
        #[arg(long, value_name = "DIR", conflicts_with = "command")]
        out_dir: Option<PathBuf>,
    },
    /// The demo's child process (run by `tmsctl demo`, with libtms.so preloaded).
    #[command(name = "__demo-child", hide = true)]
    DemoChild(demo::ChildArgs),
}

/// What one process answered, for both output forms.
struct Outcome {
    json: Value,
    text: String,
    /// A pause or resume of a tag the process never had: this line goes to stderr instead of
    /// `text`, and the exit code is [`Code::UnknownTag`].
    unknown_tag: Option<String>,
}

impl Outcome {
    fn new(json: Value, text: String) -> Outcome {
        Outcome {
            json,
            text,
            unknown_tag: None,
        }
    }
}

/// An error already reported (on stderr, and with --json on stdout): only the exit code remains.
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
    /// Where it comes from.
    pub origin: find::Origin,
    /// Per-process answer timeout.
    pub timeout: Duration,
    /// JSON output.
    pub json: bool,
}

impl Ctx {
    /// Run `f` against each selected process; print what each answered; report failures on
    /// stderr, one line each, and with --json in the document too (the one of the process, or
    /// its item in the array of --all). The exit code is the first failure's, else
    /// [`Code::UnknownTag`] if a process did not know the tag, else success.
    fn fan_out(
        &self,
        sel: &Select,
        f: impl Fn(&mut Client) -> client::Result<Outcome>,
    ) -> anyhow::Result<()> {
        let targets = find::targets(self, sel)?;
        let many = sel.all;
        let mut items = Vec::new();
        let mut first: Option<Code> = None;
        let mut unknown_tag = false;
        for sock in targets {
            match Client::connect(&sock, self.timeout).and_then(|mut c| f(&mut c)) {
                Ok(o) => {
                    if self.json {
                        if many {
                            items.push(o.json);
                        } else {
                            output::print_json(o.json);
                        }
                    } else if o.unknown_tag.is_none() {
                        let text = output::printable_lines(o.text.trim_end_matches('\n'));
                        println!("{text}");
                    }
                    if let Some(why) = &o.unknown_tag {
                        eprintln!("tmsctl: {}", one_line(why));
                        unknown_tag = true;
                    }
                }
                Err(e) => {
                    eprintln!("tmsctl: {}", one_line(&e.message));
                    let j = json_error(e.code, &e.message, Some(sock.pid()));
                    if many {
                        items.push(j);
                    } else if self.json {
                        output::print_json(j);
                    }
                    first.get_or_insert(e.code);
                }
            }
        }
        if self.json && many {
            output::print_json(Value::Array(items));
        }
        match (first, unknown_tag) {
            (Some(c), _) => Err(Reported(c).into()),
            (None, true) => Err(Reported(Code::UnknownTag).into()),
            (None, false) => Ok(()),
        }
    }
}

/// What `--json` prints for a failure: the `error` member of [`json_error`].
fn error_json(code: Code, message: &str) -> Value {
    json!({"exit_code": code as u8, "name": code.name(), "message": message})
}

/// What `--json` prints for a failure, about process `pid` if given (its schema version is
/// added when it is printed, as to every document).
fn json_error(code: Code, message: &str, pid: Option<u32>) -> Value {
    let mut j = json!({"error": error_json(code, message)});
    if let Some(p) = pid {
        j["pid"] = json!(p);
    }
    j
}

/// `s` on one line (white space collapsed) and [printable](output::printable).
fn one_line(s: &str) -> String {
    output::printable(&s.split_whitespace().collect::<Vec<_>>().join(" ")).into_owned()
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
    let found = find::listing(ctx)?;
    // The live processes of our pid namespace, those that /proc shows listening in other
    // folders (with why, where their socket cannot be used), then the sockets of other pid
    // namespaces (not probed: their pids mean other processes here, and their command lines
    // cannot be read from here).
    let mut socks: Vec<(Socket, Option<Failure>)> = found
        .main
        .live_here()
        .into_iter()
        .map(|s| (s, None))
        .collect();
    for a in &found.away {
        socks.push((a.socket(), a.sock.as_ref().err().cloned()));
    }
    socks.extend(found.main.elsewhere().into_iter().map(|s| (s, None)));
    let mut rows = Vec::new();
    for (sock, unusable) in socks {
        let command = match sock.ns {
            client::Ns::Other(_) => "?".to_string(),
            _ => client::command_line(sock.pid()),
        };
        let t = ctx.timeout.min(Duration::from_secs(5));
        let r = match unusable {
            Some(e) => Err(e),
            None => Client::connect(&sock, t).and_then(|mut c| status_of(&mut c)),
        };
        rows.push((sock, command, r));
    }
    if ctx.json {
        let items: Vec<Value> = rows
            .iter()
            .map(|(sock, command, r)| {
                let mut j = match r {
                    Ok(s) => json!({
                        "pid": sock.pid(), "command": command, "backend": s.backend,
                        "tags": s.tags.len(), "bytes_active": s.bytes_active(),
                        "bytes_paused": s.bytes_paused(),
                    }),
                    Err(e) => json!({"pid": sock.pid(), "command": command, "error": e.message}),
                };
                j["socket"] = json!(sock.path);
                j["pidns"] = json!(sock.name.pidns);
                j["this_pid_namespace"] = json!(sock.here());
                j
            })
            .collect();
        output::print_json(Value::Array(items));
        return Ok(());
    }
    if rows.is_empty() {
        println!(
            "{}",
            one_line(&find::none_found(ctx, &found.main, &[]).message)
        );
        return Ok(());
    }
    println!(
        "{:<8} {:<8} {:>5} {:>12} {:>12}  COMMAND",
        "PID", "BACKEND", "TAGS", "ACTIVE", "PAUSED"
    );
    let mut notes = Vec::new();
    for (sock, command, r) in rows {
        let mut command: String = command.chars().take(100).collect();
        if let client::Ns::Other(ns) = sock.ns {
            command = format!("(pid {} of pid namespace {ns}, not this one)", sock.pid());
        }
        if let Some(d) = sock.path.parent().filter(|d| *d != found.main.dir) {
            notes.push(format!(
                "pid {} listens in {}",
                sock.pid(),
                output::printable(&d.display().to_string())
            ));
        }
        match r {
            Ok(s) => println!(
                "{:<8} {:<8} {:>5} {:>12} {:>12}  {command}",
                sock.pid(),
                output::printable(&s.backend),
                s.tags.len(),
                output::human(s.bytes_active()),
                output::human(s.bytes_paused())
            ),
            Err(e) => println!(
                "{:<8} {:<8} {:>5} {:>12} {:>12}  {command}  ({})",
                sock.pid(),
                "-",
                "-",
                "-",
                "-",
                one_line(&e.message)
            ),
        }
    }
    if !notes.is_empty() {
        println!(
            "\n{}, not in {} ({}): their TMS_SOCKET_DIR or XDG_RUNTIME_DIR differ from tmsctl's",
            notes.join(", "),
            output::printable(&found.main.dir.display().to_string()),
            ctx.origin.about()
        );
    }
    Ok(())
}

/// Refuse, before asking, what a process whose library predates chunks cannot do.
fn needs_chunks(c: &Client) -> client::Result<()> {
    if c.hello.has(FEATURE_CHUNKS) {
        return Ok(());
    }
    Err(Failure::new(
        Code::Failed,
        format!(
            "process {}: its library ({}) predates chunked allocations: it cannot pause, \
             resume or list chunks (use the whole tag, or a newer libtms.so)",
            c.pid(),
            output::printable(&c.hello.software)
        ),
    ))
}

/// Which operation a pause or resume request asks for, of what.
fn asked(req: &Request) -> Option<(Op, Option<String>, Option<tms_proto::ChunkRanges>, bool)> {
    match req {
        Request::Pause {
            tag,
            chunks,
            chunk_state,
            ..
        } => Some((Op::Pause, tag.clone(), chunks.clone(), *chunk_state)),
        Request::Resume {
            tag,
            chunks,
            chunk_state,
            ..
        } => Some((Op::Resume, tag.clone(), chunks.clone(), *chunk_state)),
        _ => None,
    }
}

/// "the pause of tag \"kv\"", "the resume of chunks 0-3 of tag \"kv\"", ...
fn op_words(which: Op, asked: Option<&str>, chunks: Option<&tms_proto::ChunkRanges>) -> String {
    format!(
        "the {} of {}",
        match which {
            Op::Pause => "pause",
            Op::Resume => "resume",
        },
        match chunks {
            Some(c) => format!(
                "chunks {} of tag {}",
                format_chunk_ranges(c),
                output::quoted(asked.unwrap_or_default())
            ),
            None => asked.map_or("every tag".to_string(), |t| format!(
                "tag {}",
                output::quoted(t)
            )),
        }
    )
}

/// Send one pause or resume to `c` and wait for its result, watching its progress where the
/// process reports it (shown as `show` says; the wait lasts as long as the operation moves).
fn run_one(
    ctx: &Ctx,
    with_pid: bool,
    show: progress::Show,
    c: &mut Client,
    req: &Request,
) -> client::Result<tms_proto::OpDone> {
    let Some((which, asked, sent_chunks, chunk_state)) = asked(req) else {
        return Err(Failure::new(
            Code::Failed,
            "run_one takes a pause or a resume",
        ));
    };
    if sent_chunks.is_some() || chunk_state {
        needs_chunks(c)?;
    }
    if matches!(req, Request::Resume { no_wait: true, .. }) && !c.hello.has(FEATURE_NO_WAIT) {
        return Err(Failure::new(
            Code::Failed,
            format!(
                "process {}: its library ({}) predates resume --no-wait (resume without it, \
                 or use a newer libtms.so)",
                c.pid(),
                output::printable(&c.hello.software)
            ),
        ));
    }
    let what = op_words(which, asked.as_deref(), sent_chunks.as_ref());
    // With a process that reports progress, a second connection watches it: for the
    // display, and so that the wait lasts as long as the operation moves.
    let watch = c.hello.has(FEATURE_PROGRESS).then(|| {
        progress::Watch::start(
            c.socket(),
            ctx.timeout,
            progress::Asked {
                pid: c.pid(),
                with_pid,
                op: which,
                tag: asked.clone(),
                chunks: sent_chunks.clone(),
            },
            show,
        )
    });
    let moved = watch.as_ref().map(|w| move || w.last_moved());
    let reply = c.ask_while(req, moved.as_ref().map(|m| m as &dyn Fn() -> Instant));
    if let Some(w) = watch {
        w.finish();
    }
    let d = match reply {
        Ok(Reply::Done(d)) => d,
        Ok(r) => {
            return Err(Failure::new(
                Code::Failed,
                format!(
                    "process {}: unexpected reply {}",
                    c.pid(),
                    output::printable(&format!("{r:?}"))
                ),
            ))
        }
        Err(f) => return Err(c.still_running(f, &what)),
    };
    // Printed as the process's word on what was done: it must be about what was asked.
    if d.op != which || d.tag != asked || d.chunks != sent_chunks {
        return Err(Failure::new(
            Code::Failed,
            format!(
                "process {}: a reply about another operation than {what}: {}",
                c.pid(),
                output::printable(&format!(
                    "op {:?}, tag {:?}, chunks {:?}",
                    d.op, d.tag, d.chunks
                ))
            ),
        ));
    }
    Ok(d)
}

fn op(
    ctx: &Ctx,
    sel: &Select,
    req: Request,
    show: ShowProgress,
    atomic: bool,
) -> anyhow::Result<()> {
    let show = progress::Show::pick(show.progress, show.no_progress);
    if atomic {
        return atomic::run(ctx, sel, &req, show);
    }
    let Some((_, asked, _, chunk_state)) = asked(&req) else {
        return Err(anyhow::anyhow!("op() takes a pause or a resume"));
    };
    ctx.fan_out(sel, |c| {
        let d = run_one(ctx, sel.all, show, c, &req)?;
        let mut json = with_pid(c.pid(), &d);
        let mut text = output::done(c.pid(), &d, chunk_state);
        if sel.pid.is_none() {
            (json, text) = name_target(c.pid(), json, &text);
        }
        Ok(Outcome {
            json,
            text,
            unknown_tag: d
                .unknown_tag
                .then(|| output::unknown_tag(c.pid(), &d, asked.as_deref())),
        })
    })
}

/// A pause's or resume's result (`pid P: paused ...`) naming the process by its command line
/// too, where no --pid named it: `pid P (python serve.py): paused ...`, and `"command"` in JSON.
fn name_target(pid: u32, mut json: Value, text: &str) -> (Value, String) {
    json["command"] = json!(client::command_line(pid));
    let prefix = format!("pid {pid}:");
    let text = match text.strip_prefix(&prefix) {
        Some(rest) => format!("pid {pid} ({}):{rest}", client::short_command(pid)),
        None => text.to_string(),
    };
    (json, text)
}

fn chunks(ctx: &Ctx, sel: &Select, tag: String) -> anyhow::Result<()> {
    let req = Request::Chunks { tag: tag.clone() };
    ctx.fan_out(sel, |c| {
        needs_chunks(c)?;
        let s: ChunkStatus = c.ask_for(&req, |r| match r {
            Reply::Chunks(s) => Some(s),
            _ => None,
        })?;
        // A tag past the server's bound comes back shortened (its start, then the length).
        let same_tag = s.tag == tag
            || (tag.len() > 1024
                && s.tag.contains('\u{2026}')
                && tag.starts_with(&s.tag[..s.tag.find('\u{2026}').unwrap_or(0)]));
        let states_ok =
            s.states.len() as u64 == s.count && s.states.bytes().all(|b| b == b'0' || b == b'1');
        if !same_tag || !states_ok {
            return Err(Failure::new(
                Code::Failed,
                format!(
                    "process {}: a bad reply about the chunks of tag {}: {}",
                    c.pid(),
                    output::quoted(&tag),
                    output::printable(&format!(
                        "tag {:?}, count {}, {} states",
                        s.tag,
                        s.count,
                        s.states.len()
                    ))
                ),
            ));
        }
        let mut j = with_pid(c.pid(), &s);
        let (active, paused) = (s.active(), s.paused());
        j["active"] = json!(format_ranges(&active));
        j["paused"] = json!(format_ranges(&paused));
        j["active_chunks"] = json!(active.len());
        j["paused_chunks"] = json!(paused.len());
        Ok(Outcome::new(j, output::chunks(c.pid(), &s)))
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
        Ok(Outcome::new(
            with_pid(c.pid(), &r),
            format!("pid {}: default region: {}", c.pid(), output::region(&r)),
        ))
    })
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let ctx = Ctx {
        dir: cli
            .global
            .socket_dir
            .clone()
            .unwrap_or_else(|| tms_proto::socket_dir_from_env(client::euid())),
        origin: find::Origin::of_env(cli.global.socket_dir.is_some()),
        timeout: cli.global.timeout,
        json: cli.global.json,
    };
    match cli.cmd {
        Cmd::List => list(&ctx),
        Cmd::Status { sel } => ctx.fan_out(&sel, |c| {
            let s = status_of(c)?;
            Ok(Outcome::new(
                serde_json::to_value(&s).unwrap_or(Value::Null),
                output::status(&s, &client::command_line(c.pid())),
            ))
        }),
        Cmd::Pause {
            sel,
            tag,
            chunks,
            save_chunk_state,
            show,
            atomic,
        } => op(
            &ctx,
            &sel,
            Request::Pause {
                tag,
                chunks: chunks.map(|c| chunk_ranges(&c.0)),
                chunk_state: save_chunk_state,
                job_record: false,
            },
            show,
            atomic.atomic,
        ),
        Cmd::Resume {
            sel,
            tag,
            chunks,
            restore_chunk_state,
            no_wait,
            show,
            atomic,
        } => op(
            &ctx,
            &sel,
            Request::Resume {
                tag,
                chunks: chunks.map(|c| chunk_ranges(&c.0)),
                chunk_state: restore_chunk_state,
                job_record: false,
                no_wait,
            },
            show,
            atomic.atomic,
        ),
        Cmd::Chunks { sel, tag } => chunks(&ctx, &sel, tag),
        Cmd::Region {
            sel,
            enable,
            disable,
            tag,
            cpu_backup,
            no_cpu_backup,
            backend,
            disk_backup,
            no_disk_backup,
        } => {
            let u = RegionUpdate {
                enabled: (enable || disable).then_some(enable),
                tag,
                cpu_backup: (cpu_backup || no_cpu_backup).then_some(cpu_backup),
                backend: backend.map(|b| match b {
                    BackendArg::Pinned => BackupBackend::Pinned,
                    BackendArg::Mmap => BackupBackend::Mmap,
                }),
                disk_backup: (disk_backup || no_disk_backup).then_some(disk_backup),
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
            Ok(Outcome::new(
                json!({"pid": pid, "seconds": s}),
                format!("pid {pid}: pong in {:.2} ms", s * 1e3),
            ))
        }),
        Cmd::Clean(a) => clean::run(&ctx, &a),
        Cmd::Demo(a) => demo::run(&ctx, &a),
        Cmd::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut completion_command(), "tmsctl", &mut script);
            write_stdout(&script)
        }
        Cmd::Man {
            command,
            out_dir: None,
        } => write_stdout(&man_page(command.as_deref())?),
        Cmd::Man {
            out_dir: Some(dir), ..
        } => write_man_pages(&dir),
        Cmd::DemoChild(a) => demo::child(&a),
    }
}

/// tmsctl's command line as its manual pages describe it: the commands a user can run, and no
/// `help` command (clap adds one; each page already says what `--help` does). The version is
/// the plain one: the pages are checked in, and would otherwise change with every commit.
fn man_command() -> clap::Command {
    let mut cmd = <Cli as clap::CommandFactory>::command()
        .disable_help_subcommand(true)
        .version(env!("CARGO_PKG_VERSION"));
    cmd.build();
    cmd
}

/// tmsctl's command line as the completion scripts offer it: without the hidden commands, which
/// clap_complete would offer too (and `Command` cannot remove a subcommand, so the root is made
/// again from the same arguments and the visible commands).
fn completion_command() -> clap::Command {
    let full = <Cli as clap::CommandFactory>::command();
    let mut cmd = clap::Command::new("tmsctl").version(env!("CARGO_PKG_VERSION"));
    for a in full.get_arguments() {
        cmd = cmd.arg(a.clone());
    }
    for c in full.get_subcommands().filter(|c| !c.is_hide_set()) {
        cmd = cmd.subcommand(c.clone());
    }
    cmd
}

/// The names `tmsctl man` takes: each command that `tmsctl --help` lists.
fn man_page_names() -> Vec<String> {
    man_command()
        .get_subcommands()
        .filter(|c| !c.is_hide_set())
        .map(|c| c.get_name().to_string())
        .collect()
}

fn parse_man_page(s: &str) -> Result<String, String> {
    let names = man_page_names();
    if names.iter().any(|n| n == s) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "no command {s:?} [possible values: {}]",
            names.join(", ")
        ))
    }
}

/// tmsctl's manual pages: its own, then one per command (`tmsctl-pause`), each with its file
/// name (`tmsctl-pause.1`).
fn man_pages() -> Vec<clap_mangen::Man> {
    let root = man_command();
    let mut cmds = vec![root.clone()];
    cmds.extend(root.get_subcommands().filter(|c| !c.is_hide_set()).cloned());
    cmds.into_iter()
        .map(|c| {
            // The commands' pages say whose version they describe too (by default they name the
            // command alone).
            clap_mangen::Man::new(c).source(concat!("tmsctl ", env!("CARGO_PKG_VERSION")))
        })
        .collect()
}

fn render(page: &clap_mangen::Man) -> anyhow::Result<Vec<u8>> {
    let mut roff = Vec::new();
    page.render(&mut roff)?;
    Ok(with_exit_status(&String::from_utf8(roff)?).into_bytes())
}

/// `page` with its section EXTRA (what clap_mangen makes of the text after the help: the exit
/// codes, run together into one paragraph) made the usual EXIT STATUS, its lines kept.
fn with_exit_status(page: &str) -> String {
    use clap_mangen::roff::{roman, Roff};
    let Some(start) = page.find("\n.SH EXTRA\n").map(|i| i + 1) else {
        return page.to_string();
    };
    let end = page[start + 1..]
        .find("\n.SH ")
        .map_or(page.len(), |i| start + 1 + i + 1);
    let mut section = Roff::new();
    section.control("SH", ["EXIT STATUS"]).control("nf", []);
    for line in EXIT_CODES
        .lines()
        .skip_while(|l| l.starts_with("Exit codes"))
    {
        section.text([roman(line)]);
    }
    section.control("fi", []);
    // Each rendering starts with the same preamble, which the page has already.
    let preamble = Roff::new().render();
    let section = section.render();
    let section = section.strip_prefix(&preamble).unwrap_or(&section);
    format!("{}{section}{}", &page[..start], &page[end..])
}

/// The manual page (roff) of tmsctl, or of one of its commands (`tmsctl-pause(1)`).
fn man_page(command: Option<&str>) -> anyhow::Result<Vec<u8>> {
    let file = match command {
        None => "tmsctl.1".to_string(),
        Some(name) => format!("tmsctl-{name}.1"),
    };
    let pages = man_pages();
    let page = pages
        .iter()
        .find(|p| p.get_filename() == file)
        .ok_or_else(|| Failure::new(Code::Usage, format!("no manual page {file}")))?;
    render(page)
}

fn write_man_pages(dir: &std::path::Path) -> anyhow::Result<()> {
    let shown = output::printable(&dir.display().to_string()).into_owned();
    std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("cannot make {shown}: {e}"))?;
    for page in man_pages() {
        let path = dir.join(page.get_filename());
        std::fs::write(&path, render(&page)?).map_err(|e| {
            anyhow::anyhow!(
                "cannot write {}: {e}",
                output::printable(&path.display().to_string())
            )
        })?;
    }
    Ok(())
}

fn write_stdout(bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(bytes)
        .and_then(|()| out.flush())
        .map_err(|e| anyhow::anyhow!("writing to stdout: {e}"))
}

/// `--json` on the command line (before any `--`), for errors found before it was parsed.
fn json_asked() -> bool {
    std::env::args_os()
        .skip(1)
        .take_while(|a| a != "--")
        .any(|a| a == "--json")
}

/// A command-line error in one line, as every other error: clap's first line (and its tip, if
/// any), then where the help is.
fn usage_line(e: &clap::Error) -> String {
    use clap::error::ErrorKind as K;
    let text = e.render().to_string();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    // Where to send the reader: the (sub)command of the usage line.
    let command = lines
        .iter()
        .find_map(|l| l.strip_prefix("Usage:"))
        .map(|u| {
            u.split_whitespace()
                .take_while(|w| !w.starts_with(['[', '<', '-']))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .filter(|c| !c.is_empty())
        .or_else(|| {
            // Errors without a usage line: the first word of the command line that names a
            // subcommand.
            let cmd = <Cli as clap::CommandFactory>::command();
            std::env::args().skip(1).find_map(|a| {
                cmd.get_subcommands()
                    .any(|c| !c.is_hide_set() && c.get_name() == a)
                    .then(|| format!("tmsctl {a}"))
            })
        })
        .unwrap_or_else(|| "tmsctl".to_string());
    let mut what = if e.kind() == K::DisplayHelpOnMissingArgumentOrSubcommand {
        let cmd = <Cli as clap::CommandFactory>::command();
        let names: Vec<String> = cmd
            .get_subcommands()
            .filter(|c| !c.is_hide_set())
            .map(|c| c.get_name().to_string())
            .collect();
        format!("a command is needed ({})", names.join(", "))
    } else {
        let first = lines.first().copied().unwrap_or("bad command line");
        let mut what = first
            .strip_prefix("error:")
            .unwrap_or(first)
            .trim()
            .to_string();
        // "the following required arguments were not provided:" and the arguments, a line
        // each, up to the usage line.
        if what.ends_with(':') {
            let named: Vec<&str> = lines
                .iter()
                .skip(1)
                .take_while(|l| !l.starts_with("Usage:"))
                .copied()
                .collect();
            what = format!("{what} {}", named.join(", "));
        }
        what
    };
    if let Some(values) = lines.iter().find(|l| l.starts_with("[possible values:")) {
        what = format!("{what} {values}");
    }
    if let Some(tip) = lines.iter().find_map(|l| l.strip_prefix("tip:")) {
        what = format!("{what} ({})", tip.trim());
    }
    one_line(&format!("{what}; see '{command} --help'"))
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind as K;
            if matches!(e.kind(), K::DisplayHelp | K::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            let line = usage_line(&e);
            eprintln!("tmsctl: {line}");
            if json_asked() {
                output::print_json(json_error(Code::Usage, &line, None));
            }
            return ExitCode::from(Code::Usage as u8);
        }
    };
    let json = cli.global.json;
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if let Some(Reported(c)) = e.downcast_ref::<Reported>() {
                return ExitCode::from(*c as u8);
            }
            let code = e.downcast_ref::<Failure>().map_or(Code::Failed, |f| f.code);
            let msg = e
                .chain()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(": ");
            eprintln!("tmsctl: {}", one_line(&msg));
            // A command that printed its document already told the failure there (the demo's
            // report): stdout keeps one document.
            if json && !output::json_printed() {
                output::print_json(json_error(code, &msg, None));
            }
            ExitCode::from(code as u8)
        }
    }
}
