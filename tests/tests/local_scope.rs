//! A CUDA runtime loaded into a local scope (a dependency of a library opened with
//! `RTLD_LOCAL`, as Python extension modules are) is still found for pass-through calls.

use std::process::Command;

use tms_tests::{libtms, run, scrub_env, BUILD_OUT_DIR};

#[test]
fn pass_through_finds_a_runtime_in_a_local_scope() {
    let dir = std::path::Path::new(BUILD_OUT_DIR);
    let mut cmd = Command::new(dir.join("local_main"));
    scrub_env(&mut cmd);
    cmd.arg(dir.join("liblocal_user.so"))
        .env("LD_PRELOAD", libtms())
        .env("TMS_BACKEND", "sim");
    let r = run(cmd);
    assert!(r.status.success(), "{}", r.dump());
    assert!(
        r.stdout.contains("rc1=0 rc2=0 fake_calls=2"),
        "{}",
        r.dump()
    );
    assert_eq!(r.stderr, "", "{}", r.dump());
}
