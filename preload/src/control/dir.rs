//! The socket folder and the socket file: created private, checked before use, cleaned of the
//! sockets of processes that died without removing theirs.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use super::sys;

/// Create `dir` (mode 0700) if it does not exist, then check it is a real folder (not a
/// symlink), owned by `uid`, that nobody else can enter or list.
pub fn prepare(dir: &Path, uid: u32) -> Result<(), String> {
    let shown = dir.display();
    match fs::symlink_metadata(dir) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| format!("cannot create the socket folder {shown}: {e}"))?;
        }
        Err(e) => return Err(format!("cannot inspect the socket folder {shown}: {e}")),
    }
    let m = fs::symlink_metadata(dir)
        .map_err(|e| format!("cannot inspect the socket folder {shown}: {e}"))?;
    verify(&m, uid).map_err(|why| format!("refusing the socket folder {shown}: {why}"))
}

/// The rule [`prepare`] applies to the folder's metadata (from `lstat`).
pub fn verify(m: &fs::Metadata, uid: u32) -> Result<(), String> {
    if m.file_type().is_symlink() {
        return Err("it is a symbolic link".into());
    }
    if !m.is_dir() {
        return Err("it is not a folder".into());
    }
    if m.uid() != uid {
        return Err(format!("it belongs to uid {}, not {uid}", m.uid()));
    }
    let mode = m.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "its mode is {mode:04o}: group or others have access (want 0700)"
        ));
    }
    if mode & 0o700 != 0o700 {
        return Err(format!(
            "its mode is {mode:04o}: the owner cannot use it (want 0700)"
        ));
    }
    Ok(())
}

/// Listen on `<dir>/<pid>.sock`, mode 0600. The socket is bound under a temporary name,
/// restricted, then renamed into place, so no client ever sees it with a wider mode. A socket
/// of the same name can only be left over from this pid before an `exec` (another live process
/// has another pid), so it is replaced.
pub fn bind(dir: &Path, pid: u32) -> Result<(UnixListener, PathBuf), String> {
    let path = dir.join(tms_proto::socket_file_name(pid));
    let tmp = dir.join(format!(".{pid}.sock.tmp"));
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("cannot remove {}: {e}", tmp.display())),
    }
    let listener =
        UnixListener::bind(&tmp).map_err(|e| format!("cannot listen on {}: {e}", tmp.display()))?;
    let placed = fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("cannot restrict {}: {e}", tmp.display()))
        .and_then(|_| {
            fs::rename(&tmp, &path)
                .map_err(|e| format!("cannot rename {} to {}: {e}", tmp.display(), path.display()))
        });
    if let Err(e) = placed {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok((listener, path))
}

/// Remove the sockets (and temporary names) of processes that no longer exist; returns how
/// many. Only sockets owned by `uid` are touched; our own (`our_pid`) never.
pub fn clean_stale(dir: &Path, uid: u32, our_pid: u32) -> usize {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let pid = tms_proto::pid_of_socket_file(name).or_else(|| {
            name.strip_prefix('.')
                .and_then(|n| n.strip_suffix(".tmp"))
                .and_then(tms_proto::pid_of_socket_file)
        });
        let Some(pid) = pid else { continue };
        if pid == our_pid || sys::pid_alive(pid) {
            continue;
        }
        let Ok(m) = fs::symlink_metadata(entry.path()) else {
            continue;
        };
        if !m.file_type().is_socket() || m.uid() != uid {
            continue;
        }
        match fs::remove_file(entry.path()) {
            Ok(()) => {
                tracing::debug!(
                    "removed the stale control socket {}",
                    entry.path().display()
                );
                removed += 1;
            }
            Err(e) => tracing::debug!("removing {}: {e}", entry.path().display()),
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
        let e = prepare(&open, sys::euid()).unwrap_err();
        assert!(e.contains("0755") && e.contains("refusing"), "{e}");

        let e = prepare(&open, sys::euid().wrapping_add(1)).unwrap_err();
        assert!(e.contains("belongs to uid"), "{e}");

        let link = base.join("link");
        let private = base.join("private");
        fs::DirBuilder::new().mode(0o700).create(&private).unwrap();
        std::os::unix::fs::symlink(&private, &link).unwrap();
        let e = prepare(&link, sys::euid()).unwrap_err();
        assert!(e.contains("symbolic link"), "{e}");

        let file = base.join("file");
        fs::write(&file, b"").unwrap();
        assert!(prepare(&file, sys::euid())
            .unwrap_err()
            .contains("not a folder"));
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn binds_0600_and_cleans_only_dead_sockets() {
        let d = tmp("bind");
        prepare(&d, sys::euid()).unwrap();
        let me = std::process::id();
        let (_l, path) = bind(&d, me).unwrap();
        assert_eq!(path, d.join(format!("{me}.sock")));
        let m = fs::symlink_metadata(&path).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!(m.permissions().mode() & 0o777, 0o600);

        // A dead process's socket and temporary name, a live process's socket, and a file
        // that is not a socket.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let (l1, dead_path) = bind(&d, dead).unwrap();
        drop(l1);
        let dead_tmp = d.join(format!(".{dead}.sock.tmp"));
        drop(UnixListener::bind(&dead_tmp).unwrap());
        let live = d.join("1.sock");
        drop(UnixListener::bind(&live).unwrap());
        let not_socket = d.join(format!("{}.sock", dead + 1_000_000));
        fs::write(&not_socket, b"").unwrap();

        assert_eq!(clean_stale(&d, sys::euid(), me), 2);
        assert!(!dead_path.exists() && !dead_tmp.exists());
        assert!(path.exists() && live.exists() && not_socket.exists());

        // A folder whose socket path would not fit in sun_path: an error, not a panic.
        let long = d.join("x".repeat(120));
        prepare(&long, sys::euid()).unwrap();
        assert!(bind(&long, me).unwrap_err().contains("cannot listen"));

        // Binding again (same pid, as after exec) replaces the old socket.
        let (_l2, again) = bind(&d, me).unwrap();
        assert_eq!(again, path);
        fs::remove_dir_all(&d).unwrap();
    }
}
