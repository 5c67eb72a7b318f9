//! Progress of a pause or resume while tmsctl waits for its reply.
//!
//! The request's connection carries one reply per request, the final one, so a second
//! connection polls the process's `status` (servers with [`tms_proto::FEATURE_PROGRESS`]), twice
//! a second once the wait has lasted half a second (a quick pause costs the process nothing).
//! What it sees serves two ends:
//!
//! - the timeout rule of pause and resume: the wait goes on while the process's pauses and
//!   resumes move (bytes copied, a phase changed, one ended or started: the one asked for, or
//!   the one it waits behind), and ends once `--timeout` has passed with nothing moving
//!   ([`Watch::last_moved`], which [`Client::ask_while`] reads). A pause of
//!   hundreds of GiB to disk thus takes as long as it takes, while a stuck one (a device that
//!   never finishes its queued work) is still reported after `--timeout`;
//! - a progress line on stderr ([`Show`]): on a terminal one line rewritten in place, else
//!   (when asked for) a line about every second.
//!
//! The server closes a connection after 10 s of waiting for requests in all, so the poller
//! opens a new one every few seconds. The poller's thread is never waited for: a status that
//! takes long (a process under load) must not delay the result; nothing is printed once
//! [`Watch::finish`] has run, since printing and finishing take the same lock.

use std::collections::VecDeque;
use std::io::{IsTerminal, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tms_proto::{shown_tag, ChunkRanges, Op, Phase, Reply, Request, Running};

use crate::client::Client;
use crate::output::{state, verb, what};
use crate::socket::Socket;

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Show {
    /// Not at all (it is still watched, for the timeout rule).
    Off,
    /// One line on stderr, rewritten in place (a terminal).
    Line,
    /// A line on stderr about every second (asked for with `--progress`, not a terminal).
    Lines,
}

impl Show {
    /// `--progress` (`on`) and `--no-progress` (`off`): by default, on a terminal only.
    pub fn pick(on: bool, off: bool) -> Show {
        let tty = std::io::stderr().is_terminal();
        match (on, off, tty) {
            (_, true, _) | (false, false, false) => Show::Off,
            (_, false, true) => Show::Line,
            (true, false, false) => Show::Lines,
        }
    }
}

/// The wait before the first poll, and between polls.
const POLL: Duration = Duration::from_millis(500);
/// Between two lines, without a terminal.
const LINES_EVERY: Duration = Duration::from_millis(1000);
/// A polling connection is replaced after this long (the server closes one that has waited
/// 10 s for requests in all).
const CONNECTION_AGE: Duration = Duration::from_secs(6);
/// The longest a poll waits for its status.
const POLL_TIMEOUT: Duration = Duration::from_secs(5);
/// The span of the rate shown (the recent rate, not the average since the start).
const RATE_WINDOW: Duration = Duration::from_secs(5);

/// The operation watched, as the process lists it.
#[derive(Clone, Debug)]
pub struct Asked {
    /// The process.
    pub pid: u32,
    /// Its lines start with the pid (several processes are acted on in turn).
    pub with_pid: bool,
    /// Pause or resume.
    pub op: Op,
    /// Its tag (every tag if `None`).
    pub tag: Option<String>,
    /// Its chunks, if it names some.
    pub chunks: Option<ChunkRanges>,
}

struct State {
    stopped: bool,
    moved: Instant,
    /// A line is on the terminal (to be taken off at the end).
    shown: bool,
    last_line: Option<Instant>,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    show: Show,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sleep `d`, or until stopped; true once stopped.
    fn sleep(&self, d: Duration) -> bool {
        let g = self.state();
        let (g, _) = self
            .wake
            .wait_timeout_while(g, d, |s| !s.stopped)
            .unwrap_or_else(|p| p.into_inner());
        g.stopped
    }

    /// Show `line`, unless the watch has finished.
    fn print(&self, line: &str) {
        let mut g = self.state();
        if g.stopped || self.show == Show::Off {
            return;
        }
        let mut err = std::io::stderr().lock();
        match self.show {
            Show::Line => {
                let _ = write!(err, "\r{}\x1b[K", fit(line, width()));
                g.shown = true;
            }
            Show::Lines => {
                let now = Instant::now();
                if g.last_line
                    .is_some_and(|t| now - t < LINES_EVERY - POLL / 2)
                {
                    return;
                }
                g.last_line = Some(now);
                let _ = writeln!(err, "{line}");
            }
            Show::Off => {}
        }
        let _ = err.flush();
    }
}

/// A running watch of one pause or resume.
pub struct Watch {
    shared: Arc<Shared>,
}

impl Watch {
    /// Start watching `asked` on the process of `sock` (a server with progress reports), a
    /// connection's [`Client::socket`]: another process given its pid since is not watched.
    pub fn start(sock: &Socket, timeout: Duration, asked: Asked, show: Show) -> Watch {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                stopped: false,
                moved: Instant::now(),
                shown: false,
                last_line: None,
            }),
            wake: Condvar::new(),
            show,
        });
        let sh = shared.clone();
        let sock = sock.clone();
        // Without a thread there is no progress, and the wait is as without a server that
        // reports it.
        let _ = std::thread::Builder::new()
            .name("tmsctl-progress".into())
            .spawn(move || poll(&sh, &sock, timeout, &asked));
        Watch { shared }
    }

    /// When the process's pauses and resumes last moved (the start of the watch, before
    /// anything was seen).
    pub fn last_moved(&self) -> Instant {
        self.shared.state().moved
    }

    /// Stop watching, and take the progress line off the terminal.
    pub fn finish(self) {
        drop(self);
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut g = self.shared.state();
        g.stopped = true;
        if g.shown {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
            g.shown = false;
        }
        self.shared.wake.notify_all();
    }
}

/// What a status says about the process's pauses and resumes that move: their kinds, phases
/// and bytes. A change between two polls is progress.
pub type Seen = Vec<(Op, Option<Phase>, Option<u64>, bool)>;

/// The [`Seen`] of the operations a status lists: the one asked for and the one it waits
/// behind alike, so that a wait lasts while either moves.
pub fn seen(ops: &[Running]) -> Seen {
    ops.iter()
        .filter(|r| r.phase.is_some())
        .map(|r| (r.op, r.phase, r.bytes_done, r.in_process))
        .collect()
}

fn poll(sh: &Shared, sock: &Socket, timeout: Duration, asked: &Asked) {
    let mut conn: Option<(Client, Instant)> = None;
    let mut failures = 0;
    let mut prev: Option<Seen> = None;
    let mut rate = Rate::default();
    while !sh.sleep(POLL) {
        let t = timeout.min(POLL_TIMEOUT);
        if conn
            .as_ref()
            .is_some_and(|(_, at)| at.elapsed() > CONNECTION_AGE)
        {
            conn = None;
        }
        if conn.is_none() {
            conn = Client::connect(sock, t).ok().map(|c| (c, Instant::now()));
        }
        let status = conn.as_mut().and_then(|(c, _)| {
            c.rearm(t);
            match c.ask(&Request::Status) {
                Ok(Reply::Status(s)) => Some(s),
                _ => None,
            }
        });
        let Some(s) = status else {
            conn = None;
            failures += 1;
            if failures >= 3 {
                // The process is gone or will not answer: the reply's wait says why.
                return;
            }
            continue;
        };
        failures = 0;
        let now = Instant::now();
        let seen = seen(&s.operations);
        let moved = match &prev {
            Some(p) => *p != seen,
            None => seen.iter().any(|o| o.2.is_some_and(|b| b > 0)),
        };
        if moved {
            sh.state().moved = now;
        }
        prev = Some(seen);
        if let Some(r) = mine(&s.operations, asked) {
            if let Some(b) = r.bytes_done {
                rate.add(now, b);
            }
            sh.print(&line(asked, r, rate.per_s().or(r.gib_per_s.map(gib))));
        }
    }
}

fn gib(g: f64) -> f64 {
    g * (1u64 << 30) as f64
}

/// The entry of `ops` that is the operation asked for: of its kind, tag (as replies show it: a
/// long one shortened) and chunks, and asked over the socket; the one running where there are
/// several.
fn mine<'a>(ops: &'a [Running], a: &Asked) -> Option<&'a Running> {
    let tag = a.tag.as_deref().map(shown_tag);
    let same = |r: &&Running| !r.in_process && r.op == a.op && r.tag == tag && r.chunks == a.chunks;
    ops.iter()
        .filter(same)
        .find(|r| r.bytes_done.is_some())
        .or_else(|| ops.iter().find(same))
}

/// Bytes per second over the last few seconds of samples.
#[derive(Default)]
struct Rate {
    samples: VecDeque<(Instant, u64)>,
}

impl Rate {
    fn add(&mut self, t: Instant, done: u64) {
        if self.samples.back().is_some_and(|s| done < s.1) {
            // Another operation's bytes (ours had not started): start over.
            self.samples.clear();
        }
        self.samples.push_back((t, done));
        while self.samples.front().is_some_and(|s| t - s.0 > RATE_WINDOW) {
            self.samples.pop_front();
        }
    }

    fn per_s(&self) -> Option<f64> {
        let (a, b) = (self.samples.front()?, self.samples.back()?);
        let span = (b.0 - a.0).as_secs_f64();
        (span >= 0.9 && b.1 > a.1).then(|| (b.1 - a.1) as f64 / span)
    }
}

/// The progress line of `r`, the operation `a` asked for.
fn line(a: &Asked, r: &Running, rate: Option<f64>) -> String {
    format!(
        "{}{} of {}: {}",
        if a.with_pid {
            format!("pid {}: ", a.pid)
        } else {
            String::new()
        },
        verb(a.op),
        what(a.tag.as_deref(), a.chunks.as_ref()),
        state(r, rate)
    )
}

/// The terminal's width (`$COLUMNS`, else 80).
fn width() -> usize {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse::<usize>().ok())
        .filter(|w| *w >= 20)
        .unwrap_or(80)
}

/// `s` cut to fit a line of `width` columns (one left free, so the cursor never wraps).
fn fit(s: &str, width: usize) -> String {
    let max = width.saturating_sub(1);
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut t: String = s.chars().take(max.saturating_sub(1)).collect();
    t.push('\u{2026}');
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use tms_proto::Backing;

    fn running(op: Op, phase: Phase, done: u64, total: u64, backing: Backing) -> Running {
        Running {
            phase: Some(phase),
            bytes_done: Some(done),
            bytes_total: Some(total),
            backing: Some(backing),
            ..Running::new(op, Some("kv".into()), None, 7.0)
        }
    }

    #[test]
    fn progress_in_words() {
        const G: u64 = 1 << 30;
        let mut a = Asked {
            pid: 7,
            with_pid: false,
            op: Op::Pause,
            tag: Some("kv".into()),
            chunks: None,
        };
        let r = running(
            Op::Pause,
            Phase::WritingToDisk,
            12 * G,
            64 * G,
            Backing::Disk,
        );
        let l = line(&a, &r, Some(1.6 * G as f64));
        assert_eq!(
            l,
            "pause of tag \"kv\": 12.0 of 64.0 GiB written to disk, 1.6 GiB/s, about 33 s left"
        );
        assert!(l.chars().count() < 80, "fits a terminal");
        a.with_pid = true;
        assert!(line(&a, &r, None).starts_with("pid 7: pause of tag \"kv\": 12.0 of 64.0 GiB"));
        let r = running(Op::Pause, Phase::CopyingToHost, G / 2, 4 * G, Backing::Host);
        assert_eq!(
            state(&r, None),
            "512.0 MiB of 4.0 GiB copied to host memory"
        );
        let r = running(Op::Resume, Phase::ReadingFromDisk, G, 4 * G, Backing::Disk);
        assert!(state(&r, Some(G as f64)).starts_with("1.0 of 4.0 GiB read from disk, 1.0 GiB/s"));
        let r = running(Op::Resume, Phase::CopyingToDevice, 0, G, Backing::Host);
        assert!(state(&r, None).ends_with("0 B of 1.0 GiB copied from host memory"));
        let r = running(Op::Pause, Phase::Releasing, G, G, Backing::Disk);
        assert_eq!(
            state(&r, None),
            "1.0 GiB written to disk; giving memory back"
        );
        let w = Running {
            phase: Some(Phase::Waiting),
            ..Running::new(Op::Resume, None, None, 3.0)
        };
        assert_eq!(
            state(&w, None),
            "waiting for another pause or resume to end (3 s)"
        );
        assert_eq!(fit("abcdef", 5), "abc\u{2026}");
        assert_eq!(fit("abc", 5), "abc");
    }

    #[test]
    fn the_operation_asked_for_is_told_from_others() {
        let a = Asked {
            pid: 7,
            with_pid: false,
            op: Op::Pause,
            tag: Some("kv".into()),
            chunks: None,
        };
        let waiting = Running {
            phase: Some(Phase::Waiting),
            ..Running::new(Op::Pause, Some("kv".into()), None, 1.0)
        };
        let other = running(Op::Pause, Phase::CopyingToHost, 1, 2, Backing::Host);
        let api = Running {
            in_process: true,
            ..other.clone()
        };
        let ops = vec![api.clone(), waiting.clone(), other.clone()];
        assert_eq!(mine(&ops, &a), Some(&other), "the running one");
        assert_eq!(mine(&[api.clone(), waiting.clone()], &a), Some(&waiting));
        assert_eq!(mine(&[api], &a), None, "not one asked over the socket");
    }

    #[test]
    fn the_rate_is_that_of_the_last_seconds() {
        let t = Instant::now();
        let mut r = Rate::default();
        r.add(t, 0);
        assert_eq!(r.per_s(), None);
        r.add(t + Duration::from_secs(1), 100);
        assert_eq!(r.per_s(), Some(100.0));
        r.add(t + Duration::from_secs(10), 2100);
        r.add(t + Duration::from_secs(11), 2300);
        assert_eq!(r.per_s(), Some(200.0), "the old samples are gone");
    }
}
