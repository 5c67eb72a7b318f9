//! Records the git commit the workspace is built from, for `tmsctl --version` and libtms.so's
//! `tms_build_info()` ([`BUILD_COMMIT`](../src/lib.rs)): `git rev-parse --short HEAD` where the
//! workspace is a git checkout (a `.git` beside its Cargo.toml), else `$TMS_BUILD_COMMIT` (an
//! sdist has no `.git`: scripts/wheel passes the commit so), else `unknown`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=TMS_BUILD_COMMIT");
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from);
    let root = manifest.as_deref().and_then(Path::parent);
    let commit = root
        .and_then(from_git)
        .or_else(|| std::env::var("TMS_BUILD_COMMIT").ok().filter(|c| plain(c)))
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=TMS_BUILD_COMMIT_ID={commit}");
}

/// A commit as it may appear in a version line: short, and no character that needs quoting.
fn plain(c: &str) -> bool {
    !c.is_empty()
        && c.len() <= 64
        && c.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._+-".contains(&b))
}

fn git(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}

/// The short commit of the checkout at `root`, if `root` is one (only its own `.git`: a
/// source tree unpacked inside another repository is not that repository's commit).
fn from_git(root: &Path) -> Option<String> {
    if !root.join(".git").exists() {
        return None;
    }
    let commit = git(root, &["rev-parse", "--short", "HEAD"]).filter(|c| plain(c))?;
    // Built again when HEAD moves: HEAD itself, the branch it names, and the packed refs
    // (paths that exist only: cargo runs a build script every time for one that does not).
    let mut watched = vec!["HEAD".to_string(), "packed-refs".to_string()];
    watched.extend(git(root, &["symbolic-ref", "-q", "HEAD"]));
    for name in watched {
        if let Some(p) = git(root, &["rev-parse", "--git-path", &name]) {
            let p = root.join(p);
            if p.exists() {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        }
    }
    Some(commit)
}
