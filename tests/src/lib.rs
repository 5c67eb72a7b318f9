//! Helpers for the integration tests in `tests/tests/`.
//!
//! The tests run real processes with `LD_PRELOAD=libtms.so` on the simulated device. The C
//! programs they run are built by `tests/build.rs`; `libtms.so` is the workspace's own build
//! output, found next to the test executable (`target/<profile>/`).

use std::collections::BTreeSet;
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The fake CUDA runtime (`libcudart.so`) built by `build.rs`.
pub const FAKE_CUDART: &str = env!("TMS_TEST_FAKE_CUDART");
/// The end-to-end C program built by `build.rs`.
pub const E2E_PROG: &str = env!("TMS_TEST_E2E_PROG");
/// The HIP end-to-end C program built by `build.rs`, linked against the HIP test double.
pub const E2E_HIP: &str = env!("TMS_TEST_E2E_HIP");
/// The folder `build.rs` wrote into.
pub const BUILD_OUT_DIR: &str = env!("TMS_TEST_OUT_DIR");

/// How long any child process may run before the test kills it and fails.
pub const CHILD_TIMEOUT: Duration = Duration::from_secs(30);

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// `preload/include/tms.h`.
pub fn header_path() -> PathBuf {
    workspace_root().join("preload/include/tms.h")
}

/// `target/<profile>/`: the parent of the `deps/` folder holding the test executable.
pub fn target_profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("the test executable has a folder");
    let dir = if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().expect("deps/ has a parent")
    } else {
        deps
    };
    dir.to_path_buf()
}

/// `target/<profile>/libtms.so`; panics with what to do when it has not been built.
pub fn libtms() -> PathBuf {
    let so = target_profile_dir().join("libtms.so");
    assert!(
        so.is_file(),
        "{} does not exist: run `cargo build -p tms` (same profile as the tests) first",
        so.display()
    );
    so
}

/// What a finished child process did.
#[derive(Debug)]
pub struct Run {
    /// What was run, for messages.
    pub what: String,
    /// Its pid.
    pub pid: u32,
    /// Its exit status.
    pub status: ExitStatus,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

impl Run {
    /// Everything, for assertion messages.
    pub fn dump(&self) -> String {
        format!(
            "{}: {}\n--- stdout ---\n{}--- stderr ---\n{}--------------",
            self.what, self.status, self.stdout, self.stderr
        )
    }

    /// Lines of stdout starting with `prefix` followed by a space, with the prefix removed.
    pub fn tagged<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.stdout
            .lines()
            .filter_map(move |l| l.strip_prefix(prefix)?.strip_prefix(' '))
    }

    /// The payload of the one `<kind> <label> <payload>` line of stdout.
    pub fn labelled(&self, kind: &str, label: &str) -> String {
        let found: Vec<&str> = self
            .tagged(kind)
            .filter_map(|l| l.strip_prefix(label)?.strip_prefix(' '))
            .collect();
        assert_eq!(
            found.len(),
            1,
            "expected exactly one `{kind} {label}` line\n{}",
            self.dump()
        );
        found[0].to_string()
    }

    /// The JSON printed as `STATS <label> {...}`.
    pub fn stats(&self, label: &str) -> serde_json::Value {
        let s = self.labelled("STATS", label);
        serde_json::from_str(&s).unwrap_or_else(|e| panic!("STATS {label}: {e}: {s}"))
    }

    /// The JSON printed as `REGION <label> {...}`.
    pub fn region(&self, label: &str) -> serde_json::Value {
        let s = self.labelled("REGION", label);
        serde_json::from_str(&s).unwrap_or_else(|e| panic!("REGION {label}: {e}: {s}"))
    }

    /// The message printed as `ERROR <label> ...`.
    pub fn error(&self, label: &str) -> String {
        self.labelled("ERROR", label)
    }

    /// The check lines that failed.
    pub fn failed_checks(&self) -> Vec<&str> {
        self.stdout
            .lines()
            .filter(|l| l.starts_with("FAIL"))
            .collect()
    }

    /// The C program ran `mode` to the end with every check passing, exit status 0.
    pub fn assert_passed(&self, mode: &str) {
        assert!(
            self.failed_checks().is_empty(),
            "failed checks: {:#?}\n{}",
            self.failed_checks(),
            self.dump()
        );
        assert!(
            self.stdout
                .lines()
                .any(|l| l == format!("RESULT: PASS {mode}")),
            "no `RESULT: PASS {mode}` line\n{}",
            self.dump()
        );
        assert!(
            self.status.success(),
            "exit status is not 0\n{}",
            self.dump()
        );
        assert!(
            self.stdout
                .lines()
                .filter(|l| l.starts_with("PASS"))
                .count()
                >= 3,
            "too few checks ran\n{}",
            self.dump()
        );
    }

    /// The terminating signal, if any.
    pub fn signal(&self) -> Option<i32> {
        self.status.signal()
    }
}

/// Remove every inherited `TMS_*` variable and `LD_PRELOAD`, so the developer's shell cannot
/// change what a test sees.
pub fn scrub_env(cmd: &mut Command) {
    for (k, _) in std::env::vars_os() {
        if k.to_str()
            .is_some_and(|k| k.starts_with("TMS_") || k == "LD_PRELOAD")
        {
            cmd.env_remove(&k);
        }
    }
}

/// Run `cmd` to completion (killing it after [`CHILD_TIMEOUT`]), capturing its output.
pub fn run(mut cmd: Command) -> Run {
    let what = format!("{cmd:?}");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let pid = child.id();
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let out_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + CHILD_TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within {CHILD_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let stdout = String::from_utf8_lossy(&out_t.join().expect("stdout reader")).into_owned();
    let stderr = String::from_utf8_lossy(&err_t.join().expect("stderr reader")).into_owned();
    Run {
        what,
        pid,
        status,
        stdout,
        stderr,
    }
}

/// A command for the end-to-end program in `mode`, preloaded with libtms.so on the simulated
/// device (64 MiB, 2 MiB granularity) and nothing else from the environment's `TMS_*`.
pub fn e2e_command(mode: &str) -> Command {
    preloaded_command(Path::new(E2E_PROG), mode)
}

/// A command for the test program `prog` in `mode`, preloaded as [`e2e_command`]'s.
pub fn preloaded_command(prog: &Path, mode: &str) -> Command {
    let mut cmd = Command::new(prog);
    cmd.arg(mode);
    scrub_env(&mut cmd);
    cmd.env("LD_PRELOAD", libtms())
        .env("TMS_BACKEND", "sim")
        .env("TMS_SIM_CAPACITY", "64MiB")
        .env("TMS_SIM_GRANULARITY", "2MiB")
        // The control socket has its own tests (ctl/tests); keep these processes socket-free.
        .env("TMS_CONTROL", "0");
    cmd
}

/// Run the end-to-end program in `mode` with extra environment `env`.
pub fn run_e2e(mode: &str, env: &[(&str, &str)]) -> Run {
    let mut cmd = e2e_command(mode);
    for (k, v) in env {
        cmd.env(k, v);
    }
    run(cmd)
}

/// The names of the functions `libtms.so` exports (defined dynamic symbols), from `nm -D`.
pub fn exported_functions(so: &Path) -> BTreeSet<String> {
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(so)
        .output()
        .unwrap_or_else(|e| panic!("cannot run nm (binutils) on {}: {e}", so.display()));
    assert!(
        out.status.success(),
        "nm -D {} failed: {}",
        so.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace().rev();
            let name = f.next()?;
            let kind = f.next()?;
            // Text symbols: T (global), W (weak), i (indirect).
            matches!(kind, "T" | "W" | "i").then(|| name.to_string())
        })
        .collect()
}

/// C source with comments removed (string literals are not expected in the header).
pub fn strip_c_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.is_none_or(|l| b < l) => {
                out.push_str(&rest[..b]);
                let end = rest[b + 2..]
                    .find("*/")
                    .expect("unterminated comment in C source");
                out.push(' ');
                rest = &rest[b + 2 + end + 2..];
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                rest = rest[l..].find('\n').map_or("", |n| &rest[l + n..]);
            }
            (None, None) => {
                out.push_str(rest);
                return out;
            }
            (Some(_), None) => unreachable!("handled by the first arm"),
        }
    }
}

/// Names of the functions a C header declares: identifiers followed by `(` outside comments
/// and preprocessor lines.
pub fn declared_functions(header: &str) -> BTreeSet<String> {
    let code = strip_c_comments(header);
    let mut names = BTreeSet::new();
    for line in code.lines().filter(|l| !l.trim_start().starts_with('#')) {
        let b = line.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i].is_ascii_alphabetic() || b[i] == b'_' {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                    i += 1;
                }
                let mut j = i;
                while j < b.len() && b[j] == b' ' {
                    j += 1;
                }
                if j < b.len() && b[j] == b'(' {
                    names.insert(line[start..i].to_string());
                }
            } else {
                i += 1;
            }
        }
    }
    names
}

/// `#define NAME VALUE` lines of a header whose name starts with `prefix` and whose value is
/// an integer.
pub fn integer_defines(header: &str, prefix: &str) -> Vec<(String, i64)> {
    strip_c_comments(header)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            (f.next()? == "#define").then_some(())?;
            let name = f.next()?;
            let value = f.next()?.parse::<i64>().ok()?;
            (name.starts_with(prefix) && f.next().is_none()).then(|| (name.to_string(), value))
        })
        .collect()
}

/// A fresh, empty temporary folder.
pub fn temp_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .expect("create a temporary folder")
}

/// The entries of a folder, recursively, as paths relative to it.
pub fn list_tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("read {}: {e}", d.display())) {
            let p = e.expect("dir entry").path();
            if p.is_dir() && !p.is_symlink() {
                stack.push(p.clone());
            }
            out.push(p.strip_prefix(dir).expect("inside").to_path_buf());
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_parsing_helpers() {
        let h = "/* f(x) in a comment */\n#define TMS_A 1 /* c */\n#define TMS_B(x) x\n\
                 int tms_f(void); // tms_g(\nvoid *tms_h (int a,\n  int b);\n#define OTHER 2\n";
        let f: Vec<_> = declared_functions(h).into_iter().collect();
        assert_eq!(f, ["tms_f", "tms_h"]);
        assert_eq!(integer_defines(h, "TMS_"), [("TMS_A".to_string(), 1)]);
    }
}
