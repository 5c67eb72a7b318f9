//! `tmsctl`: drive processes running Torch Memory Saver through their control sockets.
//!
//! The command line ([`cli`], its manual pages in [`man`]) picks an operation ([`ops`], [`list`],
//! [`atomic`], [`clean`], [`demo`]) on the processes [`find`] selects, over connections
//! ([`client`]) to the sockets of their folders ([`folder`], [`socket`]); [`output`] says what
//! came of it, through [`text`] where the words came from elsewhere. A failure ([`failure`])
//! carries its exit code up to here.

#![deny(clippy::print_stdout, clippy::print_stderr)]

// First: its `say!` and `tell!` serve every module after it.
#[macro_use]
mod output;
mod atomic;
mod clean;
mod cli;
mod client;
mod ctx;
mod demo;
mod failure;
mod find;
mod folder;
mod interrupt;
mod list;
mod man;
mod ops;
mod procfs;
mod progress;
mod socket;
mod status_view;
mod text;

use std::process::ExitCode;

use clap::Parser;
use tms_proto::{BackupBackend, RegionUpdate, Request};
use tms_units::chunk_ranges;

use cli::{BackendArg, Cli, Cmd, Select, ShowProgress};
use ctx::Ctx;
use failure::{Code, Failure, Reported};
use output::{json_error, print_json, write_stdout};
use text::one_line;

/// A pause or resume: on every process or none with `--atomic`, else on each on its own.
fn pause_or_resume(
    ctx: &Ctx,
    sel: &Select,
    req: Request,
    show: ShowProgress,
    atomic: bool,
) -> anyhow::Result<()> {
    let show = progress::Show::pick(show.progress, show.no_progress);
    if atomic {
        atomic::run(ctx, sel, &req, show)
    } else {
        ops::op(ctx, sel, req, show)
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let g = cli.global;
    let ctx = Ctx::new(g.socket_dir, g.timeout, g.json);
    match cli.cmd {
        Cmd::List => list::run(&ctx),
        Cmd::Status { sel } => ops::status(&ctx, &sel),
        Cmd::Pause {
            sel,
            tag,
            chunks,
            save_chunk_state,
            show,
            atomic,
        } => pause_or_resume(
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
            verify,
            show,
            atomic,
        } => pause_or_resume(
            &ctx,
            &sel,
            Request::Resume {
                tag,
                chunks: chunks.map(|c| chunk_ranges(&c.0)),
                chunk_state: restore_chunk_state,
                job_record: false,
                no_wait,
                verify,
            },
            show,
            atomic.atomic,
        ),
        Cmd::Chunks { sel, tag } => ops::chunks(&ctx, &sel, tag),
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
            ops::region(&ctx, &sel, changed.then_some(u))
        }
        Cmd::Ping { sel } => ops::ping(&ctx, &sel),
        Cmd::Clean(a) => clean::run(&ctx, &a),
        Cmd::Demo(a) => demo::run(&ctx, &a),
        Cmd::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cli::completion_command(), "tmsctl", &mut script);
            write_stdout(&script)
        }
        Cmd::Man {
            command,
            out_dir: None,
        } => write_stdout(&man::man_page(command.as_deref())?),
        Cmd::Man {
            out_dir: Some(dir), ..
        } => man::write_man_pages(&dir),
        Cmd::DemoChild(a) => demo::child(&a),
    }
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
            let line = cli::usage_line(&e);
            tell!("tmsctl: {line}");
            if cli::json_asked() {
                print_json(json_error(Code::Usage, &line, None));
            }
            return ExitCode::from(Code::Usage as u8);
        }
    };
    let json = cli.global.json;
    let pid = cli.cmd.pid();
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
            tell!("tmsctl: {}", one_line(&msg));
            // A command that printed its document already told the failure there (the demo's
            // report): stdout keeps one document.
            if json && !output::json_printed() {
                print_json(json_error(code, &msg, pid));
            }
            ExitCode::from(code as u8)
        }
    }
}
