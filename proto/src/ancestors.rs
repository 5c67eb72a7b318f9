//! The folders above a socket folder: the rule the server (before it makes or uses its folder)
//! and `tmsctl` (before it looks in one) both apply, so that a folder one of them refuses the
//! other refuses too, in the same words.
//!
//! # Note [The ancestors of the socket folder]
//!
//! Checking the socket folder itself (a real folder, ours, mode 0700) is not enough: whoever
//! can write to a folder above it can rename the checked folder away after the check and put
//! their own (or a link) in its place, so the socket would be bound, and clients would connect,
//! in a folder they control. So every folder above it, up to `/`, must be owned by root or by
//! us, and must not be writable by group or others unless it has the sticky bit (like `/tmp`,
//! mode 1777: there only an entry's owner, the folder's owner and root can rename or remove the
//! entry, so our folder in it stays ours).
//!
//! *Links.* Links among the ancestors are followed as the system follows them (`/var/run ->
//! ../run` is common, and `$XDG_RUNTIME_DIR` or a home folder may be reached through one), one
//! component at a time from `/`, and every folder the path passes through, before or after a
//! link, is held to the rule. A link is followed only if it is owned by root or by us: its
//! folder has already passed the rule, so only root, we, or (in a sticky folder) the link's
//! owner can replace it; a link another user owns in `/tmp` could be pointed elsewhere at any
//! time. A link inside a folder that fails the rule is never reached: the walk stops at that
//! folder. More than 40 links (the system's own limit) is a loop, and refused.
//!
//! *Once true, stays true.* The walk goes down from `/`, and each folder it passes can be
//! changed only by root or us, so the entries in it (the next folder, a link) stay what they
//! were when checked: the socket folder's path cannot be redirected after the check by anyone
//! but root or us. Hence the socket, bound by path (or through `/proc/self/fd/<N>/` for a deep
//! folder, which opens the folder by path too), lands where the check looked.
//!
//! *Missing folders.* The walk stops at the first folder that does not exist: everything
//! below it will be made by the server, inside a folder that passed the rule (the server checks
//! again before each folder it makes, and once more after, so one made meanwhile by someone else
//! is caught).
//!
//! *User namespaces.* In a namespace that maps only some uids (a rootless container, an
//! Apptainer or `unshare -r` sandbox), folders of unmapped owners, host root's `/` and `/usr`
//! among them, show the kernel's overflow uid (65534). Their real owner cannot be known from
//! inside, nor can we change them; they are taken as root's, or the server would stay off in
//! every such sandbox. Outside one, every uid is mapped and 65534 is a user like any other; so
//! it is inside one that maps 65534 itself (rootless Podman's 65536 subordinate uids give the
//! container a real `nobody`), where an unmapped owner cannot be told from that user.
//!
//! *The socket folder itself* is not checked here (the last component of the path: it is not
//! followed if it is a link); its own, stricter rule is its checker's. Unless the path ends in
//! `/` or `/.` (`TMS_SOCKET_DIR=/some/folder/`): then the system follows a link at its last
//! name too (`lstat`, `open` with `O_NOFOLLOW`, `mkdir`, and the socket's path `<dir>/<name>`
//! all resolve it), so that name is on the way like the others, a link there followed only if
//! root's or ours and the folder it leads to held to this rule as well. (`Path::components`
//! drops that ending, so it is read from the path's bytes.)

use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// The most links followed on the way (`MAXSYMLINKS` of Linux).
pub const MAX_LINKS: usize = 40;

/// A folder above a socket folder that others could change ([`check_ancestors`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnsafeAncestor {
    /// The ancestor, as reached: the links before it followed.
    pub path: PathBuf,
    /// What is wrong with it.
    pub fault: AncestorFault,
}

/// What is wrong with an ancestor of a socket folder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AncestorFault {
    /// A folder owned by a user who is neither root nor us.
    Owner {
        /// Its owner.
        uid: u32,
        /// Ours.
        ours: u32,
    },
    /// A folder that group or others can write to, without the sticky bit.
    Writable {
        /// Its permission bits (the sticky, setuid and setgid bits included).
        mode: u32,
    },
    /// A symbolic link owned by a user who is neither root nor us.
    LinkOwner {
        /// Its owner.
        uid: u32,
        /// Ours.
        ours: u32,
    },
    /// Neither a folder nor a link.
    NotAFolder,
    /// More than [`MAX_LINKS`] links on the way to it (a loop).
    TooManyLinks,
    /// It could not be inspected (`lstat` or `readlink` failed with this errno).
    Uninspectable {
        /// The system's error number.
        errno: i32,
    },
}

impl fmt::Display for AncestorFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SWAP: &str = "move what is in it away and put their own in its place";
        match *self {
            AncestorFault::Owner { uid, ours } => write!(
                f,
                "belongs to uid {uid}, neither root nor uid {ours}: its owner could {SWAP}"
            ),
            AncestorFault::Writable { mode } => {
                let who = match (mode & 0o020 != 0, mode & 0o002 != 0) {
                    (true, true) => "group and others",
                    (true, false) => "group",
                    _ => "others",
                };
                write!(
                    f,
                    "has mode {mode:04o}: {who} can write to it without the sticky bit, so they \
                     could {SWAP}"
                )
            }
            AncestorFault::LinkOwner { uid, ours } => write!(
                f,
                "is a symbolic link owned by uid {uid}, neither root nor uid {ours}: its owner \
                 could replace it with a link to elsewhere"
            ),
            AncestorFault::NotAFolder => f.write_str("is not a folder"),
            AncestorFault::TooManyLinks => write!(
                f,
                "is reached through more than {MAX_LINKS} symbolic links (a loop)"
            ),
            AncestorFault::Uninspectable { errno } => write!(
                f,
                "cannot be inspected: {}",
                io::Error::from_raw_os_error(errno)
            ),
        }
    }
}

impl fmt::Display for UnsafeAncestor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "its ancestor {} {}", self.path.display(), self.fault)
    }
}

impl std::error::Error for UnsafeAncestor {}

fn uninspectable(e: &io::Error) -> AncestorFault {
    AncestorFault::Uninspectable {
        errno: e.raw_os_error().unwrap_or(libc::EIO),
    }
}

/// One step of a path walked as the system walks it.
enum Step {
    Root,
    Up,
    Name(OsString),
}

/// The steps of `p`, last first (to be popped).
fn steps_reversed(p: &Path) -> Vec<Step> {
    let mut v: Vec<Step> = p
        .components()
        .filter_map(|c| match c {
            Component::RootDir => Some(Step::Root),
            Component::ParentDir => Some(Step::Up),
            Component::Normal(n) => Some(Step::Name(n.to_os_string())),
            Component::CurDir | Component::Prefix(_) => None,
        })
        .collect();
    v.reverse();
    v
}

/// Check every folder above the socket folder `dir` (a relative one is taken from the working
/// directory), up to `/`, for a process of effective uid `uid`: see Note [The ancestors of the
/// socket folder]. `Ok` also where a folder on the way does not exist yet (what is below it is
/// for the server to make). `dir` itself is not checked, nor followed if it is a link, unless
/// it ends in `/` or `/.`, which makes the system follow it (then it is checked as the others).
pub fn check_ancestors(dir: &Path, uid: u32) -> Result<(), UnsafeAncestor> {
    let refuse = |path: &Path, fault| {
        Err(UnsafeAncestor {
            path: path.to_path_buf(),
            fault,
        })
    };
    let dir = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        match std::env::current_dir() {
            Ok(cwd) => cwd.join(dir),
            Err(e) => return refuse(Path::new("."), uninspectable(&e)),
        }
    };
    // The system follows a link at the last name of a path ending in `/` or `/.`: that name
    // is then on the way, not the socket folder's own (the Note, *The socket folder itself*).
    let last_followed = {
        let b = dir.as_os_str().as_bytes();
        b.ends_with(b"/") || b.ends_with(b"/.")
    };
    let unmapped = unmapped_owner();
    let trusted = |owner: u32| owner == 0 || owner == uid || Some(owner) == unmapped;
    let mut todo = steps_reversed(&dir);
    // Where the walk is: a real path (no link in it), every folder of which passed the rule.
    let mut at = PathBuf::from("/");
    let mut links = 0;
    while let Some(step) = todo.pop() {
        let path = match step {
            Step::Up => {
                at.pop();
                continue;
            }
            Step::Root => PathBuf::from("/"),
            // The socket folder itself: its own rule is its checker's.
            Step::Name(_) if todo.is_empty() && !last_followed => break,
            Step::Name(name) => at.join(name),
        };
        let m = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return refuse(&path, uninspectable(&e)),
        };
        if m.file_type().is_symlink() {
            if !trusted(m.uid()) {
                return refuse(
                    &path,
                    AncestorFault::LinkOwner {
                        uid: m.uid(),
                        ours: uid,
                    },
                );
            }
            links += 1;
            if links > MAX_LINKS {
                return refuse(&path, AncestorFault::TooManyLinks);
            }
            let target = match fs::read_link(&path) {
                Ok(t) => t,
                Err(e) => return refuse(&path, uninspectable(&e)),
            };
            // Relative to the link's folder (`at`), or from `/` (its first step resets `at`).
            todo.extend(steps_reversed(&target));
            continue;
        }
        if !m.is_dir() {
            return refuse(&path, AncestorFault::NotAFolder);
        }
        if !trusted(m.uid()) {
            return refuse(
                &path,
                AncestorFault::Owner {
                    uid: m.uid(),
                    ours: uid,
                },
            );
        }
        let mode = m.permissions().mode() & 0o7777;
        if mode & 0o022 != 0 && mode & 0o1000 == 0 {
            return refuse(&path, AncestorFault::Writable { mode });
        }
        at = path;
    }
    Ok(())
}

/// The owner the kernel shows for folders whose owner our user namespace does not map, where
/// it maps only some uids; `None` where every uid is mapped (the initial namespace). See
/// Note [The ancestors of the socket folder], *User namespaces*.
fn unmapped_owner() -> Option<u32> {
    let map = fs::read_to_string("/proc/self/uid_map").ok()?;
    let overflow = fs::read_to_string("/proc/sys/kernel/overflowuid").ok()?;
    unmapped_owner_in(&map, &overflow)
}

/// [`unmapped_owner`] from the text of `/proc/self/uid_map` and of
/// `/proc/sys/kernel/overflowuid`.
fn unmapped_owner_in(uid_map: &str, overflowuid: &str) -> Option<u32> {
    // Each line: first uid inside, first uid outside, count.
    let ranges: Vec<(u64, u64)> = uid_map
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace().map(|n| n.parse::<u64>().ok());
            let inside = f.next()??;
            let count = f.nth(1)??;
            Some((inside, count))
        })
        .collect();
    let mapped: u64 = ranges.iter().map(|&(_, count)| count).sum();
    if mapped >= u64::from(u32::MAX) {
        return None;
    }
    let overflow: u32 = overflowuid.trim().parse().ok()?;
    // Where the overflow uid is itself mapped (rootless Podman's usual map, 65536 subordinate
    // uids, gives the namespace a real `nobody` of uid 65534), a folder showing it may be that
    // user's, which nothing tells from an unmapped owner's: then it is trusted no more than any
    // other user's.
    let o = u64::from(overflow);
    if ranges
        .iter()
        .any(|&(inside, count)| inside <= o && o - inside < count)
    {
        return None;
    }
    Some(overflow)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn the_overflow_uid_is_trusted_only_where_some_uids_are_unmapped() {
        // The initial namespace maps every uid: 65534 is a real user there.
        assert_eq!(
            unmapped_owner_in("         0          0 4294967295\n", "65534\n"),
            None
        );
        // A sandbox mapping only the user (and maybe a subordinate range).
        assert_eq!(
            unmapped_owner_in("      1000       1000          1\n", "65534\n"),
            Some(65534)
        );
        assert_eq!(
            unmapped_owner_in("0 1000 1\n1 100000 1000\n", "65534"),
            Some(65534)
        );
        // A namespace that maps the overflow uid itself (rootless Podman's usual map, 65536
        // subordinate uids, gives the container a `nobody` of uid 65534): a folder showing
        // 65534 may be that real user's, which cannot be told from an unmapped owner's, so
        // it is trusted no more than any other user's.
        assert_eq!(unmapped_owner_in("0 100000 65536\n", "65534\n"), None);
        assert_eq!(
            unmapped_owner_in("0 1000 1\n1 100000 65536\n", "65534"),
            None
        );
        assert_eq!(
            unmapped_owner_in("0 1000 1\n1 100000 65536\n", "65533"),
            None
        );
        // Unreadable numbers: nothing more is trusted.
        assert_eq!(unmapped_owner_in("0 1000 1\n", "x"), None);
        // This machine's own view agrees with its uid_map.
        let map = fs::read_to_string("/proc/self/uid_map").unwrap();
        assert_eq!(
            unmapped_owner().is_none(),
            map.split_whitespace().nth(2) == Some("4294967295")
        );
    }

    /// Our uid, as the files we make show it.
    fn me(t: &Path) -> u32 {
        fs::metadata(t).unwrap().uid()
    }

    fn mkdir(p: &Path, mode: u32) {
        fs::create_dir(p).unwrap();
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn every_folder_above_counts_and_the_folder_itself_does_not() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        let uid = me(t);
        mkdir(&t.join("a"), 0o755);
        mkdir(&t.join("a/b"), 0o700);
        // The folder itself may be anything: its own rule is elsewhere.
        mkdir(&t.join("a/b/open"), 0o777);
        check_ancestors(&t.join("a/b/open"), uid).unwrap();
        // Missing folders: fine, the walk stops there.
        check_ancestors(&t.join("a/b/c/d/e"), uid).unwrap();
        fs::set_permissions(t.join("a"), fs::Permissions::from_mode(0o775)).unwrap();
        let want = UnsafeAncestor {
            path: t.join("a"),
            fault: AncestorFault::Writable { mode: 0o775 },
        };
        assert_eq!(check_ancestors(&t.join("a/b/c"), uid), Err(want.clone()));
        // A missing folder below an unsafe one: still refused.
        assert_eq!(
            check_ancestors(&t.join("a/b/c/d/e"), uid),
            Err(want.clone())
        );
        // `..` goes up from where the walk is.
        mkdir(&t.join("ok"), 0o700);
        assert_eq!(check_ancestors(&t.join("ok/../a/b/c"), uid), Err(want));
        fs::set_permissions(t.join("a"), fs::Permissions::from_mode(0o1777)).unwrap();
        check_ancestors(&t.join("a/b/c"), uid).unwrap();
        // A file on the way.
        fs::write(t.join("f"), b"").unwrap();
        assert_eq!(
            check_ancestors(&t.join("f/x"), uid).unwrap_err().fault,
            AncestorFault::NotAFolder
        );
    }

    #[test]
    fn links_are_followed_from_where_they_are_and_loops_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        let uid = me(t);
        mkdir(&t.join("run"), 0o755);
        mkdir(&t.join("var"), 0o755);
        symlink("../run", t.join("var/run")).unwrap();
        check_ancestors(&t.join("var/run/tms"), uid).unwrap();
        // The link itself as the socket folder: not followed (its checker refuses it).
        mkdir(&t.join("open"), 0o777);
        symlink(t.join("open"), t.join("l")).unwrap();
        check_ancestors(&t.join("l"), uid).unwrap();
        // Through it: the folder it leads to is named, as reached.
        assert_eq!(
            check_ancestors(&t.join("l/tms"), uid),
            Err(UnsafeAncestor {
                path: t.join("open"),
                fault: AncestorFault::Writable { mode: 0o777 }
            })
        );
        // A loop.
        symlink("y", t.join("x")).unwrap();
        symlink("x", t.join("y")).unwrap();
        assert_eq!(
            check_ancestors(&t.join("x/tms"), uid).unwrap_err().fault,
            AncestorFault::TooManyLinks
        );
        // Messages.
        let e = check_ancestors(&t.join("l/tms"), uid).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "its ancestor {} has mode 0777: group and others can write to it without the \
                 sticky bit, so they could move what is in it away and put their own in its place",
                t.join("open").display()
            )
        );
    }

    /// Ours and root's are trusted; anyone else's is not. Seen from another uid (`uid + 1`),
    /// our folders are another user's; as root, a folder and a link are given to uid 65534.
    #[test]
    fn owners_other_than_root_and_us_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        let uid = me(t);
        mkdir(&t.join("a"), 0o755);
        if uid != 0 {
            let e = check_ancestors(&t.join("a/tms"), uid + 1).unwrap_err();
            assert_eq!(e.fault, AncestorFault::Owner { uid, ours: uid + 1 });
            return;
        }
        std::os::unix::fs::chown(t.join("a"), Some(65534), None).unwrap();
        assert_eq!(
            check_ancestors(&t.join("a/tms"), 0),
            Err(UnsafeAncestor {
                path: t.join("a"),
                fault: AncestorFault::Owner {
                    uid: 65534,
                    ours: 0
                }
            })
        );
        mkdir(&t.join("s"), 0o1777);
        mkdir(&t.join("b"), 0o700);
        symlink(t.join("b"), t.join("s/l")).unwrap();
        check_ancestors(&t.join("s/l/tms"), 0).unwrap();
        std::os::unix::fs::lchown(t.join("s/l"), Some(65534), None).unwrap();
        assert_eq!(
            check_ancestors(&t.join("s/l/tms"), 0),
            Err(UnsafeAncestor {
                path: t.join("s/l"),
                fault: AncestorFault::LinkOwner {
                    uid: 65534,
                    ours: 0
                }
            })
        );
    }

    /// A path ending in `/` or `/.` makes the system follow a link at its last name (`lstat`,
    /// `open` with `O_NOFOLLOW`, `mkdir`, a socket bound at `<path>/<name>` all resolve it), so
    /// that link, and where it leads, are on the way and held to the rule like any other.
    #[test]
    fn a_trailing_slash_or_dot_makes_the_last_link_one_on_the_way() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        let uid = me(t);
        mkdir(&t.join("open"), 0o777);
        mkdir(&t.join("open/real"), 0o700);
        symlink(t.join("open/real"), t.join("l")).unwrap();
        symlink("l", t.join("l2")).unwrap();
        // Without: `l` is the socket folder itself, not followed (its checker refuses a link).
        check_ancestors(&t.join("l"), uid).unwrap();
        let want = Err(UnsafeAncestor {
            path: t.join("open"),
            fault: AncestorFault::Writable { mode: 0o777 },
        });
        let l = t.join("l").into_os_string().into_string().unwrap();
        for p in [
            format!("{l}/"),
            format!("{l}//"),
            format!("{l}/."),
            format!("{l}/./"),
            format!("{l}2/"),
        ] {
            assert_eq!(check_ancestors(Path::new(&p), uid), want, "{p}");
        }
        // A link of ours to a folder of ours, so spelled: fine.
        mkdir(&t.join("mine"), 0o700);
        symlink(t.join("mine"), t.join("m")).unwrap();
        check_ancestors(&t.join("m").join(""), uid).unwrap();
        // `/` itself stays fine.
        check_ancestors(Path::new("/"), uid).unwrap();
    }

    /// The folders a real system gives: `/tmp` (1777) and `/` are fine for anyone.
    #[test]
    fn the_usual_places_pass() {
        let uid = me(&std::env::temp_dir());
        check_ancestors(Path::new("/tmp/tms-1000"), uid).unwrap();
        check_ancestors(Path::new("/tmp/tms-1000/x/y"), uid).unwrap();
    }
}
