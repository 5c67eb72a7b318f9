//! The socket folder and the socket file: created private whatever the umask, checked before
//! use, cleaned of the sockets nobody listens on any more.

use std::fmt;
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::sys::{self, Probe};
use crate::error::{Error, Result};

/// Create `dir` (and any missing parent) with mode 0700 whatever the umask, then check it is a
/// real folder (not a symlink), owned by `uid`, that nobody else can enter or list. A folder
/// of ours that nobody else can enter but that we cannot use either (made under a umask such
/// as 0777 by an earlier version) is given mode 0700 again rather than refused for ever.
///
/// Every folder above it, up to `/`, must be owned by root or `uid` and closed to writing by
/// group and others unless sticky ([`tms_proto::check_ancestors`], Note [The ancestors of the
/// socket folder]): checked before anything is looked at, made or changed there, and again
/// before each missing folder is made. Otherwise whoever can write to one of them could swap
/// the checked folder for their own after the check.
pub fn prepare(dir: &Path, uid: u32) -> Result<()> {
    let shown = dir.display();
    let inspect_err = |e| Error::io(format!("cannot inspect the socket folder {shown}"), e);
    ancestors(dir, dir, uid)?;
    match fs::symlink_metadata(dir) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            create_private(dir, uid)?;
            // Through a link of ours to a folder missing at the first check, the folders made
            // may lie in one someone else made meanwhile (in /tmp, say): the check sees it now.
            ancestors(dir, dir, uid)?;
        }
        Err(e) => return Err(inspect_err(e)),
    }
    let inspect = || fs::symlink_metadata(dir).map_err(inspect_err);
    let mut m = inspect()?;
    let mode = m.permissions().mode() & 0o777;
    if m.is_dir() && m.uid() == uid && mode & 0o077 == 0 && mode != 0o700 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(|e| {
            Error::io(
                format!("cannot give the socket folder {shown} mode 0700"),
                e,
            )
        })?;
        tracing::debug!("socket folder {shown}: mode {mode:04o} set to 0700");
        m = inspect()?;
    }
    verify(&m, uid).map_err(|why| refused(dir, why))
}

/// The error of a refused socket folder `dir`. The refusal is the OS-level cause: a folder
/// others could enter (or swap for their own) is as unusable as one the system refuses.
fn refused(dir: &Path, why: Refusal) -> Error {
    Error::io(
        format!("refusing the socket folder {}", dir.display()),
        io::Error::new(io::ErrorKind::PermissionDenied, why),
    )
}

/// The folders above `path` (the socket folder `dir`, or one of the folders it is made in) may
/// be trusted; else the refusal names `dir`.
fn ancestors(path: &Path, dir: &Path, uid: u32) -> Result<()> {
    tms_proto::check_ancestors(path, uid).map_err(|a| refused(dir, Refusal::Ancestor(a)))
}

/// Create `dir` and its missing parents, each with mode 0700 set explicitly after `mkdir`: the
/// umask would otherwise take bits away (0777 leaves a folder nobody can use). Before each
/// `mkdir`, the folders above the new one are checked again ([`ancestors`]): a missing folder
/// may have been made meanwhile by someone else (in a sticky folder such as /tmp), and nothing
/// is made inside one of theirs, nor through a link of theirs.
fn create_private(dir: &Path, uid: u32) -> Result<()> {
    let failed = |e| {
        Error::io(
            format!("cannot create the socket folder {}", dir.display()),
            e,
        )
    };
    let mut missing = Vec::new();
    let mut p = Some(dir);
    while let Some(d) = p {
        match fs::symlink_metadata(d) {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(d),
            Err(e) => return Err(failed(e)),
        }
        p = d.parent().filter(|q| !q.as_os_str().is_empty());
    }
    for d in missing.into_iter().rev() {
        ancestors(d, dir, uid)?;
        match fs::DirBuilder::new().mode(0o700).create(d) {
            // We made it: nobody else can have replaced it in a folder we may use, and chmod
            // needs ownership anyway.
            Ok(()) => fs::set_permissions(d, fs::Permissions::from_mode(0o700)).map_err(failed)?,
            // Made meanwhile by someone else (another process starting): checked as an
            // ancestor before the next one is made, or by the caller if it is `dir`.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(failed(e)),
        }
    }
    Ok(())
}
/// Why [`prepare`] refuses a socket folder: [`verify`]'s reasons, about the folder itself, and
/// an ancestor others could change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A symbolic link (which could point anywhere).
    Symlink,
    /// Not a folder at all.
    NotAFolder,
    /// Owned by another user.
    Owner {
        /// Its owner.
        uid: u32,
        /// Ours.
        ours: u32,
    },
    /// Group or others have access.
    Open {
        /// Its permission bits.
        mode: u32,
    },
    /// The owner cannot use it.
    Unusable {
        /// Its permission bits.
        mode: u32,
    },
    /// A folder above it (or a link on the way) that someone other than root and us could
    /// change: owned by another user, or writable by group or others without the sticky bit.
    Ancestor(tms_proto::UnsafeAncestor),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Symlink => f.write_str("it is a symbolic link"),
            Refusal::NotAFolder => f.write_str("it is not a folder"),
            Refusal::Owner { uid, ours } => write!(f, "it belongs to uid {uid}, not {ours}"),
            Refusal::Open { mode } => write!(
                f,
                "its mode is {mode:04o}: group or others have access (want 0700)"
            ),
            Refusal::Unusable { mode } => write!(
                f,
                "its mode is {mode:04o}: the owner cannot use it (want 0700)"
            ),
            Refusal::Ancestor(a) => fmt::Display::fmt(a, f),
        }
    }
}

impl std::error::Error for Refusal {}

/// The rule [`prepare`] applies to the folder's metadata (from `lstat`).
pub fn verify(m: &fs::Metadata, uid: u32) -> std::result::Result<(), Refusal> {
    if m.file_type().is_symlink() {
        return Err(Refusal::Symlink);
    }
    if !m.is_dir() {
        return Err(Refusal::NotAFolder);
    }
    if m.uid() != uid {
        return Err(Refusal::Owner {
            uid: m.uid(),
            ours: uid,
        });
    }
    let mode = m.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(Refusal::Open { mode });
    }
    if mode & 0o700 != 0o700 {
        return Err(Refusal::Unusable { mode });
    }
    Ok(())
}

/// Listen on `<dir>/<pid>.<pidns>.sock` ([`tms_proto::socket_file_name`]), mode 0600 whatever
/// the umask. The socket is bound under a temporary name (`.<name>.tmp`), restricted, then
/// renamed into place, so no client ever sees it with a wider mode. A socket of the same name
/// can only be left over from this pid of this pid namespace before an `exec` (another live
/// process has another name), so it is replaced.
pub fn bind(dir: &Path, pid: u32) -> Result<(UnixListener, PathBuf)> {
    bind_as(dir, &tms_proto::socket_file_name(pid))
}

/// The temporary name a socket `name` is bound under.
fn temporary_name(name: &str) -> String {
    format!(".{name}.tmp")
}

/// [`bind`] under the file name `name`.
pub fn bind_as(dir: &Path, name: &str) -> Result<(UnixListener, PathBuf)> {
    let path = dir.join(name);
    let tmp = dir.join(temporary_name(name));
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(format!("cannot remove {}", tmp.display()), e)),
    }
    let listener = tms_proto::via_short_path(&tmp, |p| UnixListener::bind(p))
        .map_err(|e| Error::io(format!("cannot listen on {}", tmp.display()), e))?;
    // Explicitly, whatever the umask gave the new file (a socket's mode can only be set
    // through its path: fchmod on the socket's fd does not reach the file).
    let placed = fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600))
        .map_err(|e| Error::io(format!("cannot restrict {}", tmp.display()), e))
        .and_then(|_| {
            fs::rename(&tmp, &path).map_err(|e| {
                let what = format!("cannot rename {} to {}", tmp.display(), path.display());
                Error::io(what, e)
            })
        });
    if let Err(e) = placed {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok((listener, path))
}

/// A temporary name younger than this is left alone even when nobody listens on it: its
/// server may be between `bind` and `listen`.
const TEMPORARY_GRACE: Duration = Duration::from_secs(60);

/// Remove the sockets in `dir` that nobody listens on any more; returns how many. A socket is
/// stale only when connecting to it is refused (`ECONNREFUSED`): never because of its pid,
/// which may belong to another pid namespace sharing the folder, where it cannot be probed.
/// Only sockets owned by `uid` and named as sockets of this protocol (or their temporary names,
/// once older than a minute) are touched; `ours` (our own file name) and its temporary name
/// never.
pub fn clean_stale(dir: &Path, uid: u32, ours: &str) -> usize {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let our_tmp = temporary_name(ours);
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name == ours || name == our_tmp {
            continue;
        }
        let temporary = match name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp")) {
            Some(n) if tms_proto::SocketName::parse(n).is_some() => true,
            Some(_) => continue,
            None if tms_proto::SocketName::parse(name).is_some() => false,
            None => continue,
        };
        let path = entry.path();
        let Ok(m) = fs::symlink_metadata(&path) else {
            continue;
        };
        if !m.file_type().is_socket() || m.uid() != uid {
            continue;
        }
        if temporary {
            let young = m
                .modified()
                .ok()
                .and_then(|t| SystemTime::now().duration_since(t).ok())
                .is_none_or(|age| age < TEMPORARY_GRACE);
            if young {
                continue;
            }
        }
        match sys::probe(&path) {
            Probe::Refused => {}
            Probe::Listening => continue,
            Probe::Unknown(e) => {
                tracing::debug!("probing {}: {e}; left alone", path.display());
                continue;
            }
        }
        // Moved aside and probed again there: never a new server's socket, bound since.
        match tms_proto::remove_if_stale(dir, name, |p| matches!(sys::probe(p), Probe::Refused)) {
            Ok(true) => {
                tracing::debug!("removed the stale control socket {}", path.display());
                removed += 1;
            }
            Ok(false) => {}
            Err(e) => tracing::debug!("removing {}: {e}", path.display()),
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tms-dir-test-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn creates_a_private_folder_and_accepts_it_again() {
        let d = tmp("create").join("a/b");
        prepare(&d, sys::euid()).unwrap();
        let m = fs::symlink_metadata(&d).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o700);
        prepare(&d, sys::euid()).unwrap();
        fs::remove_dir_all(d.parent().unwrap().parent().unwrap()).unwrap();
    }

    #[test]
    fn refuses_open_foreign_or_linked_folders() {
        let base = tmp("refuse");
        let open = base.join("open");
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&open)
            .unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o755)).unwrap();
        let e = prepare(&open, sys::euid()).unwrap_err().to_string();
        assert!(e.contains("0755") && e.contains("refusing"), "{e}");
        assert_eq!(
            e,
            format!(
                "refusing the socket folder {}: its mode is 0755: group or others have access \
                 (want 0700)",
                open.display()
            )
        );

        let e = prepare(&open, sys::euid().wrapping_add(1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("belongs to uid"), "{e}");

        let link = base.join("link");
        let private = base.join("private");
        fs::DirBuilder::new().mode(0o700).create(&private).unwrap();
        std::os::unix::fs::symlink(&private, &link).unwrap();
        let e = prepare(&link, sys::euid()).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");

        let file = base.join("file");
        fs::write(&file, b"").unwrap();
        assert!(prepare(&file, sys::euid())
            .unwrap_err()
            .to_string()
            .contains("not a folder"));
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn binds_0600_under_the_namespaced_name() {
        let d = tmp("bind");
        prepare(&d, sys::euid()).unwrap();
        let me = std::process::id();
        let (_l, path) = bind(&d, me).unwrap();
        assert_eq!(path, d.join(tms_proto::socket_file_name(me)));
        let name = tms_proto::SocketName::parse(path.file_name().unwrap().to_str().unwrap());
        assert_eq!(name.unwrap().pidns, tms_proto::pid_namespace());
        let m = fs::symlink_metadata(&path).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        assert!(!d
            .join(temporary_name(&tms_proto::socket_file_name(me)))
            .exists());

        // A folder whose socket path would not fit in a socket address: listened in all the
        // same (through the folder's fd), at the path asked for, and reached the same way.
        let long = d.join("x".repeat(120));
        prepare(&long, sys::euid()).unwrap();
        let (_l3, far) = bind(&long, me).unwrap();
        assert_eq!(far, long.join(tms_proto::socket_file_name(me)));
        assert!(far.as_os_str().len() > tms_proto::SOCKET_PATH_MAX);
        let m = fs::symlink_metadata(&far).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        assert!(matches!(sys::probe(&far), sys::Probe::Listening));
        // A name too long even so: an error, not a panic.
        assert!(bind_as(&long, &"n".repeat(200))
            .unwrap_err()
            .to_string()
            .contains("cannot listen"));

        // Binding again (same pid, as after exec) replaces the old socket.
        let (_l2, again) = bind(&d, me).unwrap();
        assert_eq!(again, path);
        fs::remove_dir_all(&d).unwrap();
    }

    /// Sets a file's times `secs` into the past (`utimensat` without following links).
    fn age(path: &Path, secs: i64) {
        use nix::sys::stat::{utimensat, UtimensatFlags};
        use nix::sys::time::TimeSpec;
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let t = TimeSpec::new(now - secs, 0);
        utimensat(
            nix::fcntl::AT_FDCWD,
            path,
            &t,
            &t,
            UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();
    }

    #[test]
    fn only_sockets_nobody_listens_on_are_removed() {
        let d = tmp("clean");
        prepare(&d, sys::euid()).unwrap();
        let me = std::process::id();
        let (_ours, our_path) = bind(&d, me).unwrap();
        let ours = tms_proto::socket_file_name(me);

        // A live server of another pid namespace: its pid means nothing here (this one does
        // not exist in ours), but it listens, so it stays.
        let (_other, other_ns) = bind_as(&d, "2147483000.4026530000.sock").unwrap();
        // An old-style name, listening.
        let (_old, old_style) = bind_as(&d, "2147483001.sock").unwrap();
        // Nobody listens on these, although pid 1 and our own pid exist: they go.
        let (l, dead_ns) = bind_as(&d, "1.4026530001.sock").unwrap();
        drop(l);
        let (l, dead_old) = bind_as(&d, &format!("{me}.sock")).unwrap();
        drop(l);
        // Temporary names nobody listens on: an old one goes, a fresh one (its server may be
        // between bind and listen) stays.
        let old_tmp = d.join(".7.4026530002.sock.tmp");
        drop(UnixListener::bind(&old_tmp).unwrap());
        age(&old_tmp, 3600);
        let young_tmp = d.join(".8.4026530002.sock.tmp");
        drop(UnixListener::bind(&young_tmp).unwrap());
        // Not ours to judge: a file that is not a socket, a socket of another name.
        let not_socket = d.join("9.4026530002.sock");
        fs::write(&not_socket, b"").unwrap();
        let other_name = d.join("other.sock");
        drop(UnixListener::bind(&other_name).unwrap());

        assert_eq!(clean_stale(&d, sys::euid(), &ours), 3);
        for kept in [
            &our_path,
            &other_ns,
            &old_style,
            &young_tmp,
            &not_socket,
            &other_name,
        ] {
            assert!(kept.exists(), "{} was removed", kept.display());
        }
        for gone in [&dead_ns, &dead_old, &old_tmp] {
            assert!(!gone.exists(), "{} was kept", gone.display());
        }

        // Our own socket is never probed nor removed, even with nobody listening.
        drop(_ours);
        assert_eq!(clean_stale(&d, sys::euid(), &ours), 0);
        assert!(our_path.exists());
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_folder_we_cannot_use_is_repaired_if_nobody_else_can_either() {
        let d = tmp("repair");
        fs::DirBuilder::new().mode(0o700).create(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o000)).unwrap();
        prepare(&d, sys::euid()).unwrap();
        let m = fs::symlink_metadata(&d).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o700);
        fs::remove_dir_all(&d).unwrap();
    }

    /// A private temporary folder (ours, 0700) holding `shared`, given mode `mode` explicitly
    /// (whatever the umask); the socket folder is `shared/tms`, not made yet.
    fn below_shared(mode: u32) -> (tempfile::TempDir, PathBuf, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let shared = tmp.path().join("shared");
        fs::create_dir(&shared).unwrap();
        fs::set_permissions(&shared, fs::Permissions::from_mode(mode)).unwrap();
        let d = shared.join("tms");
        (tmp, shared, d)
    }

    fn refusal(dir: &Path) -> String {
        match prepare(dir, sys::euid()) {
            Ok(()) => panic!("{} was accepted", dir.display()),
            Err(e) => e.to_string(),
        }
    }

    /// What the refusal of `dir` says when `ancestor`, with permission bits `mode`, can be
    /// written to by `who`.
    fn writable(dir: &Path, ancestor: &Path, mode: &str, who: &str) -> String {
        format!(
            "refusing the socket folder {}: its ancestor {} has mode {mode}: {who} can write to \
             it without the sticky bit, so they could move what is in it away and put their own \
             in its place",
            dir.display(),
            ancestor.display()
        )
    }

    /// Modes are read from the folders, not tried by the kernel: the same as root or not.
    #[test]
    fn a_socket_folder_in_a_folder_anyone_can_write_to_is_refused_naming_it() {
        let (_tmp, shared, d) = below_shared(0o777);
        let want = writable(&d, &shared, "0777", "group and others");
        // Refused before anything is made there.
        assert_eq!(refusal(&d), want);
        assert!(
            fs::symlink_metadata(&d).is_err(),
            "the socket folder was made"
        );
        // A private one of ours already there: refused all the same, since whoever can write
        // to its parent can move it away after the check and put their own in its place.
        fs::DirBuilder::new().mode(0o700).create(&d).unwrap();
        assert_eq!(refusal(&d), want);
        // Every ancestor counts, not only the parent.
        let deep = d.join("a/b");
        assert_eq!(
            refusal(&deep),
            writable(&deep, &shared, "0777", "group and others")
        );
        assert!(fs::symlink_metadata(d.join("a")).is_err());
    }

    #[test]
    fn a_socket_folder_in_a_folder_its_group_or_others_can_write_to_is_refused() {
        for (mode, shown, who) in [
            (0o770, "0770", "group"),
            (0o775, "0775", "group"),
            (0o757, "0757", "others"),
        ] {
            let (_tmp, shared, d) = below_shared(mode);
            assert_eq!(refusal(&d), writable(&d, &shared, shown, who));
            fs::DirBuilder::new().mode(0o700).create(&d).unwrap();
            assert_eq!(refusal(&d), writable(&d, &shared, shown, who));
        }
    }

    /// A folder anyone can write to but with the sticky bit, like /tmp (1777): only the owner
    /// of a folder in it (and root) can move or remove it, so ours stays ours.
    #[test]
    fn a_socket_folder_in_a_sticky_folder_like_tmp_is_accepted() {
        let (_tmp, shared, d) = below_shared(0o1777);
        prepare(&d, sys::euid()).unwrap();
        let m = fs::symlink_metadata(&d).unwrap();
        assert_eq!(m.permissions().mode() & 0o7777, 0o700);
        prepare(&d, sys::euid()).unwrap();
        let deep = shared.join("x/y");
        prepare(&deep, sys::euid()).unwrap();
        // A sticky folder only its group can write to: the same.
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o1770)).unwrap();
        prepare(&d, sys::euid()).unwrap();
    }

    /// An ancestor owned by another user than root and us: its owner can do what they like
    /// in it. As root, a folder is given to uid 65534; otherwise (no such folder can be made)
    /// the same rule is seen from another uid, for which our own folders are another user's.
    #[test]
    fn a_socket_folder_in_a_folder_of_another_user_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let theirs = tmp.path().join("theirs");
        fs::create_dir(&theirs).unwrap();
        fs::set_permissions(&theirs, fs::Permissions::from_mode(0o755)).unwrap();
        let d = theirs.join("tms");
        fs::DirBuilder::new().mode(0o700).create(&d).unwrap();
        let me = sys::euid();
        if me == 0 {
            std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
            assert_eq!(
                refusal(&d),
                format!(
                    "refusing the socket folder {}: its ancestor {} belongs to uid 65534, \
                     neither root nor uid 0: its owner could move what is in it away and put \
                     their own in its place",
                    d.display(),
                    theirs.display()
                )
            );
        } else {
            let e = prepare(&d, me + 1).unwrap_err().to_string();
            let want = format!(
                "belongs to uid {me}, neither root nor uid {}: its owner could move what is in \
                 it away and put their own in its place",
                me + 1
            );
            assert!(e.contains("its ancestor") && e.ends_with(&want), "{e}");
        }
    }

    /// Links among the ancestors are followed as the system follows them, each checked on the
    /// way: a link of ours (or root's, like /var/run -> ../run) in a folder we trust is fine;
    /// what it leads to is held to the same rule; a link others own is refused.
    #[test]
    fn links_above_the_socket_folder_are_followed_and_checked() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        // var/run -> ../run, both ours and private.
        for p in ["run", "var"] {
            fs::DirBuilder::new().mode(0o700).create(t.join(p)).unwrap();
        }
        std::os::unix::fs::symlink("../run", t.join("var/run")).unwrap();
        prepare(&t.join("var/run/tms"), sys::euid()).unwrap();
        assert!(fs::symlink_metadata(t.join("run/tms")).unwrap().is_dir());

        // A link of ours into a folder anyone can write to: that folder is named.
        let open = open_folder_holding_a_private_one(t);
        std::os::unix::fs::symlink("open/real", t.join("l")).unwrap();
        let d = t.join("l/tms");
        assert_eq!(refusal(&d), writable(&d, &open, "0777", "group and others"));
        assert!(fs::symlink_metadata(open.join("real/tms")).is_err());

        // A link another user owns, in a sticky folder: they can replace it at any time.
        // Only root can make one.
        if sys::euid() == 0 {
            let link = their_link_in_sticky(t, &t.join("run"));
            let d = link.join("tms");
            assert_eq!(
                refusal(&d),
                format!(
                    "refusing the socket folder {}: its ancestor {} is a symbolic link owned by \
                     uid 65534, neither root nor uid 0: its owner could replace it with a link \
                     to elsewhere",
                    d.display(),
                    link.display()
                )
            );
        }
    }

    /// `t/sticky/link`, a link to `to` owned by uid 65534 in a folder anyone can write to with
    /// the sticky bit (like /tmp): another user's link, which they can point elsewhere at any
    /// time. Only root can make one.
    fn their_link_in_sticky(t: &Path, to: &Path) -> PathBuf {
        let sticky = t.join("sticky");
        fs::create_dir(&sticky).unwrap();
        fs::set_permissions(&sticky, fs::Permissions::from_mode(0o1777)).unwrap();
        let link = sticky.join("link");
        std::os::unix::fs::symlink(to, &link).unwrap();
        std::os::unix::fs::lchown(&link, Some(65534), None).unwrap();
        link
    }

    /// `t/open`, mode 0777, holding `real`, a private folder of ours: `open` is returned.
    fn open_folder_holding_a_private_one(t: &Path) -> PathBuf {
        let open = t.join("open");
        fs::create_dir(&open).unwrap();
        fs::DirBuilder::new()
            .mode(0o700)
            .create(open.join("real"))
            .unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).unwrap();
        open
    }

    /// The socket folder named with a trailing slash (`TMS_SOCKET_DIR=/some/folder/`, which
    /// `socket_dir` keeps as given): the system follows a link at its last name then (`lstat`,
    /// `mkdir`, the bind at `<folder>/<name>`), so the link and where it leads are held to the
    /// ancestors' rule; spelled so, a link into a folder anyone can write to is refused as it
    /// is without the slash.
    #[test]
    fn a_trailing_slash_is_no_way_around_the_rule() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        let open = open_folder_holding_a_private_one(t);
        std::os::unix::fs::symlink(open.join("real"), t.join("l")).unwrap();
        assert!(refusal(&t.join("l")).ends_with("it is a symbolic link"));
        let d = t.join("l").join("");
        assert_eq!(refusal(&d), writable(&d, &open, "0777", "group and others"));
        let d = PathBuf::from(format!("{}/.", t.join("l").display()));
        assert_eq!(refusal(&d), writable(&d, &open, "0777", "group and others"));
        // Another user's link in a sticky folder (like /tmp), to a private folder of ours: they
        // could point it elsewhere at any time. Only root can make one.
        if sys::euid() == 0 {
            fs::DirBuilder::new()
                .mode(0o700)
                .create(t.join("ours"))
                .unwrap();
            let link = their_link_in_sticky(t, &t.join("ours"));
            let d = link.join("");
            assert!(
                refusal(&d).ends_with(&format!(
                    "its ancestor {} is a symbolic link owned by uid 65534, neither root nor uid \
                     0: its owner could replace it with a link to elsewhere",
                    link.display()
                )),
                "{}",
                refusal(&d)
            );
        }
        // A link of ours to a private folder of ours, so spelled: the folder it leads to is used.
        fs::DirBuilder::new()
            .mode(0o700)
            .create(t.join("mine"))
            .unwrap();
        std::os::unix::fs::symlink(t.join("mine"), t.join("m")).unwrap();
        let d = t.join("m").join("");
        prepare(&d, sys::euid()).unwrap();
        let (_l, path) = bind_as(&d, "1.2.sock").unwrap();
        assert_eq!(path, t.join("m/1.2.sock"));
        assert!(fs::symlink_metadata(t.join("mine/1.2.sock")).is_ok());
    }

    /// A server binding its socket again (the same pid after `exec`, or a new process that got
    /// a dead one's pid) while another server sweeps the stale file at that name: the live
    /// socket must never be the one removed. The sweep checks the file between its probe and
    /// its removal, but the new socket can be renamed into place after that check.
    #[test]
    fn a_socket_bound_again_during_a_sweep_is_never_removed() {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let d = tmp("race");
        prepare(&d, sys::euid()).unwrap();
        let name = "2147483100.4026530003.sock";
        let path = d.join(name);
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicU64::new(0));
        let cleaner = {
            let (d, stop, rounds) = (d.clone(), stop.clone(), rounds.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    clean_stale(&d, sys::euid(), "1.1.sock");
                    rounds.fetch_add(1, Ordering::SeqCst);
                }
            })
        };
        let t0 = std::time::Instant::now();
        let (mut tries, mut lost) = (0u64, 0u64);
        while t0.elapsed() < Duration::from_secs(10) && lost == 0 {
            // A stale socket, then one bound again over it.
            drop(bind_as(&d, name).unwrap());
            let (_live, _) = bind_as(&d, name).unwrap();
            // Let every sweep that may have seen the stale file end.
            let r = rounds.load(Ordering::SeqCst);
            while rounds.load(Ordering::SeqCst) < r + 2 {
                std::thread::yield_now();
            }
            tries += 1;
            if !matches!(sys::probe(&path), Probe::Listening) {
                lost += 1;
            }
        }
        stop.store(true, Ordering::SeqCst);
        cleaner.join().unwrap();
        fs::remove_dir_all(&d).unwrap();
        assert_eq!(lost, 0, "a live socket was removed after {tries} rounds");
    }
}
