//! `tmsctl clean`: remove what processes that died left behind: disk backup files no live
//! process holds, and control sockets nobody listens on. The disk backup folder is swept by the
//! library's own rules and code (`tms_disk_folder`; Note [The disk backup folder] in
//! `preload/src/backup/disk.rs`): only regular files of ours are opened, never following a
//! link and never waiting; a file is stale only when its `flock` can be taken. A socket is stale
//! only when connecting to it is refused.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::AT_FDCWD;
use nix::sys::stat::fstat;
use serde_json::json;
use tms_disk_folder::{
    files_go_in_directory, open_folder, open_private_subfolder, private_subfolder_name, sweep,
    SubfolderError,
};

use crate::cli::CleanArgs;
use crate::ctx::Ctx;
use crate::failure::{Code, Failure};
use crate::folder::Folder;
use crate::output::print_json;
use crate::procfs::euid;
use crate::socket::nobody_listens;
use crate::text::shown_path;

/// The folders to sweep: `base` if nobody else can make entries in it, else our subfolder of it
/// (if there is one) and, for files of older versions, `base` itself.
fn backup_folders(base: &Path) -> Result<Vec<(PathBuf, OwnedFd)>, Failure> {
    let me = euid();
    let fd = match open_folder(AT_FDCWD, base, true) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(Vec::new()),
        Err(e) => {
            return Err(Failure::new(
                Code::Failed,
                format!(
                    "cannot open the disk backup folder {}: {}",
                    shown_path(base),
                    e.desc()
                ),
            ))
        }
    };
    let st = fstat(&fd).map_err(|e| {
        Failure::new(
            Code::Failed,
            format!("cannot inspect {}: {}", shown_path(base), e.desc()),
        )
    })?;
    if files_go_in_directory(st.st_uid, st.st_mode, me) {
        return Ok(vec![(base.to_path_buf(), fd)]);
    }
    let sub = base.join(private_subfolder_name(me));
    let mut out = Vec::new();
    match open_private_subfolder(&fd, me, false) {
        Ok(Some(s)) => out.push((sub, s.fd)),
        Ok(None) => {}
        Err(SubfolderError::Io { op, errno }) => {
            return Err(Failure::new(
                Code::Failed,
                format!("{op} {}: {}", shown_path(&sub), errno.desc()),
            ))
        }
        Err(why) => {
            return Err(Failure::new(
                Code::Permission,
                format!(
                    "refusing {}: {why} (remove it, or choose another folder with --disk-dir)",
                    shown_path(&sub)
                ),
            ))
        }
    }
    out.push((base.to_path_buf(), fd));
    Ok(out)
}

/// Remove the sockets of the (vetted) socket folder that nobody listens on; how many.
fn clean_sockets(folder: &Folder) -> usize {
    let me = euid();
    let mut removed = 0;
    for s in &folder.sockets {
        let Ok(m) = std::fs::symlink_metadata(&s.path) else {
            continue;
        };
        if !m.file_type().is_socket() || m.uid() != me || !nobody_listens(&s.path) {
            continue;
        }
        // Moved aside and probed again there: never a new server's, bound since.
        let (Some(dir), Some(name)) = (s.path.parent(), s.path.file_name()) else {
            continue;
        };
        let Some(name) = name.to_str() else { continue };
        if tms_proto::remove_if_stale(dir, name, nobody_listens).unwrap_or(false) {
            removed += 1;
        }
    }
    removed
}

/// `tmsctl clean`.
pub fn run(ctx: &Ctx, a: &CleanArgs) -> anyhow::Result<()> {
    let base = a
        .disk_dir
        .clone()
        .or_else(|| {
            std::env::var_os("TMS_DISK_BACKUP_DIR")
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(std::env::temp_dir);
    // Vetted before anything is removed: a refusal (exit 4) then means nothing was done, rather
    // than a sweep of the disk folder that no output would tell.
    let folder = Folder::open(&ctx.dir)?;
    let mut files = 0;
    let mut swept = Vec::new();
    for (path, fd) in backup_folders(&base)? {
        files += sweep(fd.as_fd()).map_err(|e| {
            Failure::new(
                Code::Failed,
                format!("cannot list {}: {}", shown_path(&path), e.desc()),
            )
        })?;
        swept.push(path);
    }
    let sockets = clean_sockets(&folder);
    if ctx.json {
        // Paths as text (serde refuses a path that is not UTF-8, and `json!` would panic).
        let swept: Vec<_> = swept.iter().map(|p| p.to_string_lossy()).collect();
        let j = json!({
            "disk_folders": swept,
            "backup_files_removed": files,
            "socket_dir": ctx.dir.to_string_lossy(),
            "sockets_removed": sockets,
        });
        print_json(j);
    } else {
        let where_: Vec<String> = swept.iter().map(|p| shown_path(p)).collect();
        say!(
            "removed {files} disk backup file{} of processes that died ({})",
            if files == 1 { "" } else { "s" },
            if where_.is_empty() {
                format!("no folder {}", shown_path(&base))
            } else {
                where_.join(", ")
            }
        );
        say!(
            "removed {sockets} control socket{} nobody listens on ({})",
            if sockets == 1 { "" } else { "s" },
            shown_path(&ctx.dir)
        );
    }
    Ok(())
}
