//! The operations on one process at a time: status, pause, resume, chunks, region, ping, each
//! sent to the processes the command selects in turn ([`fan_out`]), and the pieces `--atomic`
//! builds on: one pause or resume sent and waited for ([`run_one`]).

use std::time::Instant;

use serde_json::{json, Value};
use tms_proto::{
    ChunkRanges, ChunkStatus, Op, OpDone, RegionInfo, RegionUpdate, Reply, Request, Status,
    FEATURE_CHUNKS, FEATURE_NO_WAIT, FEATURE_PROGRESS, FEATURE_VERIFY,
};
use tms_units::format_ranges;

use crate::cli::Select;
use crate::client::Client;
use crate::ctx::Ctx;
use crate::failure::{Code, Failure, Reported, Result};
use crate::find;
use crate::output::{self, json_error, op_words, print_json, with_pid};
use crate::procfs::{command_line, short_command};
use crate::progress;
use crate::status_view;
use crate::text::{one_line, printable, printable_lines, quoted};

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

/// Run `f` against each selected process; print what each answered; report failures on
/// stderr, one line each, and with --json in the document too (the one of the process, or
/// its item in the array of --all). The exit code is the first failure's, else
/// [`Code::UnknownTag`] if a process did not know the tag, else success.
fn fan_out(
    ctx: &Ctx,
    sel: &Select,
    f: impl Fn(&mut Client) -> Result<Outcome>,
) -> anyhow::Result<()> {
    let targets = find::targets(ctx, sel)?;
    let many = sel.all;
    let mut items = Vec::new();
    let mut first: Option<Code> = None;
    let mut unknown_tag = false;
    for t in targets {
        let sock = t.sock;
        let r = match t.unusable {
            Some(why) => Err(why),
            None => Client::connect(&sock, ctx.timeout).and_then(|mut c| f(&mut c)),
        };
        match r {
            Ok(o) => {
                if ctx.json {
                    if many {
                        items.push(o.json);
                    } else {
                        print_json(o.json);
                    }
                } else if o.unknown_tag.is_none() {
                    let text = printable_lines(o.text.trim_end_matches('\n'));
                    say!("{text}");
                }
                if let Some(why) = &o.unknown_tag {
                    tell!("tmsctl: {}", one_line(why));
                    unknown_tag = true;
                }
            }
            Err(e) => {
                tell!("tmsctl: {}", one_line(&e.message));
                let j = json_error(e.code, &e.message, Some(sock.pid()));
                if many {
                    items.push(j);
                } else if ctx.json {
                    print_json(j);
                }
                first.get_or_insert(e.code);
            }
        }
    }
    if ctx.json && many {
        print_json(Value::Array(items));
    }
    match (first, unknown_tag) {
        (Some(c), _) => Err(Reported(c).into()),
        (None, true) => Err(Reported(Code::UnknownTag).into()),
        (None, false) => Ok(()),
    }
}

/// A process's status.
pub fn status_of(c: &mut Client) -> Result<Status> {
    c.ask_for(&Request::Status, |r| match r {
        Reply::Status(s) => Some(*s),
        _ => None,
    })
}

/// Refuse, before asking, what a process whose library predates chunks cannot do.
pub fn needs_chunks(c: &Client) -> Result<()> {
    if c.hello.has(FEATURE_CHUNKS) {
        return Ok(());
    }
    Err(Failure::new(
        Code::Failed,
        format!(
            "process {}: its library ({}) predates chunked allocations: it cannot pause, \
             resume or list chunks (use the whole tag, or a newer libtms.so)",
            c.pid(),
            printable(&c.hello.software)
        ),
    ))
}

/// Which operation a pause or resume request asks for, of what.
pub fn asked(req: &Request) -> Option<(Op, Option<String>, Option<ChunkRanges>, bool)> {
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

/// Send one pause or resume to `c` and wait for its result, watching its progress where the
/// process reports it (shown as `show` says; the wait lasts as long as the operation moves).
pub fn run_one(
    ctx: &Ctx,
    with_pid: bool,
    show: progress::Show,
    c: &mut Client,
    req: &Request,
) -> Result<OpDone> {
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
                printable(&c.hello.software)
            ),
        ));
    }
    if matches!(req, Request::Resume { verify: true, .. }) && !c.hello.has(FEATURE_VERIFY) {
        return Err(Failure::new(
            Code::Failed,
            format!(
                "process {}: its library ({}) predates resume --verify (resume without it, or \
                 use a newer libtms.so)",
                c.pid(),
                printable(&c.hello.software)
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
                    printable(&format!("{r:?}"))
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
                printable(&format!(
                    "op {:?}, tag {:?}, chunks {:?}",
                    d.op, d.tag, d.chunks
                ))
            ),
        ));
    }
    Ok(d)
}

/// A pause or resume (`req`) of each selected process on its own.
pub fn op(ctx: &Ctx, sel: &Select, req: Request, show: progress::Show) -> anyhow::Result<()> {
    let Some((_, asked, _, chunk_state)) = asked(&req) else {
        return Err(anyhow::anyhow!("op() takes a pause or a resume"));
    };
    fan_out(ctx, sel, |c| {
        let d = run_one(ctx, sel.all, show, c, &req)?;
        let (json, text) = shown_done(sel, c.pid(), &d, chunk_state);
        Ok(Outcome {
            json,
            text,
            unknown_tag: d
                .unknown_tag
                .then(|| output::unknown_tag(c.pid(), &d, asked.as_deref())),
        })
    })
}

/// Process `pid`'s pause or resume result `d`, as JSON and as its line (`pid P: paused ...`),
/// naming the process by its command line too where no --pid named it.
pub fn shown_done(sel: &Select, pid: u32, d: &OpDone, chunk_state: bool) -> (Value, String) {
    let (json, text) = (with_pid(pid, d), output::done(pid, d, chunk_state));
    match sel.pid {
        None => name_target(pid, json, &text),
        Some(_) => (json, text),
    }
}

/// A pause's or resume's result (`pid P: paused ...`) naming the process by its command line
/// too: `pid P (python serve.py): paused ...`, and `"command"` in JSON.
fn name_target(pid: u32, mut json: Value, text: &str) -> (Value, String) {
    json["command"] = json!(command_line(pid));
    let prefix = format!("pid {pid}:");
    let text = match text.strip_prefix(&prefix) {
        Some(rest) => format!("pid {pid} ({}):{rest}", short_command(pid)),
        None => text.to_string(),
    };
    (json, text)
}

/// `tmsctl chunks`: the chunks of `tag`'s chunked allocation, checked before they are shown.
pub fn chunks(ctx: &Ctx, sel: &Select, tag: String) -> anyhow::Result<()> {
    let req = Request::Chunks { tag: tag.clone() };
    fan_out(ctx, sel, |c| {
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
                    quoted(&tag),
                    printable(&format!(
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

/// `tmsctl region`: the default region, after `update` if there is one.
pub fn region(ctx: &Ctx, sel: &Select, update: Option<RegionUpdate>) -> anyhow::Result<()> {
    let req = match update {
        Some(u) => Request::SetRegion(u),
        None => Request::GetRegion,
    };
    fan_out(ctx, sel, |c| {
        let r: RegionInfo = c.ask_for(&req, |r| match r {
            Reply::Region(r) => Some(r),
            _ => None,
        })?;
        Ok(Outcome::new(
            with_pid(c.pid(), &r),
            format!(
                "pid {}: default region: {}",
                c.pid(),
                status_view::region(&r)
            ),
        ))
    })
}

/// `tmsctl status`.
pub fn status(ctx: &Ctx, sel: &Select) -> anyhow::Result<()> {
    fan_out(ctx, sel, |c| {
        let s = status_of(c)?;
        Ok(Outcome::new(
            serde_json::to_value(&s).unwrap_or(Value::Null),
            status_view::status(&s, &command_line(c.pid())),
        ))
    })
}

/// `tmsctl ping`.
pub fn ping(ctx: &Ctx, sel: &Select) -> anyhow::Result<()> {
    fan_out(ctx, sel, |c| {
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
    })
}
