//! What the system says about a process: whether it lives, its command line, and from `/proc`
//! who owns it, which control sockets it listens on, whether the library is loaded in it, what
//! its environment makes its socket folder.
//!
//! Only a place to look: a folder found here is opened and vetted like tmsctl's own
//! ([`crate::folder::Folder::open`]), and a server found here is checked on connecting like any
//! other. Only processes of tmsctl's own user are looked into.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::io::BufRead;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::signal::kill;
use nix::unistd::{geteuid, Pid};
use tms_proto::SocketName;

use crate::socket::{classify, Ns};
use crate::text::printable;

/// Our effective uid.
pub fn euid() -> u32 {
    geteuid().as_raw()
}

/// True when process `pid` (of our pid namespace) exists, ours or another user's.
pub fn pid_alive(pid: u32) -> bool {
    let Ok(p) = i32::try_from(pid) else {
        return false;
    };
    if p <= 0 {
        return false;
    }
    // Signal "none" delivers nothing; it only checks that the process exists.
    matches!(kill(Pid::from_raw(p), None), Ok(()) | Err(Errno::EPERM))
}

/// When process `pid` (of our pid namespace) started, in clock ticks since boot (field 22 of
/// `/proc/PID/stat`): with the pid, what tells it from a later process given the same pid.
/// `None` where `/proc` does not say.
pub fn start_time(pid: u32) -> Option<u64> {
    parse_start_time(&std::fs::read(stat_path(pid)).ok()?)
}

fn stat_path(pid: u32) -> PathBuf {
    // A pid cannot be reused on demand: the tests of debug builds stand in for `/proc` here to
    // show tmsctl a process replaced under its pid.
    #[cfg(debug_assertions)]
    if let Some(root) = std::env::var_os("TMSCTL_TEST_PROC") {
        return PathBuf::from(root).join(pid.to_string()).join("stat");
    }
    PathBuf::from(format!("/proc/{pid}/stat"))
}

/// Field 22 of a `/proc/PID/stat` text. The command name (field 2) is in parentheses and may
/// hold spaces and parentheses itself: the fields are counted from the last `)`.
fn parse_start_time(stat: &[u8]) -> Option<u64> {
    let close = stat.iter().rposition(|b| *b == b')')?;
    let rest = std::str::from_utf8(&stat[close + 1..]).ok()?;
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// [`command_line`], cut to 60 characters, for naming a process inside a line.
pub fn short_command(pid: u32) -> String {
    let c = command_line(pid);
    if c.chars().count() <= 60 {
        return c;
    }
    let mut s: String = c.chars().take(59).collect();
    s.push('\u{2026}');
    s
}

/// `/proc/PID/cmdline` as one printable line (arguments joined by spaces), or `?`.
pub fn command_line(pid: u32) -> String {
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(b) if !b.is_empty() => {
            let parts: Vec<String> = b
                .split(|c| *c == 0)
                .filter(|p| !p.is_empty())
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .collect();
            printable(&parts.join(" ")).into_owned()
        }
        _ => "?".to_string(),
    }
}

/// A listening Unix stream socket bound to a path, from `/proc/net/unix`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bound {
    /// The socket's inode (what `/proc/PID/fd` links name).
    pub inode: u64,
    /// The path it was bound to (the kernel keeps it after a rename of the file).
    pub path: PathBuf,
}

/// The listening stream sockets bound to a path in the text of `/proc/net/unix`. A path is
/// printed raw there, so one holding a line break could forge a line: lines that do not parse
/// are skipped, and so is an inode that appears on more than one line.
pub fn listening(text: &[u8]) -> Vec<Bound> {
    /// `__SO_ACCEPTCON`: the socket listens.
    const ACCEPTING: u32 = 1 << 16;
    let mut seen: HashMap<u64, usize> = HashMap::new();
    let mut out = Vec::new();
    // Num RefCount Protocol Flags Type St Inode Path
    for line in text.split(|b| *b == b'\n').skip(1) {
        let mut rest = line;
        let mut fields = [&b""[..]; 7];
        let mut ok = true;
        for f in fields.iter_mut() {
            let start = rest.iter().position(|b| *b != b' ').unwrap_or(rest.len());
            rest = &rest[start..];
            let end = rest.iter().position(|b| *b == b' ').unwrap_or(rest.len());
            if end == 0 {
                ok = false;
                break;
            }
            *f = &rest[..end];
            rest = &rest[end..];
        }
        let Some(inode) = ok
            .then(|| std::str::from_utf8(fields[6]).ok()?.parse::<u64>().ok())
            .flatten()
        else {
            continue;
        };
        *seen.entry(inode).or_default() += 1;
        let flags = std::str::from_utf8(fields[3])
            .ok()
            .and_then(|f| u32::from_str_radix(f, 16).ok());
        let path = rest.strip_prefix(b" ").unwrap_or_default();
        if fields[4] != b"0001" || flags.is_none_or(|f| f & ACCEPTING == 0) {
            continue;
        }
        if !path.starts_with(b"/") {
            continue;
        }
        out.push(Bound {
            inode,
            path: PathBuf::from(OsString::from_vec(path.to_vec())),
        });
    }
    out.retain(|b| seen.get(&b.inode) == Some(&1));
    out
}

/// The folder and socket name of a control socket bound at `path`: `<dir>/<pid>.<ns>.sock`, or
/// the temporary name a server binds before it renames the file into place,
/// `<dir>/.<pid>.<ns>.sock.tmp` (which `/proc/net/unix` goes on showing).
pub fn control_socket(path: &Path) -> Option<(PathBuf, SocketName)> {
    let file = path.file_name()?.to_str()?;
    let name = match file.strip_prefix('.').and_then(|f| f.strip_suffix(".tmp")) {
        Some(inner) => inner,
        None => file,
    };
    let name = SocketName::parse(name)?;
    Some((path.parent()?.to_path_buf(), name))
}

/// The uid that owns process `pid` (its `/proc/PID`), if it exists and `/proc` says.
pub fn owner(pid: u32) -> Option<u32> {
    std::fs::symlink_metadata(format!("/proc/{pid}"))
        .ok()
        .map(|m| m.uid())
}

/// The inodes of the sockets process `pid` holds open, if its descriptors can be read.
fn socket_inodes(pid: u32) -> Option<HashSet<u64>> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    let mut out = HashSet::new();
    for fd in fds.flatten() {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        let t = target.as_os_str().as_bytes();
        if let Some(n) = t
            .strip_prefix(b"socket:[")
            .and_then(|r| r.strip_suffix(b"]"))
            .and_then(|n| std::str::from_utf8(n).ok()?.parse().ok())
        {
            out.insert(n);
        }
    }
    Some(out)
}

/// Whether the library is mapped into process `pid`: a file named `libtms*` (a build, or the
/// package's copy) or `torch_memory_saver*` (the names the wheel also installs it under).
/// `None` when `/proc` does not say.
pub fn has_library(pid: u32) -> Option<bool> {
    let f = std::fs::File::open(format!("/proc/{pid}/maps")).ok()?;
    let mut r = std::io::BufReader::new(f);
    let mut line = Vec::new();
    loop {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) => return Some(false),
            Ok(_) => {}
            Err(_) => return None,
        }
        let line = line.strip_suffix(b"\n").unwrap_or(&line);
        // address perms offset dev inode, then the path (if any).
        let Some(slash) = line.iter().position(|b| *b == b'/') else {
            continue;
        };
        let path = &line[slash..];
        let file = path.rsplit(|b| *b == b'/').next().unwrap_or(path);
        if file.starts_with(b"libtms") || file.starts_with(b"torch_memory_saver") {
            return Some(true);
        }
    }
}

/// What decides a process's socket folder, from its environment as it was started (`/proc`
/// shows that one: a change the program made to its environment later is not seen).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Environment {
    /// `TMS_SOCKET_DIR`.
    pub tms_socket_dir: Option<OsString>,
    /// `XDG_RUNTIME_DIR`.
    pub xdg_runtime_dir: Option<OsString>,
    /// `TMS_CONTROL`.
    pub tms_control: Option<OsString>,
}

impl Environment {
    /// Read from `/proc/PID/environ` (`None` when it cannot be read).
    pub fn of(pid: u32) -> Option<Environment> {
        let bytes = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        Some(Environment::parse(&bytes))
    }

    /// From an environment block (`NAME=value`, NUL-separated).
    pub fn parse(bytes: &[u8]) -> Environment {
        let mut e = Environment::default();
        for var in bytes.split(|b| *b == 0) {
            let Some(eq) = var.iter().position(|b| *b == b'=') else {
                continue;
            };
            let value = Some(OsString::from_vec(var[eq + 1..].to_vec()));
            match &var[..eq] {
                b"TMS_SOCKET_DIR" => e.tms_socket_dir = value,
                b"XDG_RUNTIME_DIR" => e.xdg_runtime_dir = value,
                b"TMS_CONTROL" => e.tms_control = value,
                _ => {}
            }
        }
        e
    }

    /// The socket folder these make for user `uid`, as the library computes it.
    pub fn socket_dir(&self, uid: u32) -> PathBuf {
        tms_proto::socket_dir(
            self.tms_socket_dir.clone(),
            self.xdg_runtime_dir.clone(),
            uid,
        )
    }

    /// `TMS_SOCKET_DIR=/a, XDG_RUNTIME_DIR unset`, for messages.
    pub fn describe(&self) -> String {
        let show = |name: &str, v: &Option<OsString>| match v {
            Some(v) if !v.is_empty() => {
                format!("{name}={}", printable(&v.to_string_lossy()))
            }
            Some(_) => format!("{name} empty"),
            None => format!("{name} unset"),
        };
        format!(
            "{}, {}",
            show("TMS_SOCKET_DIR", &self.tms_socket_dir),
            show("XDG_RUNTIME_DIR", &self.xdg_runtime_dir)
        )
    }

    /// `TMS_CONTROL` keeps the server off: any value but `1`, `true`, `yes` or `on` (the library
    /// reads `0`, `false`, `no`, `off` and empty as off, and starts no server on a malformed one).
    pub fn control_off(&self) -> bool {
        self.tms_control.as_ref().is_some_and(|v| {
            !matches!(
                v.to_string_lossy().trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
    }

    /// `TMS_CONTROL`'s value, where set.
    pub fn control(&self) -> Option<String> {
        self.tms_control
            .as_ref()
            .map(|v| v.to_string_lossy().into_owned())
    }
}

/// A control socket that `/proc` shows a process listening on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Server {
    /// The process.
    pub pid: u32,
    /// The folder its socket is in.
    pub dir: PathBuf,
    /// The socket's name.
    pub name: SocketName,
}

/// The folder process `pid` bound a socket in, as its `/proc/net/unix` shows it (`dir`). A
/// folder too deep for a socket address is bound through `/proc/self/fd/<N>`
/// (`tms_proto::via_short_path`): the server's own descriptor, read from `/proc/<pid>/fd/<N>`,
/// never tmsctl's of that number. `None` where that descriptor is no longer a folder.
fn folder_of(pid: u32, dir: PathBuf) -> Option<PathBuf> {
    let Ok(fd) = dir.strip_prefix("/proc/self/fd") else {
        return Some(dir);
    };
    let n: u32 = fd.to_str()?.parse().ok()?;
    let target = std::fs::read_link(format!("/proc/{pid}/fd/{n}")).ok()?;
    // A folder removed since reads "<path> (deleted)": not a folder to look in.
    (target.is_absolute() && target.is_dir()).then_some(target)
}

/// The control sockets that processes of user `uid` with the library loaded listen on: those
/// of every such process in tmsctl's network namespace, or (`only`) of that one process, in
/// its own. Sockets of other pid namespaces are left out (their pid means another process
/// here). A socket counts only where its name gives the pid of the process that holds it.
pub fn servers(uid: u32, only: Option<u32>) -> Vec<Server> {
    let table = match only {
        Some(p) => format!("/proc/{p}/net/unix"),
        None => "/proc/self/net/unix".to_string(),
    };
    let Ok(text) = std::fs::read(table) else {
        return Vec::new();
    };
    let our_ns = tms_proto::pid_namespace();
    let mut by_pid: BTreeMap<u32, Vec<(u64, PathBuf, SocketName)>> = BTreeMap::new();
    for b in listening(&text) {
        let Some((dir, name)) = control_socket(&b.path) else {
            continue;
        };
        if matches!(classify(name.pidns, our_ns), Ns::Other(_))
            || only.is_some_and(|p| p != name.pid)
        {
            continue;
        }
        by_pid
            .entry(name.pid)
            .or_default()
            .push((b.inode, dir, name));
    }
    let mut out = Vec::new();
    for (pid, bound) in by_pid {
        if owner(pid) != Some(uid) || has_library(pid) != Some(true) {
            continue;
        }
        let Some(held) = socket_inodes(pid) else {
            continue;
        };
        for (inode, dir, name) in bound {
            if !held.contains(&inode) {
                continue;
            }
            let Some(dir) = folder_of(pid, dir) else {
                continue;
            };
            if !out.iter().any(|s: &Server| s.pid == pid && s.dir == dir) {
                out.push(Server { pid, dir, name });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "Num       RefCount Protocol Flags    Type St Inode Path\n";

    #[test]
    fn the_start_time_is_field_22_counted_from_the_end_of_the_command_name() {
        let tail = "S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 4242 20 21";
        let stat = format!("77 (a) (b) 2) {tail}\n");
        assert_eq!(parse_start_time(stat.as_bytes()), Some(4242));
        assert_eq!(parse_start_time(b"77 (a) S 1 2"), None, "too short");
        assert_eq!(parse_start_time(b"77 a S"), None, "no command name");
        let me = std::process::id();
        let mine = start_time(me).expect("our own start time");
        assert_eq!(
            start_time(me),
            Some(mine),
            "the same process, the same time"
        );
    }

    #[test]
    fn a_folder_bound_through_a_descriptor_is_the_servers_descriptors_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let held = tms_proto::hold_folder(tmp.path()).unwrap();
        let n = std::os::fd::AsRawFd::as_raw_fd(&held);
        let me = std::process::id();
        let through = PathBuf::from(format!("/proc/self/fd/{n}"));
        assert_eq!(folder_of(me, through), Some(tmp.path().to_path_buf()));
        assert_eq!(
            folder_of(me, "/run/x/tms".into()),
            Some("/run/x/tms".into())
        );
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let f = std::os::fd::AsRawFd::as_raw_fd(&file);
        assert_eq!(
            folder_of(me, format!("/proc/self/fd/{f}").into()),
            None,
            "not a folder"
        );
    }

    #[test]
    fn reads_the_listening_sockets_of_proc_net_unix() {
        let text = format!(
            "{HEADER}\
             0000000000000000: 00000002 00000000 00010000 0001 01 12345 /run/user/1000/tms/.77.4026531836.sock.tmp\n\
             0000000000000000: 00000002 00000000 00010000 0001 01    12 /tmp/with space/a.sock\n\
             0000000000000000: 00000003 00000000 00000000 0001 03 23456 /run/user/1000/tms/.77.4026531836.sock.tmp\n\
             0000000000000000: 00000002 00000000 00010000 0002 01 34567 /dgram.sock\n\
             0000000000000000: 00000002 00000000 00010000 0001 01 45678 @abstract\n\
             0000000000000000: 00000002 00000000 00010000 0001 01 56789\n\
             garbage\n"
        );
        assert_eq!(
            listening(text.as_bytes()),
            [
                Bound {
                    inode: 12345,
                    path: "/run/user/1000/tms/.77.4026531836.sock.tmp".into()
                },
                Bound {
                    inode: 12,
                    path: "/tmp/with space/a.sock".into()
                },
            ]
        );
    }

    #[test]
    fn a_forged_line_for_a_known_inode_drops_the_inode() {
        // A path holding a line break prints as two lines; the second one claims inode 12345.
        let text = format!(
            "{HEADER}\
             0000000000000000: 00000002 00000000 00010000 0001 01 12345 /run/user/1000/tms/1.sock\n\
             0000000000000000: 00000002 00000000 00010000 0001 01 999 /tmp/x\n\
             0000000000000000: 00000002 00000000 00010000 0001 01 12345 /tmp/evil/1.sock\n"
        );
        let found = listening(text.as_bytes());
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].inode, 999);
    }

    #[test]
    fn socket_names_and_their_temporary_names_give_the_folder() {
        let n = |pid, pidns| SocketName { pid, pidns };
        assert_eq!(
            control_socket(Path::new("/a/b/.77.5.sock.tmp")),
            Some((PathBuf::from("/a/b"), n(77, Some(5))))
        );
        assert_eq!(
            control_socket(Path::new("/a/77.5.sock")),
            Some((PathBuf::from("/a"), n(77, Some(5))))
        );
        assert_eq!(
            control_socket(Path::new("/a/77.sock")),
            Some((PathBuf::from("/a"), n(77, None)))
        );
        for other in [
            "/a/x.sock",
            "/a/.77.sock",
            "/a/77.sock.tmp",
            "/a/.x.tmp",
            "/",
        ] {
            assert_eq!(control_socket(Path::new(other)), None, "{other}");
        }
    }

    #[test]
    fn the_environment_gives_the_folder_as_the_library_computes_it() {
        let xdg = tempfile::tempdir().unwrap();
        let me = std::fs::metadata(xdg.path()).unwrap().uid();
        let x = xdg.path().display();
        let e = Environment::parse(
            format!("PATH=/bin\0XDG_RUNTIME_DIR={x}\0TMS_CONTROL=0\0").as_bytes(),
        );
        assert_eq!(e.socket_dir(me), xdg.path().join("tms"));
        // Another user's $XDG_RUNTIME_DIR is passed over, as the library passes it over.
        let other = me.wrapping_add(1);
        assert_eq!(
            e.socket_dir(other),
            PathBuf::from(format!("/tmp/tms-{other}"))
        );
        assert!(e.control_off());
        assert_eq!(
            e.describe(),
            format!("TMS_SOCKET_DIR unset, XDG_RUNTIME_DIR={x}")
        );
        for (v, off) in [
            ("off", true),
            ("maybe", true),
            (" On ", false),
            ("1", false),
        ] {
            let e = Environment::parse(format!("TMS_CONTROL={v}\0").as_bytes());
            assert_eq!(e.control_off(), off, "{v:?}");
        }
        let e = Environment::parse(b"TMS_SOCKET_DIR=/s\0XDG_RUNTIME_DIR=/run/user/7\0A=B=C");
        assert_eq!(e.socket_dir(7), PathBuf::from("/s"));
        assert!(!e.control_off());
        let e = Environment::parse(b"TMS_SOCKET_DIR=\0");
        assert_eq!(e.socket_dir(7), PathBuf::from("/tmp/tms-7"));
        assert_eq!(e.describe(), "TMS_SOCKET_DIR empty, XDG_RUNTIME_DIR unset");
    }
}
