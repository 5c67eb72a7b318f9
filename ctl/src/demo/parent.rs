//! `tmsctl demo` itself: start the child, pause and resume it through its control socket, print
//! each step's row as it is done, and check what the steps did.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tms_proto::{OpDone, Reply, Request, Status};

use super::library::find_lib;
use super::spawn::DemoChild;
use super::table::{free_of, tag_of, Row, Table};
use super::{DemoArgs, DemoBackend};
use crate::client::{self, Client};
use crate::ctx::Ctx;
use crate::failure::{Code, Failure};
use crate::folder::Folder;
use crate::output::{error_json, human};
use crate::text::printable;

/// Print `text` on stdout now (a pipe would hold it back until the end otherwise).
fn say_now(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
}

fn status(c: &mut Client) -> client::Result<Status> {
    c.ask_for(&Request::Status, |r| match r {
        Reply::Status(s) => Some(*s),
        _ => None,
    })
}

/// A pause or resume, its progress shown as `tmsctl pause` shows it (on a terminal), and its
/// wait bounded by the time without progress where the library reports it.
fn op(
    c: &mut Client,
    req: Request,
    timeout: Duration,
    show: crate::progress::Show,
) -> client::Result<OpDone> {
    let watch = match &req {
        Request::Pause { tag, .. } | Request::Resume { tag, .. }
            if c.hello.has(tms_proto::FEATURE_PROGRESS) =>
        {
            Some(crate::progress::Watch::start(
                c.socket(),
                timeout,
                crate::progress::Asked {
                    pid: c.pid(),
                    with_pid: false,
                    op: if matches!(req, Request::Pause { .. }) {
                        tms_proto::Op::Pause
                    } else {
                        tms_proto::Op::Resume
                    },
                    tag: tag.clone(),
                    chunks: None,
                },
                show,
            ))
        }
        _ => None,
    };
    let moved = watch.as_ref().map(|w| move || w.last_moved());
    let r = c.ask_while(&req, moved.as_ref().map(|m| m as &dyn Fn() -> Instant));
    drop(watch);
    match r? {
        Reply::Done(d) => Ok(d),
        other => Err(Failure::new(
            Code::Failed,
            format!(
                "process {}: unexpected reply {}",
                c.pid(),
                printable(&format!("{other:?}"))
            ),
        )),
    }
}

/// The device the demo asks for and why, in words: `--backend`, else `$TMS_BACKEND` as the
/// library reads it (`auto` is CUDA only there), else the demo's default, cuda-or-sim.
fn backend_choice(flag: Option<DemoBackend>) -> anyhow::Result<(DemoBackend, String)> {
    if let Some(b) = flag {
        return Ok((b, format!("--backend {}", b.name())));
    }
    let env = std::env::var("TMS_BACKEND").unwrap_or_default();
    Ok(match env.trim() {
        "" => (
            DemoBackend::CudaOrSim,
            "--backend cuda-or-sim, the default".to_string(),
        ),
        "auto" => (
            DemoBackend::Cuda,
            "TMS_BACKEND=auto, which is CUDA only in the library".to_string(),
        ),
        "cuda" => (DemoBackend::Cuda, "TMS_BACKEND=cuda".to_string()),
        "sim" => (DemoBackend::Sim, "TMS_BACKEND=sim".to_string()),
        other => {
            return Err(Failure::new(
                Code::Usage,
                format!(
                    "TMS_BACKEND={}: expected auto, cuda or sim",
                    crate::output::quoted(other)
                ),
            )
            .into())
        }
    })
}

/// `tmsctl demo`.
pub fn run(ctx: &Ctx, a: &DemoArgs) -> anyhow::Result<()> {
    let lib = find_lib(a.lib.as_deref())?;
    let (choice, because) = backend_choice(a.backend)?;
    let mut fallback: Option<String> = None;
    let first = if choice == DemoBackend::Sim {
        "sim"
    } else {
        "cuda"
    };
    let mut child = DemoChild::spawn(&lib, first, a.size, &a.tag, &ctx.dir)?;
    // The child says which device it runs on once its library has started, then writes its
    // pattern (seconds, for gigabytes) and says READY: the first lines are printed at once.
    let started = match child.expect("STARTED", ctx.timeout) {
        Ok(r) => r,
        Err((stage, msg)) if stage == "init" && choice == DemoBackend::Cuda => {
            return Err(Failure::new(
                Code::Failed,
                format!(
                    "demo child (init): {}; the demo was to use CUDA only ({because}): \
                     --backend cuda-or-sim falls back to the simulated device, --backend sim \
                     uses it",
                    printable(&msg)
                ),
            )
            .into())
        }
        Err((stage, msg)) if stage == "init" && choice == DemoBackend::CudaOrSim => {
            drop(child);
            fallback = Some(msg);
            child = DemoChild::spawn(&lib, "sim", a.size, &a.tag, &ctx.dir)?;
            match child.expect("STARTED", ctx.timeout) {
                Ok(r) => r,
                Err(e) => return Err(child_failure(&mut child, &lib, e).into()),
            }
        }
        Err(e) => return Err(child_failure(&mut child, &lib, e).into()),
    };
    let pid = child.pid();
    let driver_note = match (&fallback, started.as_str()) {
        (Some(why), _) => format!(
            "sim (the simulated device: {because}, and CUDA could not start: {})",
            printable(why)
        ),
        (None, "sim") => format!("sim (the simulated device: {because})"),
        (None, b) => format!("{} ({because})", printable(b)),
    };
    if !ctx.json {
        say_now(&format!(
            "tmsctl demo: child {pid} with LD_PRELOAD={}\ndriver {driver_note}",
            printable(&lib.display().to_string()),
        ));
    }
    let ready = child
        .expect("READY", ctx.timeout)
        .map_err(|e| child_failure(&mut child, &lib, e))?;
    let ready: Value = serde_json::from_str(&ready).unwrap_or(Value::Null);
    let backend = ready["backend"].as_str().unwrap_or("?").to_string();
    let socket = ready["socket"].as_str().map(str::to_string);
    if socket.is_none() {
        return Err(Failure::new(
            Code::Failed,
            format!(
                "the demo child has no control socket: {}",
                ready["socket_error"].as_str().unwrap_or("?")
            ),
        )
        .into());
    }

    let sock = Folder::open(&ctx.dir)?.find(pid)?;
    let mut c = Client::connect(&sock, ctx.timeout)?;
    let tag = Some(a.tag.clone());
    // Each row is printed as soon as its step is done (the widths are fixed, so the columns
    // line up without knowing the later rows).
    let mut table = Table::new(&a.tag);
    if !ctx.json {
        say_now(&format!(
            "{} pauseable with CPU backup (pinned), tag {}, control socket {}\n\n{}",
            human(a.size),
            crate::output::quoted(&a.tag),
            printable(socket.as_deref().unwrap_or("?")),
            Table::header()
        ));
    }
    let show = crate::progress::Show::pick(false, false);
    let mut rows = Vec::new();
    let mut step = |c: &mut Client, step: &'static str, done: Option<OpDone>| {
        let r = Row {
            step,
            status: status(c)?,
            done,
        };
        if !ctx.json {
            say_now(&table.row(&r));
        }
        rows.push(r);
        client::Result::Ok(())
    };
    step(&mut c, "allocated", None)?;
    let d = op(
        &mut c,
        Request::Pause {
            tag: tag.clone(),
            chunks: None,
            chunk_state: false,
            job_record: false,
        },
        ctx.timeout,
        show,
    )?;
    step(&mut c, "paused", Some(d))?;
    let d = op(
        &mut c,
        Request::Resume {
            tag: tag.clone(),
            chunks: None,
            chunk_state: false,
            job_record: false,
            no_wait: false,
            verify: false,
        },
        ctx.timeout,
        show,
    )?;
    step(&mut c, "resumed", Some(d))?;
    drop(c);
    child.send("verify")?;
    let verdict = match child.expect("VERIFY", ctx.timeout) {
        Ok(v) => v,
        Err((s, m)) => format!("error ({s}): {m}"),
    };
    child.finish();

    // Checks.
    let mapped = tag_of(&rows[0].status, &a.tag).map_or(0, |t| t.bytes_active);
    let paused = tag_of(&rows[1].status, &a.tag).map_or(0, |t| t.bytes_paused);
    let active_after = tag_of(&rows[2].status, &a.tag).map_or(0, |t| t.bytes_active);
    let given_back = match (free_of(&rows[0].status), free_of(&rows[1].status)) {
        (Some(f0), Some(f1)) => f1.saturating_sub(f0),
        _ => 0,
    };
    let mut problems = Vec::new();
    if mapped < a.size {
        problems.push(format!(
            "{} active before the pause, expected {}",
            human(mapped),
            human(a.size)
        ));
    }
    if paused != mapped {
        problems.push(format!(
            "{} paused, expected {}",
            human(paused),
            human(mapped)
        ));
    }
    if active_after != mapped {
        problems.push(format!(
            "{} active after resume, expected {}",
            human(active_after),
            human(mapped)
        ));
    }
    if verdict != "ok" {
        problems.push(format!("pattern after resume: {verdict}"));
    }
    let ok = problems.is_empty();

    if ctx.json {
        let steps: Vec<Value> = rows
            .iter()
            .map(|r| {
                let t = tag_of(&r.status, &a.tag);
                json!({
                    "step": r.step,
                    "device_free_bytes": free_of(&r.status),
                    "bytes_active": t.map_or(0, |t| t.bytes_active),
                    "bytes_paused": t.map_or(0, |t| t.bytes_paused),
                    "host_backup_bytes": t.map_or(0, |t| t.host_backup_bytes),
                    "seconds": r.done.as_ref().map(|d| d.seconds),
                    "copied_bytes": r.done.as_ref().map(|d| d.copied_bytes),
                })
            })
            .collect();
        let mut report = json!({
            "ok": ok,
            "backend": backend,
            "backend_choice": choice.name(),
            "backend_because": because,
            "fallback_reason": fallback,
            "child_pid": pid,
            "lib": lib,
            "socket": socket,
            "tag": a.tag,
            "size": a.size,
            "mapped": mapped,
            "given_back_bytes": given_back,
            "steps": steps,
            "pattern": verdict,
            "problems": problems,
        });
        // The failure returned below is told here, in the one document of the command.
        if !ok {
            report["error"] = error_json(Code::Failed, &failure_message(&problems));
        }
        crate::output::print_json(report);
    } else {
        say!();
        say!(
            "memory given back on pause : {} of {} mapped",
            human(given_back),
            human(mapped)
        );
        for (r, when) in rows.iter().skip(1).zip(["pause", "resume"]) {
            if let Some(d) = r.done.as_ref().filter(|d| d.copied_bytes > 0) {
                say!(
                    "{:<27}: {}",
                    format!("contents on {when}"),
                    crate::output::copies(d).trim_start_matches(", ")
                );
            }
        }
        say!(
            "pattern after resume       : {}",
            if verdict == "ok" {
                "identical".into()
            } else {
                printable(&verdict)
            }
        );
        say!();
        if ok {
            say!("demo OK");
        } else {
            say!("demo FAILED");
        }
    }
    if ok {
        Ok(())
    } else {
        Err(Failure::new(Code::Failed, failure_message(&problems)).into())
    }
}

/// The child's `ERROR stage message` (or its end) as the demo's failure. A library without the
/// functions the child calls was preloaded all the same: the file is named, with the loader's
/// reason where it refused the file.
fn child_failure(child: &mut DemoChild, lib: &Path, (stage, msg): (String, String)) -> Failure {
    if stage == "nolib" {
        return Failure::new(
            Code::Failed,
            format!(
                "demo child: {}: {} is not libtms.so, or not a version with every function the \
                 demo calls{}",
                printable(&msg),
                printable(&lib.display().to_string()),
                child.stderr_at_exit()
            ),
        );
    }
    // No answer within --timeout is exit code 5 for the demo as for every command.
    let code = if stage == "timeout" {
        Code::Timeout
    } else {
        Code::Failed
    };
    Failure::new(code, format!("demo child ({stage}): {msg}"))
}

fn failure_message(problems: &[String]) -> String {
    format!("demo failed: {}", problems.join("; "))
}
