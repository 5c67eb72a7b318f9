//! Builds the C side of the end-to-end tests with the system `cc`:
//!
//! - `tests/c/fake_cudart.c` into `$OUT_DIR/libcudart.so`, a fake CUDA runtime that counts
//!   the `cudaMalloc`/`cudaFree` calls reaching it;
//! - `tests/c/e2e_prog.c` into `$OUT_DIR/e2e_prog`, linked against that fake runtime, which the
//!   tests run with `LD_PRELOAD=libtms.so`;
//! - the HIP test double `preload/tests/hip/libamdhip64.c` into `$OUT_DIR/hip/libamdhip64.so`,
//!   and `tests/c/e2e_hip.c` into `$OUT_DIR/e2e_hip`, linked against it.
//! - `tests/c/fake_nccl.c`, a test double of NCCL, into `$OUT_DIR/nccl/libnccl.so.2` (with
//!   `ncclCommSuspend`) and `$OUT_DIR/nccl-old/libnccl.so.2` (without), and
//!   `tests/c/nccl_prog.c` into `$OUT_DIR/nccl_prog`, linked against both fakes.
//!
//! The paths are passed to the tests as `TMS_TEST_FAKE_CUDART`, `TMS_TEST_E2E_PROG`,
//! `TMS_TEST_E2E_HIP` and `TMS_TEST_OUT_DIR` (read with `env!`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn cc(args: &[&str], what: &str) {
    let out = Command::new("cc").args(args).output().unwrap_or_else(|e| {
        panic!("cannot run the system C compiler `cc` (needed to build {what}): {e}")
    });
    for line in String::from_utf8_lossy(&out.stderr).lines() {
        println!("cargo:warning={what}: {line}");
    }
    assert!(
        out.status.success(),
        "cc failed building {what} ({}): cc {}\n{}",
        out.status,
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("build paths are UTF-8")
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let c_dir = manifest.join("c");
    let include = manifest.join("../preload/include");
    let fake_src = c_dir.join("fake_cudart.c");
    let prog_src = c_dir.join("e2e_prog.c");
    let header = include.join("tms.h");
    let dlsym_header = c_dir.join("tms_dlsym.h");
    for p in [
        &fake_src,
        &prog_src,
        &header,
        &dlsym_header,
        &c_dir.join("checks.h"),
    ] {
        println!("cargo:rerun-if-changed={}", path_str(p));
    }
    println!("cargo:rerun-if-changed=build.rs");

    let warn = ["-std=gnu11", "-Wall", "-Wextra", "-g", "-O1"];

    let fake = out.join("libcudart.so");
    let mut args: Vec<&str> = warn.to_vec();
    args.extend([
        "-shared",
        "-fPIC",
        "-Wl,-soname,libcudart.so",
        "-o",
        path_str(&fake),
        path_str(&fake_src),
    ]);
    cc(&args, "the fake CUDA runtime");

    let prog = out.join("e2e_prog");
    let include_flag = format!("-I{}", path_str(&include));
    let lib_dir = format!("-L{}", path_str(&out));
    let rpath = format!("-Wl,-rpath,{}", path_str(&out));
    // Linked against the fake runtime, found at run time in its folder.
    let cudart = ["-Wl,--no-as-needed", &lib_dir, "-lcudart", &rpath];
    let mut args: Vec<&str> = warn.to_vec();
    args.extend([
        "-pthread",
        &include_flag,
        "-o",
        path_str(&prog),
        path_str(&prog_src),
    ]);
    args.extend(cudart);
    args.push("-ldl");
    cc(&args, "the end-to-end test program");

    // A runtime user opened with RTLD_LOCAL, and the program that opens it.
    let user_src = c_dir.join("local_user.c");
    let main_src = c_dir.join("local_main.c");
    println!("cargo:rerun-if-changed={}", path_str(&user_src));
    println!("cargo:rerun-if-changed={}", path_str(&main_src));
    let user = out.join("liblocal_user.so");
    let mut args: Vec<&str> = warn.to_vec();
    args.extend([
        "-shared",
        "-fPIC",
        "-o",
        path_str(&user),
        path_str(&user_src),
    ]);
    args.extend(cudart);
    cc(&args, "the RTLD_LOCAL runtime user");
    let local_main = out.join("local_main");
    let mut args: Vec<&str> = warn.to_vec();
    args.extend(["-o", path_str(&local_main), path_str(&main_src), "-ldl"]);
    cc(&args, "the RTLD_LOCAL test program");

    // The HIP test double, and a program that calls hipMalloc, linked against it.
    let hip_src = manifest.join("../preload/tests/hip/libamdhip64.c");
    let hip_prog_src = c_dir.join("e2e_hip.c");
    println!("cargo:rerun-if-changed={}", path_str(&hip_src));
    println!("cargo:rerun-if-changed={}", path_str(&hip_prog_src));
    let hip_dir = out.join("hip");
    std::fs::create_dir_all(&hip_dir).expect("create $OUT_DIR/hip");
    let hip = hip_dir.join("libamdhip64.so");
    let mut args: Vec<&str> = warn.to_vec();
    args.extend([
        "-shared",
        "-fPIC",
        "-Wl,-soname,libamdhip64.so",
        "-o",
        path_str(&hip),
        path_str(&hip_src),
    ]);
    cc(&args, "the HIP test double");
    let hip_prog = out.join("e2e_hip");
    let hip_lib_dir = format!("-L{}", path_str(&hip_dir));
    let hip_rpath = format!("-Wl,-rpath,{}", path_str(&hip_dir));
    let mut args: Vec<&str> = warn.to_vec();
    args.extend([
        &include_flag,
        "-o",
        path_str(&hip_prog),
        path_str(&hip_prog_src),
        "-Wl,--no-as-needed",
        &hip_lib_dir,
        "-lamdhip64",
        &hip_rpath,
        "-ldl",
    ]);
    cc(&args, "the HIP end-to-end test program");
    println!("cargo:rustc-env=TMS_TEST_E2E_HIP={}", path_str(&hip_prog));

    // The NCCL test double, as an NCCL with ncclCommSuspend (2.29.7) and one without (2.21.5),
    // each `libnccl.so.2` in a folder of its own: the NCCL test program finds one through
    // LD_LIBRARY_PATH (its own run path holds only the fake CUDA runtime).
    let nccl_src = c_dir.join("fake_nccl.c");
    let nccl_prog_src = c_dir.join("nccl_prog.c");
    for f in ["fake_nccl.c", "fake_nccl.h", "nccl_prog.c", "checks.h"] {
        println!("cargo:rerun-if-changed={}", path_str(&c_dir.join(f)));
    }
    let nccl_dirs = [("nccl", None), ("nccl-old", Some("-DFAKE_NCCL_NO_SUSPEND"))];
    for (dir, define) in nccl_dirs {
        let d = out.join(dir);
        std::fs::create_dir_all(&d).expect("make the fake NCCL's folder");
        let so = d.join("libnccl.so.2");
        let mut args: Vec<&str> = warn.to_vec();
        args.extend(define);
        args.extend([
            "-shared",
            "-fPIC",
            "-Wl,-soname,libnccl.so.2",
            "-o",
            path_str(&so),
            path_str(&nccl_src),
        ]);
        args.extend(cudart);
        cc(&args, "the NCCL test double");
    }
    let nccl_lib = out.join("nccl/libnccl.so.2");
    let nccl_prog = out.join("nccl_prog");
    let mut args: Vec<&str> = warn.to_vec();
    args.extend([
        &include_flag,
        "-o",
        path_str(&nccl_prog),
        path_str(&nccl_prog_src),
        path_str(&nccl_lib),
    ]);
    args.extend(cudart);
    args.push("-ldl");
    cc(&args, "the NCCL test program");

    println!("cargo:rustc-env=TMS_TEST_FAKE_CUDART={}", path_str(&fake));
    println!("cargo:rustc-env=TMS_TEST_E2E_PROG={}", path_str(&prog));
    println!("cargo:rustc-env=TMS_TEST_OUT_DIR={}", path_str(&out));
}
