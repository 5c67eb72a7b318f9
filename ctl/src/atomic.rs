//! `tmsctl pause|resume --atomic`: every process or none, over the processes' own control
//! sockets (one node; across nodes, `torch_memory_saver.distributed` does the same over
//! torch.distributed).
//!
//! The processes are asked in turn; at the first failure the rest are not asked, and each
//! process that changed is brought back to where it was:
//!
//! - a whole-tag pause (which gives back memory a failed non-blocking resume left unrestored,
//!   and no undo brings that back: said so) is sent with `chunk_state` (the process records which allocations and
//!   chunks were active), and undone by a resume that restores that record: what was paused
//!   before stays paused, and the contents come back from the backups the pause wrote. A process
//!   whose own pause failed part-way is undone the same way, if that pause changed anything (a
//!   pause that failed before starting may have recorded nothing, and a restore without a record
//!   would resume everything);
//! - a whole-tag resume is undone by pausing the tag, which is exact only where nothing of the
//!   tag was active before: elsewhere the undo is skipped and said so (nothing is lost: the tag
//!   stays resumed). A resume that fails undoes itself in the process (it is all or nothing),
//!   unless it did its work and then failed to report an earlier failed restore: the failed
//!   process is paused again wherever its tag took memory back. Memory a non-blocking resume
//!   is restoring is left alone (a pause would take it from the program waiting for it);
//!   memory one left unrestored is paused, given back, which is not as before and said so;
//! - a pause or resume of chunks is undone by the opposite operation on the chunks it was asked
//!   for whose state changed its way (read before and after with `chunks`): a chunk the program
//!   paused or resumed meanwhile is left as the program made it;
//! - a process whose operation was still running at `--timeout` (exit 7) is undone only once
//!   its `status` lists the operation no more (waiting while it, or the one it waits behind,
//!   moves, up to `--timeout` with nothing moving), by what it changed; if it still runs, that
//!   process is reported as not as before. Nothing is claimed that tmsctl has not seen.
//!
//! An undo reaches the process that was asked or none ([`Client::connect`]): one that ended
//! meanwhile, its pid given to another process listening on the same socket name, is reported
//! as not undone, never asked anything.
//!
//! Whether the failed operation of the process where it failed changed anything is what its
//! error reply says it changed (`changed`): the program may allocate, free, pause or resume in
//! the tag meanwhile, so the tag's state cannot tell. Only where the reply does not say (a
//! server that predates it, or an operation still running at `--timeout`, which never replied)
//! is it judged from the state: the tag's active bytes against those before, or whether
//! anything of it is active where a resume of a wholly paused tag failed.
//!
//! The pause records its chunk states in the job's own record (servers with
//! [`FEATURE_JOB_RECORD`]), so the one the program saved with `pause(save_chunk_state=True)`
//! is left alone (with older servers it is the program's record).

use serde_json::json;
use std::time::{Duration, Instant};

use tms_proto::{
    shown_tag, Changed, ChunkStatus, Op, OpDone, Reply, Request, FEATURE_JOB_RECORD,
    FEATURE_OPERATIONS,
};
use tms_units::chunk_ranges;

use crate::cli::Select;
use crate::client::Client;
use crate::ctx::Ctx;
use crate::failure::{Code, Failure, Reported, Result};
use crate::find;
use crate::ops::{asked, needs_chunks, run_one, shown_done, status_of};
use crate::output::{self, json_error, op_words, print_json, with_pid};
use crate::progress;
use crate::socket::Socket;
use crate::text::{one_line, printable_lines, quoted};

/// How one process's operation is undone, decided before it acts.
enum Undo {
    /// Resume restoring the state the pause recorded; `before` is the tag's active bytes
    /// before the pause (judging, where its reply does not say, whether a failed pause changed
    /// anything: one that changed nothing is left alone); `unsettled`, the
    /// tags whose memory a failed non-blocking resume had left unrestored, which the pause gives
    /// back (settling that failure) and no undo brings back.
    Restore { before: u64, unsettled: Vec<String> },
    /// Pause the tag again (a resume of a tag wholly paused before); `unsettled` as for
    /// `Restore`: memory left unrestored before is paused too, not brought back to that.
    PauseAgain { unsettled: Vec<String> },
    /// Cannot be undone exactly; why. `before`: the active bytes of the tags asked for, before
    /// (a process whose own operation failed and changed nothing needs no undo: judged from
    /// them where its reply does not say).
    Skip { why: String, before: u64 },
    /// The opposite operation on the chunks asked for whose state changed from these.
    Chunks(Vec<bool>),
}

/// What became of one process.
struct Done {
    /// As its connection had it (with when the process started): the undo reaches that process
    /// or none.
    sock: Socket,
    done: OpDone,
    undo: Undo,
}

fn active_bytes(c: &mut Client, tag: Option<&str>) -> Result<u64> {
    Ok(active_of(&status_of(c)?, tag))
}

/// The active bytes of the tags of `s` that `tag` selects.
fn active_of(s: &tms_proto::Status, tag: Option<&str>) -> u64 {
    selected_tags(s, tag).map(|t| t.bytes_active).sum()
}

fn chunk_states(c: &mut Client, tag: &str) -> Result<Vec<bool>> {
    let s: ChunkStatus = c.ask_for(
        &Request::Chunks {
            tag: tag.to_string(),
        },
        |r| match r {
            Reply::Chunks(s) => Some(s),
            _ => None,
        },
    )?;
    Ok(s.states.bytes().map(|b| b == b'1').collect())
}

/// The request to send (a whole-tag pause records its state) and how it would be undone.
fn prepare(c: &mut Client, req: &Request) -> Result<(Request, Undo)> {
    let Some((which, tag, chunks, _)) = asked(req) else {
        return Err(Failure::new(
            Code::Failed,
            "--atomic takes a pause or a resume",
        ));
    };
    needs_chunks(c)?;
    if chunks.is_some() {
        let tag = tag.as_deref().unwrap_or_default();
        return Ok((req.clone(), Undo::Chunks(chunk_states(c, tag)?)));
    }
    match which {
        Op::Pause => {
            let s = status_of(c)?;
            let before = active_of(&s, tag.as_deref());
            let unsettled = selected_tags(&s, tag.as_deref())
                .filter(|t| unrestored(t))
                .map(|t| quoted(&t.tag))
                .collect();
            Ok((
                Request::Pause {
                    tag,
                    chunks: None,
                    chunk_state: true,
                    job_record: c.hello.has(FEATURE_JOB_RECORD),
                },
                Undo::Restore { before, unsettled },
            ))
        }
        Op::Resume => {
            let s = status_of(c)?;
            let before = active_of(&s, tag.as_deref());
            let names = |f: &dyn Fn(&tms_proto::TagStatus) -> bool| -> Vec<String> {
                selected_tags(&s, tag.as_deref())
                    .filter(|t| f(t))
                    .map(|t| quoted(&t.tag))
                    .collect()
            };
            let partly = names(&takes_something);
            // Memory a non-blocking resume of the process's own is restoring is its to have:
            // a pause would take it from under the program, which waits for it.
            let restoring = names(&|t| t.restoring_allocations > 0);
            let undo = if !restoring.is_empty() {
                Undo::Skip {
                    why: format!(
                        "not undone: {} had memory a non-blocking resume was restoring before \
                         the resume; left as the resume made it",
                        restoring.join(", ")
                    ),
                    before,
                }
            } else if partly.is_empty() {
                let unsettled = names(&unrestored);
                Undo::PauseAgain { unsettled }
            } else {
                Undo::Skip {
                    why: format!(
                        "not undone: {} had active memory before the resume, which a pause \
                         would take too; left resumed",
                        partly.join(", ")
                    ),
                    before,
                }
            };
            Ok((req.clone(), undo))
        }
    }
}

/// The tags of `s` that `tag` selects (every one if `None`): compared as replies show it, since
/// a tag longer than [`tms_proto::MAX_SHOWN_TAG_BYTES`] comes back shortened.
fn selected_tags<'a>(
    s: &'a tms_proto::Status,
    tag: Option<&'a str>,
) -> impl Iterator<Item = &'a tms_proto::TagStatus> {
    let shown = tag.map(shown_tag);
    s.tags
        .iter()
        .filter(move |t| shown.as_ref().is_none_or(|x| *x == t.tag))
}

/// Whether a pause of tag `t` would take anything: active allocations not kept resident (a
/// pause leaves those mapped), or active chunks.
fn takes_something(t: &tms_proto::TagStatus) -> bool {
    t.active_allocations > t.resident_allocations || t.partial_allocations > 0
}

/// Whether tag `t` holds memory a failed non-blocking resume left unrestored (or that failure,
/// unreported): a pause gives that memory back and settles the failure, which no undo brings
/// back.
fn unrestored(t: &tms_proto::TagStatus) -> bool {
    t.bytes_unrestored > 0 || t.failed_restore.is_some()
}

/// Why a process whose `tags` were [`unrestored`] is not as before: `by` paused them.
fn given_back_words(tags: &[String], by: &str) -> String {
    format!(
        "{} had memory a failed non-blocking resume left unrestored, which {by} gave back (that \
         failure settled): now paused, not as before",
        tags.join(", ")
    )
}

/// How the process that failed ended, for its undo.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Here {
    /// Its operation succeeded (another process failed).
    Succeeded,
    /// Its operation failed; what it changed all the same, where its reply said.
    Failed(Option<Changed>),
    /// Its operation was still running at `--timeout`.
    Running,
}

/// Whether the operation that failed on a process changed nothing: what its reply said (`said`),
/// else what `judged` makes of the state now.
fn changed_nothing(said: Option<Changed>, judged: impl FnOnce() -> Result<bool>) -> Result<bool> {
    match said {
        Some(c) => Ok(c.is_nothing()),
        None => judged(),
    }
}

/// Wait until the process of `c` lists no pause or resume of `tag` asked over its socket (the
/// one that outlasted `--timeout`), as long as the process's pauses and resumes move (the
/// phases and bytes of that one and of the one it waits behind, as the wait for its reply
/// counts them): false once nothing moved for `still`.
fn wait_ended(c: &mut Client, which: Op, tag: Option<&str>, still: Duration) -> Result<bool> {
    // As `status` shows it (a long tag shortened): else a running operation is never found.
    let tag = tag.map(shown_tag);
    let mut seen = None;
    let mut since = Instant::now();
    let mut opened = Instant::now();
    loop {
        // Each status gets a wait of its own (a connection's requests share the one set when it
        // was made), and the connection is replaced before the server's 10 s for requests run
        // out: the wait lasts as long as the operation moves.
        if opened.elapsed() > Duration::from_secs(5) {
            *c = Client::connect(&c.socket().clone(), still).map_err(not_undone)?;
            opened = Instant::now();
        }
        c.rearm(still);
        let s = status_of(c)?;
        if !s
            .operations
            .iter()
            .any(|r| r.op == which && !r.in_process && r.tag == tag)
        {
            return Ok(true);
        }
        // Waiting behind another operation, it does not move itself: that one's moves count.
        let now = Some(progress::seen(&s.operations));
        if now != seen {
            (seen, since) = (now, Instant::now());
        } else if since.elapsed() >= still {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A process to undo on: its socket (with when it started, where it was reached), its result
/// (where it succeeded), how to undo it, and how its own operation ended.
type UndoRow<'a> = (&'a Socket, Option<&'a OpDone>, &'a Undo, Here);

/// A failure to reach the process to undo on, as the undo reports it.
fn not_undone(f: Failure) -> Failure {
    Failure {
        message: format!("{}: not undone", f.message),
        ..f
    }
}

/// What an undo did on one process.
enum Undid {
    /// It ran: its result.
    Ran(OpDone),
    /// Nothing had changed there: nothing to undo.
    Nothing,
    /// Changed, and not undone: why.
    Kept(String),
}

/// Undo on the process of `sock` (never on another process given its pid since: see
/// [`Client::connect`]).
fn undo(
    ctx: &Ctx,
    show: progress::Show,
    sock: &Socket,
    req: &Request,
    how: &Undo,
    here: Here,
) -> Result<Undid> {
    let Some((which, tag, asked_chunks, _)) = asked(req) else {
        return Err(Failure::new(
            Code::Failed,
            "--atomic takes a pause or a resume",
        ));
    };
    let mut c = Client::connect(sock, ctx.timeout).map_err(not_undone)?;
    if here == Here::Running && !c.hello.has(FEATURE_OPERATIONS) {
        // Its status never lists a running operation: when it ends cannot be seen.
        return Err(Failure::new(
            Code::Running,
            format!(
                "{} may still be running, and its library ({}) predates listing running \
                 operations: not undone (`tmsctl status --pid {}` shows where it ended)",
                op_words(which, tag.as_deref(), None),
                crate::text::printable(&c.hello.software),
                sock.pid()
            ),
        ));
    }
    if here == Here::Running && !wait_ended(&mut c, which, tag.as_deref(), ctx.timeout)? {
        return Err(Failure::new(
            Code::Running,
            format!(
                "{} was still running, nothing moving for {:.1} s more; it goes on in the \
                 process, not undone (`tmsctl status --pid {}` shows it; undo it once it ends)",
                op_words(which, tag.as_deref(), None),
                ctx.timeout.as_secs_f64(),
                sock.pid()
            ),
        ));
    }
    c.rearm(ctx.timeout);
    // Now ended: what it changed is what is undone.
    let failed_here = here != Here::Succeeded;
    let said = match here {
        Here::Failed(said) => said,
        Here::Succeeded | Here::Running => None,
    };
    let back = match how {
        // A resume that failed undid itself in the process, unless it took memory back.
        Undo::Skip { before, .. }
            if failed_here
                && changed_nothing(said, || {
                    Ok(active_bytes(&mut c, tag.as_deref())? == *before)
                })? =>
        {
            return Ok(Undid::Nothing)
        }
        Undo::Skip { why, .. } => return Ok(Undid::Kept(why.clone())),
        Undo::Restore { before, unsettled } => {
            if failed_here {
                let s = status_of(&mut c)?;
                if changed_nothing(said, || Ok(active_of(&s, tag.as_deref()) == *before))? {
                    return Ok(nothing_or_given_back(&s, which, tag.as_deref(), unsettled));
                }
            }
            Request::Resume {
                tag,
                chunks: None,
                chunk_state: true,
                job_record: c.hello.has(FEATURE_JOB_RECORD),
                no_wait: false,
                verify: false,
            }
        }
        // A resume that fails undoes itself in the process (all or nothing), but one that did
        // its work and then reported an earlier failure (a non-blocking restore's) took memory
        // back, as may one that outlasted --timeout: what took memory back is paused again.
        Undo::PauseAgain { unsettled } if failed_here => {
            let s = status_of(&mut c)?;
            let took_nothing = changed_nothing(said, || {
                Ok(!selected_tags(&s, tag.as_deref()).any(takes_something))
            })?;
            if took_nothing {
                return Ok(nothing_or_given_back(&s, which, tag.as_deref(), unsettled));
            }
            Request::Pause {
                tag,
                chunks: None,
                chunk_state: false,
                job_record: false,
            }
        }
        Undo::PauseAgain { .. } => Request::Pause {
            tag,
            chunks: None,
            chunk_state: false,
            job_record: false,
        },
        // Which chunks moved is read from their states, but whether the failed operation moved
        // any is its reply's to say: the program may have moved those it asked for meanwhile.
        Undo::Chunks(_) if said.is_some_and(|c| c.is_nothing()) => return Ok(Undid::Nothing),
        Undo::Chunks(before) => {
            let name = tag.clone().unwrap_or_default();
            let now = chunk_states(&mut c, &name)?;
            // Only what the operation can have moved: a chunk it was asked for, gone the way
            // it goes. Another change (the program's own, meanwhile) is not the job's to undo.
            let was_asked = |i: usize| {
                let i = i as u64;
                asked_chunks
                    .as_deref()
                    .unwrap_or_default()
                    .iter()
                    .any(|&[a, b]| (a..=b).contains(&i))
            };
            let changed: Vec<usize> = before
                .iter()
                .zip(&now)
                .enumerate()
                .filter(|&(i, (&b, &n))| b == (which == Op::Pause) && n != b && was_asked(i))
                .map(|(i, _)| i)
                .collect();
            if changed.is_empty() {
                return Ok(Undid::Nothing);
            }
            let chunks = Some(chunk_ranges(&changed));
            match which {
                Op::Pause => Request::Resume {
                    tag,
                    chunks,
                    chunk_state: false,
                    job_record: false,
                    no_wait: false,
                    verify: false,
                },
                Op::Resume => Request::Pause {
                    tag,
                    chunks,
                    chunk_state: false,
                    job_record: false,
                },
            }
        }
    };
    run_one(ctx, true, show, &mut c, &back).map(Undid::Ran)
}

/// For a process whose own operation failed and took nothing back (`s`: its status now, the
/// one that decision read): nothing had changed, unless memory a failed non-blocking resume had
/// left unrestored (`unsettled`, before) was given back by that operation on its way out, which
/// is now paused and not as before.
fn nothing_or_given_back(
    s: &tms_proto::Status,
    which: Op,
    tag: Option<&str>,
    unsettled: &[String],
) -> Undid {
    let given_back: Vec<String> = selected_tags(s, tag)
        .filter(|t| !unrestored(t))
        .map(|t| quoted(&t.tag))
        .filter(|q| unsettled.contains(q))
        .collect();
    if given_back.is_empty() {
        return Undid::Nothing;
    }
    let by = format!("the failed {}", output::verb(which));
    Undid::Kept(format!(
        "{}; nothing else had changed",
        given_back_words(&given_back, &by)
    ))
}

/// The undo's result line without its "pid P: " (the line it goes on has it).
fn undone_words(pid: u32, u: &OpDone) -> String {
    let line = output::done(pid, u, false);
    let prefix = format!("pid {pid}: ");
    line.strip_prefix(&prefix)
        .map_or(line.clone(), str::to_string)
}

/// `tmsctl pause|resume --atomic`: `req` on every selected process, or, undone, on none.
pub fn run(ctx: &Ctx, sel: &Select, req: &Request, show: progress::Show) -> anyhow::Result<()> {
    let (which, tag, chunks, _) =
        asked(req).ok_or_else(|| anyhow::anyhow!("--atomic takes a pause or a resume"))?;
    let what = op_words(which, tag.as_deref(), chunks.as_ref());
    let mut targets = find::targets(ctx, sel)?;
    // A process that cannot be reached fails the job before any is asked: it comes first.
    targets.sort_by_key(|t| t.unusable.is_none());
    // Ctrl-C from here on fails the operation under way: what was done is undone, and said.
    crate::interrupt::catch();
    let mut done: Vec<Done> = Vec::new();
    let mut failure: Option<(Socket, Failure, Option<Undo>)> = None;
    let mut not_asked: Vec<u32> = Vec::new();
    for t in targets {
        let mut sock = t.sock;
        if failure.is_some() {
            not_asked.push(sock.pid());
            continue;
        }
        if let Some(f) = t.unusable {
            failure = Some((sock, f, None));
            continue;
        }
        // A Ctrl-C while a quick reply came (a read that never waited long enough to look):
        // the job stops here all the same, nothing sent to this process.
        if crate::interrupt::taken() {
            let f = Failure::new(
                Code::Running,
                format!(
                    "process {}: interrupted (Ctrl-C) before it was asked: nothing was sent to it",
                    sock.pid()
                ),
            );
            failure = Some((sock, f, None));
            continue;
        }
        let mut prepared = None;
        let r = Client::connect(&sock, ctx.timeout).and_then(|mut c| {
            // With when its process started: an undo reaches that process or none.
            sock = c.socket().clone();
            let (send, how) = prepare(&mut c, req)?;
            prepared = Some(how);
            run_one(ctx, true, show, &mut c, &send)
        });
        match r {
            Ok(d) => match prepared {
                Some(undo) => done.push(Done {
                    sock,
                    done: d,
                    undo,
                }),
                None => {
                    let f = Failure::new(Code::Failed, "acted without a plan to undo");
                    failure = Some((sock, f, None));
                }
            },
            Err(f) => {
                failure = Some((sock, f, prepared));
            }
        }
    }
    // A Ctrl-C while the last process's quick reply came: the job fails there all the same, and
    // what it did is undone with the rest.
    if let (None, Some(last), true) = (&failure, done.last(), crate::interrupt::taken()) {
        let f = Failure::new(
            Code::Running,
            format!(
                "process {}: interrupted (Ctrl-C) as it answered: what it did is undone",
                last.sock.pid()
            ),
        );
        failure = Some((last.sock.clone(), f, None));
    }
    let Some((failed_sock, f, failed_undo)) = failure else {
        // Every process did it: printed as without --atomic (a process that never had the tag
        // told on stderr, exit code 6); the JSON keeps the shape of a failure's (nothing
        // failed, nothing undone).
        let tag = asked(req).and_then(|a| a.1);
        let mut unknown_tag = false;
        let mut items = Vec::new();
        for d in &done {
            let pid = d.sock.pid();
            let (json, text) = shown_done(sel, pid, &d.done, false);
            if d.done.unknown_tag {
                unknown_tag = true;
                tell!(
                    "tmsctl: {}",
                    one_line(&output::unknown_tag(pid, &d.done, tag.as_deref()))
                );
            }
            if ctx.json {
                items.push(json!({"pid": pid, "done": json, "undo": null}));
            } else if !d.done.unknown_tag {
                say!("{}", printable_lines(&text));
            }
        }
        if ctx.json {
            print_json(json!({
                "atomic": true,
                "ok": true,
                "failed": null,
                "processes": items,
                "not_asked": [],
                "every_process_as_before": null,
            }));
        }
        return match unknown_tag {
            true => Err(Reported(Code::UnknownTag).into()),
            false => Ok(()),
        };
    };
    tell!("tmsctl: {}", one_line(&f.message));
    // Undo, the process that failed included where it changed.
    let mut items = Vec::new();
    let mut undone = Vec::new();
    let mut kept: Vec<String> = Vec::new();
    let mut undo_rows: Vec<UndoRow> = done
        .iter()
        .map(|d| (&d.sock, Some(&d.done), &d.undo, Here::Succeeded))
        .collect();
    if let Some(u) = &failed_undo {
        let here = if f.code == Code::Running {
            Here::Running
        } else {
            Here::Failed(f.changed)
        };
        undo_rows.push((&failed_sock, None, u, here));
    }
    for (sock, d, how, here) in undo_rows {
        let pid = sock.pid();
        let result = undo(ctx, show, sock, req, how, here);
        let (undo_json, line) = match (&result, how) {
            (Ok(Undid::Ran(u)), how) => {
                if let Undo::Restore { unsettled, .. } | Undo::PauseAgain { unsettled } = how {
                    if !unsettled.is_empty() {
                        let why = given_back_words(unsettled, "the call or its undo");
                        kept.push(format!("process {pid}: {why}"));
                    }
                }
                undone.push(pid);
                (
                    with_pid(pid, u),
                    format!("undone: {}", undone_words(pid, u)),
                )
            }
            (Ok(Undid::Kept(why)), _) => {
                kept.push(format!("process {pid}: {why}"));
                (json!({"skipped": why}), why.clone())
            }
            (Ok(Undid::Nothing), _) => (
                json!({"skipped": "nothing had changed"}),
                "nothing to undo (nothing had changed)".to_string(),
            ),
            (Err(e), _) => {
                kept.push(format!("process {pid}: the undo failed: {}", e.message));
                (
                    json_error(e.code, &e.message, Some(pid)),
                    format!("the undo failed: {}", e.message),
                )
            }
        };
        // Named by its command line where no --pid named it, as when every process did it.
        let shown = d.map(|d| shown_done(sel, pid, d, false));
        if ctx.json {
            let mut item = json!({"pid": pid, "undo": undo_json});
            if let Some((json, _)) = shown {
                item["done"] = json;
            } else {
                item["failed"] = json_error(f.code, &f.message, Some(pid));
            }
            items.push(item);
        } else {
            if let Some((_, text)) = shown {
                say!("{}", printable_lines(&text));
            }
            say!("{}", printable_lines(&format!("pid {pid}: {line}")));
        }
    }
    // The process that failed before it was asked anything that changes it (unreachable, its
    // status unreadable) has no undo to run, and is one of the processes all the same.
    let failed_pid = failed_sock.pid();
    if ctx.json && failed_undo.is_none() && !done.iter().any(|d| d.sock.pid() == failed_pid) {
        items.push(json!({
            "pid": failed_pid,
            "failed": json_error(f.code, &f.message, Some(failed_pid)),
            "undo": {"skipped": "nothing had changed"},
        }));
    }
    let mut summary = format!("--atomic: {what} failed on process {failed_pid}");
    if !not_asked.is_empty() {
        let p: Vec<String> = not_asked.iter().map(u32::to_string).collect();
        summary.push_str(&format!("; not asked: {}", p.join(", ")));
    }
    if kept.is_empty() {
        summary.push_str(&format!(
            "; undone on {} process{}: every process is as before",
            undone.len(),
            if undone.len() == 1 { "" } else { "es" }
        ));
    } else {
        summary.push_str(&format!(
            "; NOT every process is as before: {}",
            kept.join("; ")
        ));
    }
    tell!("tmsctl: {}", one_line(&summary));
    if ctx.json {
        print_json(json!({
            "atomic": true,
            "ok": false,
            "failed": json_error(f.code, &f.message, Some(failed_sock.pid())),
            "processes": items,
            "not_asked": not_asked,
            "every_process_as_before": kept.is_empty(),
        }));
    }
    Err(Reported(f.code).into())
}
