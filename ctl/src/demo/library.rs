//! Where `tmsctl demo` finds the library to preload.

use std::path::{Path, PathBuf};

use crate::failure::{Code, Failure};
use crate::text::printable;

/// Where `tmsctl demo` looks for the library when no `--lib` is given, in order: `$TMS_LIB`,
/// then beside this executable (`bin/`) and below its parent (`prefix`): a build tree
/// (`target/release/`), an install prefix (`../lib`), a virtual environment or `--user`
/// install (`../lib/python3*/site-packages/`) and `pip install --target DIR` (`DIR/bin/tmsctl`,
/// `DIR/torch_memory_saver/`). The Python package holds the library as `libtms*.so`
/// (`libtms.abi3.so`) and, beside the package, under the existing library's names. Entries with
/// `*` are patterns: one `*` per path component.
fn lib_candidates(exe_dir: &Path) -> Vec<PathBuf> {
    let prefix = exe_dir.parent().unwrap_or(exe_dir);
    let mut c = vec![exe_dir.join("libtms.so"), prefix.join("lib/libtms.so")];
    for base in ["lib/python3*/*-packages", ""] {
        let base = if base.is_empty() {
            prefix.to_path_buf()
        } else {
            prefix.join(base)
        };
        c.push(base.join("torch_memory_saver/libtms*.so"));
        c.push(base.join("torch_memory_saver_hook_mode_preload*.so"));
    }
    c
}

/// The files a candidate of [`lib_candidates`] names, by name (none, or itself, without `*`).
fn expand(pattern: &Path) -> Vec<PathBuf> {
    let mut found = vec![PathBuf::new()];
    for part in pattern.components() {
        let part = part.as_os_str();
        let Some((head, tail)) = part.to_str().and_then(|p| p.split_once('*')) else {
            for f in &mut found {
                f.push(part);
            }
            continue;
        };
        let mut next = Vec::new();
        for dir in &found {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            let mut names: Vec<String> = entries
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| {
                    n.len() >= head.len() + tail.len() && n.starts_with(head) && n.ends_with(tail)
                })
                .collect();
            names.sort();
            next.extend(names.into_iter().map(|n| dir.join(n)));
        }
        found = next;
    }
    found.retain(|f| f.is_file());
    found
}

pub(super) fn find_lib(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    // (path, a pattern): --lib and $TMS_LIB are taken as they are.
    let mut candidates: Vec<(PathBuf, bool)> = Vec::new();
    if let Some(p) = explicit {
        candidates.push((p.to_path_buf(), false));
    } else {
        if let Some(p) = std::env::var_os("TMS_LIB").filter(|p| !p.is_empty()) {
            candidates.push((PathBuf::from(p), false));
        }
        if let Some(dir) = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf))
        {
            candidates.extend(lib_candidates(&dir).into_iter().map(|c| (c, true)));
        }
    }
    let mut tried = Vec::new();
    for (c, pattern) in candidates {
        let found = if pattern {
            expand(&c).into_iter().next()
        } else {
            c.is_file().then(|| c.clone())
        };
        if let Some(found) = found {
            return Ok(std::fs::canonicalize(&found).unwrap_or(found));
        }
        tried.push(printable(&c.display().to_string()).into_owned());
    }
    Err(Failure::new(
        Code::Failed,
        format!(
            "cannot find libtms.so (tried {}): pass --lib PATH or set TMS_LIB",
            tried.join(", ")
        ),
    )
    .into())
}
