//! Which processes a command acts on, and where their control sockets are.
//!
//! tmsctl's own socket folder comes first: `--socket-dir`, else its `$TMS_SOCKET_DIR`, else its
//! `$XDG_RUNTIME_DIR/tms` (if `$XDG_RUNTIME_DIR` is a folder of the user's), else `/tmp/tms-<uid>`
//! ([`Origin`](crate::ctx::Origin)). A process computes its folder the same way from its own
//! environment, so one started with another `XDG_RUNTIME_DIR` (by a service manager, in a
//! container, through sudo) listens elsewhere. So:
//!
//! - `--pid P`: P's socket in tmsctl's folder, else where `/proc` shows P listening, else in the
//!   folder P's environment gives. A file of P's pid in tmsctl's folder while `/proc` shows P
//!   listening elsewhere (and not there) was left by an earlier process of that pid: the socket
//!   `/proc` shows is taken, with `--pid` or without. Only P of tmsctl's own user: another
//!   user's is refused.
//! - Without `--pid`, while tmsctl's folder comes from the defaults (neither `--socket-dir` nor
//!   `TMS_SOCKET_DIR`), the processes of tmsctl's user that `/proc` shows listening in other
//!   folders count too: a plain command never picks one process while the user's own listens
//!   elsewhere. A folder named by `--socket-dir` or `TMS_SOCKET_DIR` is the only one looked in;
//!   the message for an empty one names the processes listening elsewhere. A process found
//!   listening elsewhere whose socket cannot be used (its folder refused) counts all the same:
//!   `--all` reports it as a failed process, and without `--all` it is one of several.
//!
//! Every folder found through `/proc` is opened and vetted as tmsctl's own is
//! ([`Folder::open_about`]), and every server is checked on connecting, as always.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use tms_proto::SocketName;

use crate::cli::Select;
use crate::ctx::Ctx;
use crate::failure::{Code, Failure, Result};
use crate::folder::{why_refused, Folder};
use crate::procfs::{self, euid, pid_alive, short_command, Environment};
use crate::socket::{classify, Socket};
use crate::text::shown_path;

/// How a process's folder is decided, for messages.
const RULE: &str = "a process listens in $TMS_SOCKET_DIR, else $XDG_RUNTIME_DIR/tms (if that \
                    folder is the user's), else /tmp/tms-<uid>, of its own environment";

/// tmsctl's own folder, opened and vetted (a refusal says where it came from).
pub fn main_folder(ctx: &Ctx) -> Result<Folder> {
    Folder::open_about(&ctx.dir, ctx.origin.about())
}

/// (device, inode) of a folder, to tell one folder reached by two paths.
fn identity(dir: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(dir)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

fn same_folder(a: &Path, b: &Path) -> bool {
    a == b || matches!((identity(a), identity(b)), (Some(x), Some(y)) if x == y)
}

/// Refuse process `pid`, owned by uid `owner`, unless that is `me`: tmsctl drives only its own
/// user's processes (their servers would refuse it anyway), and looks into no one else's.
pub fn check_owner(pid: u32, owner: u32, me: u32) -> Result<()> {
    if owner == me {
        return Ok(());
    }
    Err(Failure::new(
        Code::Permission,
        format!(
            "permission denied: process {pid} belongs to uid {owner}, not to uid {me} (this \
             tmsctl's): tmsctl drives only its own user's processes; run it as uid {owner}"
        ),
    ))
}

/// A process of tmsctl's user that `/proc` shows listening outside tmsctl's folder.
pub struct Away {
    /// The process.
    pub pid: u32,
    /// The folder it listens in.
    pub dir: PathBuf,
    name: SocketName,
    /// Its socket, or why it cannot be used (its folder refused, say).
    pub sock: Result<Socket>,
}

impl Away {
    /// Its socket, also when it cannot be used (to show it by).
    pub fn socket(&self) -> Socket {
        match &self.sock {
            Ok(s) => s.clone(),
            Err(_) => Socket {
                path: self.dir.join(self.name.file_name()),
                ns: classify(self.name.pidns, tms_proto::pid_namespace()),
                name: self.name,
                started: None,
            },
        }
    }
}

/// The processes of tmsctl's user that `/proc` shows listening outside `main`, by pid.
pub fn away(main: &Folder) -> Vec<Away> {
    let mut opened: Vec<(PathBuf, Result<Folder>)> = Vec::new();
    let mut out: Vec<Away> = Vec::new();
    for s in procfs::servers(euid(), None) {
        if same_folder(&s.dir, &main.dir) || out.iter().any(|a| a.pid == s.pid) {
            continue;
        }
        let i = match opened.iter().position(|(d, _)| *d == s.dir) {
            Some(i) => i,
            None => {
                let f = Folder::open_about(&s.dir, "a process of this user listens in it");
                opened.push((s.dir.clone(), f));
                opened.len() - 1
            }
        };
        let sock = match &opened[i].1 {
            Ok(f) => f.find(s.pid),
            Err(e) => Err(e.clone()),
        };
        out.push(Away {
            pid: s.pid,
            dir: s.dir,
            name: s.name,
            sock,
        });
    }
    out
}

/// What `tmsctl list` shows: tmsctl's folder, and (unless that folder was named) the processes
/// listening elsewhere.
pub struct Listing {
    /// tmsctl's folder.
    pub main: Folder,
    /// The processes listening elsewhere.
    pub away: Vec<Away>,
}

/// [`Listing`] for `ctx`.
pub fn listing(ctx: &Ctx) -> Result<Listing> {
    let main = main_folder(ctx)?;
    let away = if ctx.origin.named() {
        Vec::new()
    } else {
        away(&main)
    };
    Ok(Listing { main, away })
}

/// A process a command acts on: its socket, and, where tmsctl cannot use that socket (a process
/// `/proc` shows listening in a folder tmsctl refuses, say), why: that process's failure.
pub struct Target {
    /// Its socket (where it is, also when it cannot be used).
    pub sock: Socket,
    /// Why it cannot be reached, if it cannot.
    pub unusable: Option<Failure>,
}

/// What [`pick`] makes of the processes found.
enum Picked {
    /// Act on these, in turn.
    Act(Vec<Target>),
    /// None can be reached; why, for those found elsewhere that cannot.
    NoneFound(Vec<Failure>),
    /// Several, and no `--all`.
    Several(Vec<Target>),
}

/// The processes to act on, of those with a socket in tmsctl's folder (`live`) and those `/proc`
/// shows listening elsewhere (`away`), with `--all` or without. A process found elsewhere whose
/// socket cannot be used (its folder refused, say) counts as much as the others: `--all` reports
/// it as failed, and without `--all` it makes several processes; only where no process at all
/// can be reached do the reasons make the message for none. A pid found in both is one process,
/// reached where `/proc` shows it listening (the file in tmsctl's folder is one an earlier
/// process of that pid left), unless that socket cannot be used.
fn pick(live: Vec<Socket>, away: Vec<Away>, all: bool) -> Picked {
    let mut found: Vec<Target> = live
        .into_iter()
        .map(|sock| Target {
            sock,
            unusable: None,
        })
        .collect();
    for a in away {
        if let Some(t) = found.iter_mut().find(|t| t.sock.pid() == a.pid) {
            // A process has one control socket: a file of its pid in tmsctl's folder while
            // `/proc` shows it listening elsewhere is one an earlier process of that pid left.
            if let Ok(s) = a.sock {
                t.sock = s;
            }
            continue;
        }
        let sock = a.socket();
        found.push(Target {
            sock,
            unusable: a.sock.err(),
        });
    }
    if found.iter().all(|t| t.unusable.is_some()) {
        return Picked::NoneFound(found.into_iter().filter_map(|t| t.unusable).collect());
    }
    if all || found.len() == 1 {
        return Picked::Act(found);
    }
    Picked::Several(found)
}

/// The processes `sel` picks (one, unless `--all`).
pub fn targets(ctx: &Ctx, sel: &Select) -> Result<Vec<Target>> {
    let main = main_folder(ctx)?;
    if let Some(p) = sel.pid {
        return by_pid(ctx, &main, p).map(|sock| {
            vec![Target {
                sock,
                unusable: None,
            }]
        });
    }
    let away = if ctx.origin.named() {
        Vec::new()
    } else {
        away(&main)
    };
    match pick(main.live_here(), away, sel.all) {
        Picked::Act(t) => Ok(t
            .into_iter()
            .map(|t| Target {
                unusable: t.unusable.map(|f| not_asked(&main, &t.sock, f)),
                sock: t.sock,
            })
            .collect()),
        Picked::NoneFound(refused) => Err(none_found(ctx, &main, &refused)),
        Picked::Several(t) => Err(several(&main, &t)),
    }
}

/// `pid 12 (python serve.py)`, and its folder where that is not tmsctl's.
fn named(main: &Folder, s: &Socket) -> String {
    let mut n = format!("pid {} ({})", s.pid(), short_command(s.pid()));
    if let Some(d) = s.path.parent().filter(|d| *d != main.dir) {
        n.push_str(&format!(" in {}", shown_path(d)));
    }
    n
}

/// The failure of a process found elsewhere whose socket cannot be used (`why`), naming it.
fn not_asked(main: &Folder, sock: &Socket, why: Failure) -> Failure {
    Failure::new(
        why.code,
        format!(
            "{}: not asked, its socket cannot be used: {}",
            named(main, sock),
            why.message
        ),
    )
}

fn several(main: &Folder, live: &[Target]) -> Failure {
    let names: Vec<String> = live
        .iter()
        .map(|t| match &t.unusable {
            None => named(main, &t.sock),
            Some(why) => format!(
                "{} (its socket cannot be used: {})",
                named(main, &t.sock),
                why.message
            ),
        })
        .collect();
    Failure::new(
        Code::Usage,
        format!(
            "{} processes have a control socket: {}: pass --pid PID or --all",
            live.len(),
            names.join(", ")
        ),
    )
}

/// Why no process can be picked: the folders looked in, what decides them, and (where
/// tmsctl's folder was named) the processes listening elsewhere. `refused`: processes found
/// elsewhere whose sockets cannot be used.
pub fn none_found(ctx: &Ctx, main: &Folder, refused: &[Failure]) -> Failure {
    let mut m = format!(
        "no process has a control socket in {} ({})",
        shown_path(&main.dir),
        ctx.origin.about()
    );
    if !main.exists {
        m.push_str(", there is no such folder");
    }
    if let Some(n) = main.other_namespaces() {
        m.push_str("; ");
        m.push_str(&n);
    }
    let mut code = Code::NoProcess;
    if ctx.origin.named() {
        let others: Vec<String> = away(main)
            .iter()
            .filter_map(|a| a.sock.as_ref().ok())
            .map(|s| named(main, s))
            .collect();
        m.push_str(
            "; only that folder is looked in while --socket-dir or TMS_SOCKET_DIR names one",
        );
        if others.is_empty() {
            m.push_str(", and /proc shows no process of this user listening in another");
        } else {
            m.push_str(&format!(
                "; this user's processes listen elsewhere: {}: pass --pid PID (its socket is \
                 found wherever it is) or --socket-dir DIR",
                others.join(", ")
            ));
        }
    } else if refused.is_empty() {
        m.push_str(", and /proc shows no process of this user listening in another folder");
    } else {
        code = Code::Permission;
        let why: Vec<&str> = refused.iter().map(|f| f.message.as_str()).collect();
        m.push_str(&format!(
            "; /proc shows processes of this user listening elsewhere, but: {}",
            why.join("; ")
        ));
    }
    m.push_str(&format!(
        "; {RULE}, once libtms.so has started in it (a pauseable allocation or a call of its API; \
         never with TMS_CONTROL=0): `tmsctl status --pid PID` says why a process has none"
    ));
    Failure::new(code, m)
}

/// The socket of process `pid`: in tmsctl's folder (unless `/proc` shows it listening only
/// elsewhere), else where `/proc` shows it listening, else in the folder its environment gives.
fn by_pid(ctx: &Ctx, main: &Folder, pid: u32) -> Result<Socket> {
    let not_here = match main.find(pid) {
        // The file may be one an earlier process of that pid left: where `/proc` shows this one
        // listening elsewhere, and not there, that socket is its own.
        Ok(s) => return Ok(listening_elsewhere(main, pid)?.unwrap_or(s)),
        Err(f) => f,
    };
    if !pid_alive(pid) {
        return Err(not_here);
    }
    let me = euid();
    if let Some(owner) = procfs::owner(pid) {
        check_owner(pid, owner, me)?;
    }
    let library = procfs::has_library(pid);
    if library == Some(true) {
        for s in procfs::servers(me, Some(pid)) {
            if same_folder(&s.dir, &main.dir) {
                continue;
            }
            let about = format!("process {pid} listens in it");
            if let Ok(sock) = Folder::open_about(&s.dir, &about)?.find(pid) {
                return Ok(sock);
            }
        }
    }
    // Where its environment says it listens: the one place left to look, and else the
    // likeliest reason why it does not.
    let env = (library == Some(true))
        .then(|| Environment::of(pid))
        .flatten();
    let mut there = None;
    if let Some(e) = &env {
        let d = e.socket_dir(me);
        let what = if d.is_relative() {
            // Relative to its working directory, which /proc shows as it is now, not as it was.
            "relative to its working directory: not looked in".to_string()
        } else if same_folder(&d, &main.dir) {
            "tmsctl's folder".to_string()
        } else {
            match Folder::open(&d) {
                Ok(f) => match f.find(pid) {
                    Ok(s) => return Ok(s),
                    Err(_) if !f.exists => "there is no such folder".to_string(),
                    Err(_) => "no socket of it there".to_string(),
                },
                Err(r) => format!(
                    "refused by tmsctl, as the library refuses it: {}",
                    why_refused(&r, &d)
                ),
            }
        };
        there = Some(format!(
            "its environment ({}) makes its folder {} ({what})",
            e.describe(),
            shown_path(&d)
        ));
    }
    if main.has_pid(pid) {
        // Sockets of that pid of other pid namespaces: their message says it.
        return Err(not_here);
    }
    Err(no_socket(ctx, main, pid, library, env.as_ref(), there))
}

/// The socket `/proc` shows process `pid` (of our user, the library loaded) listening on outside
/// tmsctl's folder, where it shows none in it; a folder found so is vetted, its refusal the error.
fn listening_elsewhere(main: &Folder, pid: u32) -> Result<Option<Socket>> {
    let found = procfs::servers(euid(), Some(pid));
    if found.iter().any(|s| same_folder(&s.dir, &main.dir)) {
        return Ok(None);
    }
    for s in found {
        let about = format!("process {pid} listens in it");
        if let Ok(sock) = Folder::open_about(&s.dir, &about)?.find(pid) {
            return Ok(Some(sock));
        }
    }
    Ok(None)
}

fn no_socket(
    ctx: &Ctx,
    main: &Folder,
    pid: u32,
    library: Option<bool>,
    env: Option<&Environment>,
    there: Option<String>,
) -> Failure {
    let mut m = format!(
        "process {pid} ({}) has no control socket: none in {} ({})",
        short_command(pid),
        shown_path(&main.dir),
        ctx.origin.about()
    );
    match library {
        Some(false) => m.push_str(
            "; libtms.so is not loaded in it (start it with LD_PRELOAD=libtms.so, or have it \
             load the library)",
        ),
        None => m.push_str("; /proc does not show what it has loaded"),
        Some(true) => {
            m.push_str("; libtms.so is loaded in it, and /proc shows it listening on none");
            match there {
                Some(t) => {
                    m.push_str("; ");
                    m.push_str(&t);
                }
                None => m.push_str("; its environment cannot be read"),
            }
            if let Some(v) = env
                .filter(|e| e.control_off())
                .and_then(Environment::control)
            {
                m.push_str(&format!(
                    "; its TMS_CONTROL ({}) keeps the socket off",
                    crate::text::quoted(&v)
                ));
            } else {
                m.push_str(
                    "; the library listens once it has started (a pauseable allocation or a \
                     call of its API) in a folder it accepts (a real folder of the user's own, \
                     mode 0700, in folders only root or the user can change); TMS_LOG=info \
                     makes it say why it does not",
                );
            }
        }
    }
    m.push_str(&format!(" ({RULE})"));
    Failure::new(Code::NoProcess, m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::socket::{test_socket, Ns};

    /// Process `pid`, listening in `/elsewhere`, reachable or not (its folder refused).
    fn away_of(pid: u32, reachable: bool) -> Away {
        let name = SocketName {
            pid,
            pidns: Some(100),
        };
        let sock = if reachable {
            Ok(test_socket(pid, Ns::Ours))
        } else {
            Err(Failure::new(
                Code::Permission,
                "permission denied: refusing the socket folder /elsewhere: its mode is 0755",
            ))
        };
        Away {
            pid,
            dir: PathBuf::from("/elsewhere"),
            name,
            sock,
        }
    }

    /// The pids of `t`, each with the exit code of its failure where it cannot be reached.
    fn shown(t: &[Target]) -> Vec<(u32, Option<Code>)> {
        t.iter()
            .map(|t| (t.sock.pid(), t.unusable.as_ref().map(|f| f.code)))
            .collect()
    }

    #[test]
    fn a_process_listening_in_a_refused_folder_is_never_left_out() {
        let live = || vec![test_socket(10, Ns::Ours)];
        // --all: it is one of the processes, reported as failed (exit 4), not skipped.
        match pick(live(), vec![away_of(20, true), away_of(30, false)], true) {
            Picked::Act(t) => assert_eq!(
                shown(&t),
                [(10, None), (20, None), (30, Some(Code::Permission))]
            ),
            _ => panic!("--all acts on every process found"),
        }
        // Without --all, one reachable and one refused are two processes: name them, stop.
        match pick(live(), vec![away_of(30, false)], false) {
            Picked::Several(t) => {
                assert_eq!(shown(&t), [(10, None), (30, Some(Code::Permission))])
            }
            Picked::Act(t) => panic!("acted on {:?} as if it were the only one", shown(&t)),
            Picked::NoneFound(_) => panic!("one process is reachable"),
        }
        // A pid already found in tmsctl's folder is one process, not two.
        match pick(live(), vec![away_of(10, false)], false) {
            Picked::Act(t) => assert_eq!(shown(&t), [(10, None)]),
            _ => panic!("one process"),
        }
        // ... whose socket, where /proc shows it listening elsewhere, is that one: the file in
        // tmsctl's folder is one an earlier process of that pid left.
        let mut a = away_of(10, true);
        let there = PathBuf::from("/elsewhere").join(test_socket(10, Ns::Ours).file_name());
        if let Ok(s) = &mut a.sock {
            s.path = there.clone();
        }
        match pick(live(), vec![a], false) {
            Picked::Act(t) => {
                assert_eq!(t.iter().map(|t| &t.sock.path).collect::<Vec<_>>(), [&there])
            }
            _ => panic!("one process"),
        }
        // None reachable: the message for none says why (unchanged).
        match pick(Vec::new(), vec![away_of(30, false)], true) {
            Picked::NoneFound(why) => assert_eq!(why.len(), 1),
            _ => panic!("no process is reachable"),
        }
    }

    #[test]
    fn only_processes_of_our_own_uid_are_looked_into() {
        assert!(check_owner(42, 1000, 1000).is_ok());
        let e = check_owner(42, 1001, 1000).unwrap_err();
        assert_eq!(e.code, Code::Permission);
        assert!(
            e.message
                .contains("process 42 belongs to uid 1001, not to uid 1000"),
            "{}",
            e.message
        );
        // root's tmsctl is no exception: the server would refuse it too.
        assert_eq!(check_owner(42, 1000, 0).unwrap_err().code, Code::Permission);
    }
}
