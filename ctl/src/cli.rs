//! The command line: what tmsctl takes (its commands, options and their help, the exit codes),
//! and how a command line it cannot take is told, in one line as every other error.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tms_proto::MAX_CHUNK_INDICES;

use crate::demo;
use crate::text::one_line;

/// Shown after every command's help.
pub const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  the process replied with an error (or another failure: a bad reply, a failed demo check)
  2  bad command line (or several processes and neither --pid nor --all)
  3  no such process, or it has no control socket
  4  permission denied: the process belongs to another user, or tmsctl does not trust the
     socket folder (not ours, open to others, below a folder others can change, unreadable)
     or the server (another uid or pid)
  5  no answer (or no room at the server) within --timeout; for pause and resume: the request
     was not sent whole (nothing was asked)
  6  pause/resume --tag T (with or without --chunks): no allocation of the process ever had
     tag T (nothing changed)
  7  pause/resume: sent, and not answered within --timeout (with a process that reports
     progress: nothing moved for --timeout): still running in the process (or waiting there
     for another pause or resume); it ends there on its own, and `tmsctl status` lists it
     (\"in progress\") until it has ended; with --atomic, also a Ctrl-C while it ran

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
$XDG_RUNTIME_DIR/tms (if that folder is the user's), else /tmp/tms-<uid>, of each process's own
environment; only the same user can use them (tmsctl refuses a folder that is not its user's,
that others can enter or that lies below a folder others can change, and a server that runs as
another user or is not the process its socket names). tmsctl looks in its own folder, worked out
the same way, and through /proc in the folders its user's processes listen in: --pid P finds P's
socket wherever P listens (P must be tmsctl's user's), and without --pid the processes listening
elsewhere count too, unless --socket-dir or TMS_SOCKET_DIR names tmsctl's folder (then only that
one is looked in). --pid means a pid of tmsctl's own pid namespace; `tmsctl list` shows the
sockets of other namespaces too.

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
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Args, Debug)]
pub struct Global {
    /// Print JSON instead of text: one document on stdout, an object with "schema": 1 (for
    /// `list` and --all an array of such objects, one per process; one object for --all
    /// --atomic), or on failure the error as such an object (see the exit codes below).
    #[arg(long, global = true)]
    pub json: bool,
    /// Seconds to wait for each process's answer. For pause and resume, with a process whose
    /// library reports progress, the seconds without progress instead: the wait goes on for as
    /// long as the operation (or the one it waits behind) copies bytes or changes phase, so a
    /// pause of hundreds of GiB to disk is never cut short, and ends once nothing has moved
    /// for this long (exit code 7: still running); with an older library, the whole wait.
    /// `list` waits at most 5 s for each process. From 0.001 to 1e6.
    #[arg(long, global = true, value_name = "SECONDS", default_value = "120", value_parser = parse_timeout, allow_negative_numbers = true)]
    pub timeout: Duration,
    /// Folder of the control sockets [default: $TMS_SOCKET_DIR, else $XDG_RUNTIME_DIR/tms (if that
    /// folder is the user's), else /tmp/tms-<uid>]. Named here or by TMS_SOCKET_DIR, it is the only
    /// folder looked in without --pid; else the folders /proc shows tmsctl's user's processes
    /// listening in count too.
    #[arg(long, global = true, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
}

fn parse_timeout(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    // Below a millisecond every wait would end before it began (1e-10 is 0 as a Duration).
    if !(v.is_finite() && (1e-3..=1e6).contains(&v)) {
        return Err(format!(
            "{s:?}: the timeout must be at least 0.001 and at most 1e6 seconds"
        ));
    }
    Ok(Duration::from_secs_f64(v))
}

/// A tag: not empty (no `--tag` is how every tag is named), and short enough to send (as JSON, in
/// a request line of at most `MAX_LINE_BYTES`, with room for the rest of the request).
fn parse_tag(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("a tag must not be empty (leave --tag out for every tag)".into());
    }
    let sent = serde_json::to_string(s).map_or(usize::MAX, |j| j.len());
    let most = tms_proto::MAX_LINE_BYTES - 1024;
    if sent > most {
        return Err(format!(
            "a tag of {} bytes ({sent} as sent) is longer than a request can carry (at most \
             {most} bytes)",
            s.len()
        ));
    }
    Ok(s.to_string())
}

#[derive(Args, Debug, Clone)]
pub struct Select {
    /// The process to act on, by its pid in tmsctl's pid namespace: a process of tmsctl's user,
    /// its socket found wherever it listens [default: the only process with a control socket;
    /// pause and resume name it by its command line, and with several tmsctl names each and
    /// stops, counting those whose socket it cannot use].
    #[arg(long, value_name = "PID", allow_negative_numbers = true)]
    pub pid: Option<u32>,
    /// Every process with a control socket (of tmsctl's pid namespace), in turn; one that /proc
    /// shows listening where tmsctl cannot use its socket (a socket folder it refuses) is not
    /// asked and is reported as failed (exit code 4 for a refused folder), never left out.
    #[arg(long, conflicts_with = "pid")]
    pub all: bool,
}

/// Every process or none.
#[derive(Args, Debug, Clone, Copy)]
pub struct Atomic {
    /// Every process or none: act on the processes in turn, and if one fails, undo the
    /// operation on those that succeeded (a pause by resuming what it paused, from the backups it
    /// wrote; a resume by pausing again what it resumed), and what the failed one changed all the
    /// same (as its error reply says; judged from the tag's state where the reply does not), so
    /// that every process ends as before.
    /// The exit code is the failure's; the output says what was undone, and what could not be
    /// undone exactly (a resume of a tag that was partly active before). Ctrl-C fails the
    /// operation under way, which is then undone like any failure (a second Ctrl-C ends tmsctl
    /// at once). Meant for --all.
    #[arg(long)]
    pub atomic: bool,
}

/// Whether pause and resume show their progress.
#[derive(Args, Debug, Clone, Copy)]
pub struct ShowProgress {
    /// Show progress on stderr while it runs (bytes copied of the total, where to, rate, time
    /// left), also when stderr is not a terminal (a line about every second there; on a
    /// terminal, the default, one line rewritten in place). Needs a process whose library
    /// reports progress.
    #[arg(long, overrides_with = "no_progress")]
    pub progress: bool,
    /// Show no progress, even on a terminal.
    #[arg(long)]
    pub no_progress: bool,
}

/// Chunk indices from the command line (`8-15,20`): sorted, each once.
#[derive(Clone, Debug)]
pub struct ChunkList(pub Vec<usize>);

fn parse_chunk_list(s: &str) -> Result<ChunkList, String> {
    tms_units::parse_ranges(s, MAX_CHUNK_INDICES)
        .map(ChunkList)
        .map_err(|e| e.to_string())
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum BackendArg {
    /// Page-locked host memory.
    Pinned,
    /// Pageable anonymous memory.
    Mmap,
}

/// Arguments of `tmsctl clean`.
#[derive(Args, Debug)]
pub struct CleanArgs {
    /// Disk backup folder to clean [default: $TMS_DISK_BACKUP_DIR, else the system's temporary
    /// folder]. Where others can write to it, the files are in its subfolder
    /// tms-backups-<uid>, as the library puts them.
    #[arg(long, value_name = "DIR")]
    pub disk_dir: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
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
        #[arg(long, value_name = "TAG", value_parser = parse_tag)]
        tag: Option<String>,
        /// Only these chunks of the tag's chunked allocation (the tag must have exactly one;
        /// needs --tag): indices from 0 and inclusive ranges, such as 8-15,20. Chunks paused
        /// already are left alone. `tmsctl chunks --tag TAG` shows them.
        #[arg(long, value_name = "LIST", requires = "tag", value_parser = parse_chunk_list, allow_negative_numbers = true)]
        chunks: Option<ChunkList>,
        /// First record which allocations (and chunks of chunked ones) are active, so that
        /// `resume --restore-chunk-state` brings back only those. Not with --atomic, whose pause
        /// keeps a record of its own for its undo.
        #[arg(long, conflicts_with_all = ["chunks", "atomic"])]
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
        #[arg(long, value_name = "TAG", value_parser = parse_tag)]
        tag: Option<String>,
        /// Only these chunks of the tag's chunked allocation (the tag must have exactly one;
        /// needs --tag): indices from 0 and inclusive ranges, such as 8-15,20. Chunks active
        /// already are left alone.
        #[arg(long, value_name = "LIST", requires = "tag", value_parser = parse_chunk_list, allow_negative_numbers = true)]
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
        /// Check what came back: digest the restored memory on the device and compare it with
        /// the CPU backups. A difference fails the resume, which leaves the memory paused with
        /// its backups (nothing is lost; run it again). Memory restored from disk backups is
        /// refused (their checksums are checked as they are read). Not with --no-wait.
        #[arg(long, conflicts_with = "no_wait")]
        verify: bool,
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
        #[arg(long, value_name = "TAG", value_parser = parse_tag)]
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
        #[arg(long, value_name = "TAG", value_parser = parse_tag)]
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
    Clean(CleanArgs),
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

impl Cmd {
    /// The process `--pid` names, where the command takes it: a failure before that process is
    /// reached (no such process, no socket, another user's) is still about it.
    pub fn pid(&self) -> Option<u32> {
        match self {
            Cmd::Status { sel }
            | Cmd::Pause { sel, .. }
            | Cmd::Resume { sel, .. }
            | Cmd::Chunks { sel, .. }
            | Cmd::Region { sel, .. }
            | Cmd::Ping { sel } => sel.pid,
            _ => None,
        }
    }
}

/// The commands `tmsctl --help` lists (not the hidden ones): what `tmsctl man` takes, and what a
/// command line without a command is told.
pub fn command_names() -> Vec<String> {
    <Cli as clap::CommandFactory>::command()
        .get_subcommands()
        .filter(|c| !c.is_hide_set())
        .map(|c| c.get_name().to_string())
        .collect()
}

fn parse_man_page(s: &str) -> Result<String, String> {
    let names = command_names();
    if names.iter().any(|n| n == s) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "no command {s:?} [possible values: {}]",
            names.join(", ")
        ))
    }
}

/// tmsctl's command line as the completion scripts offer it: without the hidden commands, which
/// clap_complete would offer too (and `Command` cannot remove a subcommand, so the root is made
/// again from the same arguments and the visible commands).
pub fn completion_command() -> clap::Command {
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

/// `--json` on the command line (before any `--`), for errors found before it was parsed.
pub fn json_asked() -> bool {
    std::env::args_os()
        .skip(1)
        .take_while(|a| a != "--")
        .any(|a| a == "--json")
}

/// A command-line error in one line, as every other error: clap's first line (and its tip, if
/// any), then where the help is.
pub fn usage_line(e: &clap::Error) -> String {
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
            let names = command_names();
            std::env::args()
                .skip(1)
                .find_map(|a| names.contains(&a).then(|| format!("tmsctl {a}")))
        })
        .unwrap_or_else(|| "tmsctl".to_string());
    let mut what = if e.kind() == K::DisplayHelpOnMissingArgumentOrSubcommand {
        format!("a command is needed ({})", command_names().join(", "))
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
    // A value too long to read back (a 70 KB tag) is shown by its start and its length.
    if let Some((start, rest)) = what.split_once("invalid value '") {
        if let Some((value, end)) = rest.split_once("' for '") {
            if value.chars().count() > 64 {
                let head: String = value.chars().take(32).collect();
                what = format!(
                    "{start}invalid value '{head}\u{2026}' ({} bytes) for '{end}",
                    value.len()
                );
            }
        }
    }
    if let Some(values) = lines.iter().find(|l| l.starts_with("[possible values:")) {
        what = format!("{what} {values}");
    }
    if let Some(tip) = lines.iter().find_map(|l| l.strip_prefix("tip:")) {
        what = format!("{what} ({})", tip.trim());
    }
    one_line(&format!("{what}; see '{command} --help'"))
}
