//! A stderr that cannot be written (a full disk, `2>/dev/full`; a closed pipe where SIGPIPE is
//! ignored, as Python ignores it) changes nothing the library does: what it says there is lost,
//! never turned into a failed allocation or an aborted process.

use std::process::{Command, Stdio};

use tms_tests::{e2e_command, libtms, scrub_env};

/// Run `cmd` with stderr on `/dev/full` (every write fails with ENOSPC), capturing stdout.
fn run_with_full_stderr(mut cmd: Command) -> (std::process::ExitStatus, String) {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("open /dev/full");
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(full)
        .output()
        .expect("run the program");
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Malformed settings (said once on stderr) leave every cudaMalloc to the CUDA runtime, also
/// when that line cannot be written.
#[test]
fn malformed_settings_pass_through_when_stderr_fails() {
    let mut cmd = e2e_command("malformed");
    cmd.env("TMS_INIT_ENABLE", "maybe");
    let (status, stdout) = run_with_full_stderr(cmd);
    assert!(
        status.success() && stdout.lines().any(|l| l == "RESULT: PASS malformed"),
        "{status}\n{stdout}"
    );
}

/// A misspelt setting (warned about on stderr) leaves allocations alone, also when the warning
/// cannot be written.
#[test]
fn a_misspelt_setting_passes_through_when_stderr_fails() {
    let mut cmd = e2e_command("malformed");
    // TMS_INIT_ENABLE malformed as above, so that the mode's checks hold, and a typo beside it.
    cmd.env("TMS_INIT_ENABLE", "maybe")
        .env("TMS_INIT_ENABEL", "1");
    let (status, stdout) = run_with_full_stderr(cmd);
    assert!(
        status.success() && stdout.lines().any(|l| l == "RESULT: PASS malformed"),
        "{status}\n{stdout}"
    );
}

/// An NCCL interposer with no NCCL below it returns ncclSystemError (2) and says so on stderr;
/// a stderr that cannot be written must not end the process.
#[test]
fn an_nccl_interposer_without_nccl_does_not_abort_when_stderr_fails() {
    let mut cmd = Command::new("python3");
    cmd.args([
        "-c",
        "import ctypes\n\
         f = ctypes.CDLL(None).ncclCommDestroy\n\
         print('rc', f(None), flush=True)\n",
    ]);
    scrub_env(&mut cmd);
    cmd.env("LD_PRELOAD", libtms());
    let (status, stdout) = run_with_full_stderr(cmd);
    assert!(status.success(), "{status}\n{stdout}");
    assert_eq!(stdout, "rc 2\n", "{status}");
}
