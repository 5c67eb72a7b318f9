//! The socket folder: opened and vetted before a socket in it is looked at, and the sockets in
//! it, by pid namespace.
//!
//! tmsctl trusts a folder only if it is a real folder (not a symbolic link) owned by our
//! effective uid that group and others cannot use at all, and every folder above it, up to
//! `/`, is owned by root or by us and cannot be written to by group or others unless sticky
//! (like `/tmp`), links on the way being followed only where root or we own them
//! ([`tms_proto::check_ancestors`], checked before the folder is opened): the rules the server
//! applies when it makes it, so a folder the library refuses is refused here in the same
//! words. Anything else is refused with [`Code::Permission`]. Who serves a socket is checked on
//! connecting ([`crate::client`]).
//!
//! `--pid P` means process P of tmsctl's own pid namespace: `<P>.<ours>.sock`, else `<P>.sock`;
//! sockets of P in other namespaces are never taken for it ([`Folder::find`]).

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{open, OFlag};
use nix::sys::stat::{fstat, lstat, Mode, SFlag};
use tms_proto::SocketName;

use crate::failure::{Code, Failure, Result};
use crate::procfs::{euid, pid_alive};
use crate::socket::{classify, nobody_listens, Socket};
use crate::text::{printable, shown_path};

/// The socket folder, vetted, and the sockets in it.
#[derive(Debug)]
pub struct Folder {
    /// Its path.
    pub dir: PathBuf,
    /// Our pid namespace (`None` without `/proc`).
    pub our_ns: Option<u64>,
    /// Every file named like a socket, by pid, ours first.
    pub sockets: Vec<Socket>,
    /// It exists (a missing folder holds no socket).
    pub exists: bool,
}

/// `dir`, printable, followed by what it is (`about`) when that is given.
fn folder_shown(dir: &Path, about: &str) -> String {
    let shown = shown_path(dir);
    if about.is_empty() {
        shown
    } else {
        format!("{shown} ({about})")
    }
}

fn refuse_folder(dir: &Path, about: &str, why: impl fmt::Display) -> Failure {
    Failure::new(
        Code::Permission,
        format!(
            "permission denied: refusing the socket folder {}: {why}",
            folder_shown(dir, about)
        ),
    )
}

/// What a refusal by [`Folder::open`] of `dir` says after the folder's name: why.
pub fn why_refused<'a>(f: &'a Failure, dir: &Path) -> &'a str {
    let path = dir.display().to_string();
    let shown = printable(&path);
    [
        "permission denied: refusing the socket folder ",
        "permission denied: cannot read the socket folder ",
        "cannot read the socket folder ",
    ]
    .iter()
    .find_map(|p| {
        f.message
            .strip_prefix(p)?
            .strip_prefix(&*shown)?
            .strip_prefix(": ")
    })
    .unwrap_or(&f.message)
}

fn unreadable_folder(dir: &Path, about: &str, e: Errno) -> Failure {
    let shown = folder_shown(dir, about);
    if matches!(e, Errno::EACCES | Errno::EPERM) {
        Failure::new(
            Code::Permission,
            format!(
                "permission denied: cannot read the socket folder {shown}: {}",
                e.desc()
            ),
        )
    } else {
        Failure::new(
            Code::Failed,
            format!("cannot read the socket folder {shown}: {}", e.desc()),
        )
    }
}

impl Folder {
    /// Open `dir`, check that we can trust it (a folder, not a link, ours, closed to group and
    /// others, below folders only root or we can change), and list its sockets. A folder that
    /// does not exist holds none; one that cannot be read is a permission error naming it.
    pub fn open(dir: &Path) -> Result<Folder> {
        Folder::open_about(dir, "")
    }

    /// [`Folder::open`], its refusals saying what the folder is (`about`: whose, from which
    /// variable) after its path.
    pub fn open_about(dir: &Path, about: &str) -> Result<Folder> {
        let our_ns = tms_proto::pid_namespace();
        // Before anything below them is opened: whoever could change one of them could swap
        // the folder for their own after our check (also where it does not exist yet: the
        // library refuses it alike, and the refusal says why it has no socket there).
        if let Err(a) = tms_proto::check_ancestors(dir, euid()) {
            let why = format!("its ancestor {} {}", shown_path(&a.path), a.fault);
            return Err(refuse_folder(dir, about, why));
        }
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd = match open(dir, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => {
                return Ok(Folder {
                    dir: dir.to_path_buf(),
                    our_ns,
                    sockets: Vec::new(),
                    exists: false,
                })
            }
            Err(e @ (Errno::ELOOP | Errno::ENOTDIR)) => {
                let kind =
                    lstat(dir).map(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT);
                let why = match kind {
                    Ok(k) if k == SFlag::S_IFLNK => "it is a symbolic link".to_string(),
                    Ok(k) if k != SFlag::S_IFDIR => "it is not a folder".to_string(),
                    _ => format!("cannot open it: {}", e.desc()),
                };
                return Err(refuse_folder(dir, about, why));
            }
            Err(e) => return Err(unreadable_folder(dir, about, e)),
        };
        let st = fstat(&fd).map_err(|e| unreadable_folder(dir, about, e))?;
        let me = euid();
        if st.st_uid != me {
            return Err(refuse_folder(
                dir,
                about,
                format!(
                    "it belongs to uid {}, not to uid {me} (this tmsctl's)",
                    st.st_uid
                ),
            ));
        }
        let mode = st.st_mode & 0o777;
        if mode & 0o077 != 0 {
            return Err(refuse_folder(
                dir,
                about,
                format!(
                    "its mode is {mode:04o}: group or others have access (it must be 0700, as \
                     the server makes it)"
                ),
            ));
        }
        let mut listing = Dir::from_fd(fd).map_err(|e| unreadable_folder(dir, about, e))?;
        let mut sockets = Vec::new();
        for entry in listing.iter() {
            let entry = entry.map_err(|e| unreadable_folder(dir, about, e))?;
            let name = OsStr::from_bytes(entry.file_name().to_bytes());
            let Some(name) = name.to_str().and_then(SocketName::parse) else {
                continue;
            };
            sockets.push(Socket {
                path: dir.join(name.file_name()),
                ns: classify(name.pidns, our_ns),
                name,
                started: None,
            });
        }
        sockets.sort_by_key(|s| (!s.here(), s.name.pid, s.ns));
        Ok(Folder {
            dir: dir.to_path_buf(),
            our_ns,
            sockets,
            exists: true,
        })
    }

    /// The sockets of live processes of our pid namespace (named for it, or for none), one per
    /// pid (the one named for our namespace where both are there), by pid. A socket nobody
    /// listens on is left out even where its pid lives: a process that died left it, and its
    /// pid may be another process's now.
    pub fn live_here(&self) -> Vec<Socket> {
        let mut by_pid: BTreeMap<u32, &Socket> = BTreeMap::new();
        for s in self.sockets.iter().filter(|s| s.here()) {
            let e = by_pid.entry(s.pid()).or_insert(s);
            if s.ns < e.ns {
                *e = s;
            }
        }
        by_pid
            .into_values()
            .filter(|s| pid_alive(s.pid()) && !nobody_listens(&s.path))
            .cloned()
            .collect()
    }

    /// The sockets of other pid namespaces, by pid (never acted on: their pids mean other
    /// processes here; `tmsctl list` asks their status).
    pub fn elsewhere(&self) -> Vec<Socket> {
        self.sockets.iter().filter(|s| !s.here()).cloned().collect()
    }

    fn shown(&self) -> String {
        shown_path(&self.dir)
    }

    fn ns_shown(&self) -> String {
        match self.our_ns {
            Some(n) => format!("pid namespace {n}"),
            None => "this pid namespace".to_string(),
        }
    }

    /// The socket of process `pid` of our pid namespace: `<pid>.<our-ns>.sock`, else
    /// `<pid>.sock`. Sockets of that pid in other namespaces belong to other processes: they
    /// are named in the refusal, never taken.
    pub fn find(&self, pid: u32) -> Result<Socket> {
        let of_pid: Vec<&Socket> = self.sockets.iter().filter(|s| s.pid() == pid).collect();
        if let Some(s) = of_pid.iter().filter(|s| s.here()).min_by_key(|s| s.ns) {
            return Ok((*s).clone());
        }
        if !of_pid.is_empty() {
            let names: Vec<String> = of_pid.iter().map(|s| s.file_name()).collect();
            return Err(Failure::new(
                Code::NoProcess,
                format!(
                    "process {pid} of this pid namespace ({}) has no control socket in {}; {} \
                     there {} of pid {pid} of another pid namespace, which is another process: \
                     run tmsctl in that namespace",
                    self.ns_shown(),
                    self.shown(),
                    names.join(", "),
                    if names.len() == 1 { "is" } else { "are" },
                ),
            ));
        }
        if !pid_alive(pid) {
            return Err(Failure::new(
                Code::NoProcess,
                format!("no such process: {pid}"),
            ));
        }
        Err(Failure::new(
            Code::NoProcess,
            format!(
                "process {pid} has no control socket in {} (is libtms.so preloaded, has it made \
                 a pauseable allocation, is TMS_CONTROL=0 set, or do its TMS_SOCKET_DIR or \
                 XDG_RUNTIME_DIR make it another folder?)",
                self.shown()
            ),
        ))
    }

    /// What the folder holds of other pid namespaces, for a message saying that no process of
    /// ours has a socket in it: `None` when it holds nothing of theirs.
    pub fn other_namespaces(&self) -> Option<String> {
        let others = self.elsewhere();
        if others.is_empty() {
            return None;
        }
        let names: Vec<String> = others.iter().map(Socket::file_name).collect();
        Some(format!(
            "no process of this pid namespace ({}) has one there; it holds sockets of other \
             pid namespaces only ({}): run tmsctl in theirs (tmsctl list shows them)",
            self.ns_shown(),
            names.join(", ")
        ))
    }

    /// It holds a socket named for pid `pid` (of any pid namespace).
    pub fn has_pid(&self, pid: u32) -> bool {
        self.sockets.iter().any(|s| s.pid() == pid)
    }
}
