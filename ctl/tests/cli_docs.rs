//! What tmsctl makes from its own command-line definition: shell completion scripts and manual
//! pages. The pages are checked in (`docs/man/`); they must be what `tmsctl man` prints now.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn tmsctl(args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_tmsctl"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run tmsctl");
    o
}

fn ok(args: &[&str]) -> String {
    let o = tmsctl(args);
    assert!(
        o.status.success(),
        "tmsctl {args:?}: {:?}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).expect("utf-8")
}

fn checked_in() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/man")
}

const REGENERATE: &str = "the manual pages in docs/man are not what `tmsctl man` prints: \
                          run `cargo run -p tmsctl -- man --out-dir docs/man` and commit them";

#[test]
fn help_lists_completions_and_man() {
    let help = ok(&["--help"]);
    for cmd in ["completions", "man"] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(cmd)),
            "{cmd}\n{help}"
        );
        let sub = ok(&[cmd, "--help"]);
        assert!(sub.contains("Exit codes"), "{cmd}\n{sub}");
    }
}

#[test]
fn completions_for_every_shell() {
    for (shell, marker) in [
        ("bash", "_tmsctl()"),
        ("zsh", "#compdef tmsctl"),
        ("fish", "complete -c tmsctl"),
        ("elvish", "edit:completion:arg-completer[tmsctl]"),
        ("powershell", "Register-ArgumentCompleter"),
    ] {
        let script = ok(&["completions", shell]);
        // (fish names long options without their dashes)
        for want in [
            marker,
            "pause",
            "resume",
            "save-chunk-state",
            "json",
            "completions",
        ] {
            assert!(script.contains(want), "{shell}: no {want:?}\n{script}");
        }
        assert!(
            !script.contains("__demo-child"),
            "{shell}: offers the hidden command"
        );
    }
    let o = tmsctl(&["completions", "tcsh"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
}

/// The bash script completes for real (where bash is installed).
#[test]
fn bash_completes_commands_and_options() {
    if Command::new("bash").arg("-c").arg("true").status().is_err() {
        eprintln!("no bash: skipped");
        return;
    }
    let script = ok(&["completions", "bash"]);
    let complete = |words: &str| -> String {
        let w: Vec<&str> = words.split(' ').collect();
        let (n, cur, prev) = (w.len() - 1, w[w.len() - 1], w[w.len() - 2]);
        // As bash calls a completion function: the command, the word, the word before it.
        let o = Command::new("bash")
            .arg("--norc")
            .arg("-c")
            .arg(format!(
                "{script}\nCOMP_WORDS=({words}); COMP_CWORD={n}; COMP_LINE='{words}'; \
                 COMP_POINT=${{#COMP_LINE}}; _tmsctl tmsctl '{cur}' '{prev}'; \
                 echo \"${{COMPREPLY[*]}}\""
            ))
            .output()
            .expect("bash");
        assert!(o.status.success(), "{o:?}");
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    assert_eq!(complete("tmsctl pau"), "pause");
    assert_eq!(complete("tmsctl pause --save"), "--save-chunk-state");
    assert_eq!(complete("tmsctl completions fi"), "fish");
}

#[test]
fn man_pages_are_the_checked_in_ones() {
    let made = tempfile::tempdir().expect("tempdir");
    ok(&["man", "--out-dir", made.path().to_str().expect("utf-8")]);
    let names = |dir: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}\n{REGENERATE}", dir.display()))
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let pages = names(made.path());
    assert!(
        pages.contains(&"tmsctl.1".to_string()) && pages.contains(&"tmsctl-pause.1".to_string()),
        "{pages:?}"
    );
    assert!(!pages
        .iter()
        .any(|p| p.contains("demo-child") || p.contains("help")));
    assert_eq!(names(&checked_in()), pages, "{REGENERATE}");
    for p in &pages {
        let now = std::fs::read_to_string(made.path().join(p)).expect("read");
        let kept = std::fs::read_to_string(checked_in().join(p)).expect("read");
        assert!(now == kept, "{p}: {REGENERATE}");
    }
    // The same on stdout, one page at a time.
    let top = ok(&["man"]);
    assert_eq!(
        top,
        std::fs::read_to_string(checked_in().join("tmsctl.1")).expect("read"),
        "{REGENERATE}"
    );
    assert_eq!(
        ok(&["man", "pause"]),
        std::fs::read_to_string(checked_in().join("tmsctl-pause.1")).expect("read"),
        "{REGENERATE}"
    );
    for want in [
        ".TH tmsctl 1",
        ".SH SYNOPSIS",
        ".SH \"EXIT STATUS\"",
        "tmsctl\\-pause(1)",
    ] {
        assert!(top.contains(want), "{want}\n{top}");
    }
    assert_eq!(tmsctl(&["man", "frobnicate"]).status.code(), Some(2));
}
