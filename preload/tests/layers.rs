//! The library's top-level modules form layers, and dependencies point down only:
//! `hooks`, `ffi` → `control` → `process` → `nccl` → `engine` → `driver`, with `error`, `units` and
//! `threads` beneath them all. Checked on the sources: every `crate::<module>` a module's files
//! name (in `use` lines and paths, comments and literals excepted; a name the crate root
//! re-exports counts as the module it comes from) must be an edge of [`ALLOWED`], and
//! [`ALLOWED`] itself must have no cycle. A new top-level module fails here until it is given
//! its place in the table. Inside `engine/`, the files name each other directly and form no
//! cycle (see `engine_violations`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module and the modules it may use.
const ALLOWED: &[(&str, &[&str])] = &[
    (
        "hooks",
        &[
            "control", "process", "nccl", "engine", "backup", "driver", "os", "error", "units",
            "threads",
        ],
    ),
    (
        "ffi",
        &[
            "control", "process", "nccl", "engine", "backup", "driver", "os", "error", "units",
            "threads",
        ],
    ),
    (
        "control",
        &[
            "process", "nccl", "engine", "backup", "driver", "os", "error", "units", "threads",
        ],
    ),
    (
        "process",
        &[
            "nccl", "engine", "backup", "driver", "os", "error", "units", "threads",
        ],
    ),
    (
        "nccl",
        &["engine", "driver", "os", "error", "units", "threads"],
    ),
    (
        "engine",
        &[
            "backup",
            "driver",
            "os",
            "error",
            "units",
            "threads",
            "test_data",
        ],
    ),
    (
        "backup",
        &["driver", "os", "error", "units", "threads", "test_data"],
    ),
    ("driver", &["os", "error", "units", "threads", "test_data"]),
    ("os", &["error", "units"]),
    ("threads", &["error", "units"]),
    ("units", &["error"]),
    ("error", &[]),
    // The unit tests' reproducible bytes (compiled only for them).
    ("test_data", &[]),
];

type Graph = BTreeMap<String, BTreeSet<String>>;

fn allowed() -> Graph {
    ALLOWED
        .iter()
        .map(|(m, to)| (m.to_string(), to.iter().map(|t| t.to_string()).collect()))
        .collect()
}

/// A cycle of `g` as the modules along it (first = last), if there is one.
fn find_cycle(g: &Graph) -> Option<Vec<String>> {
    fn visit(
        g: &Graph,
        m: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut c = path[i..].to_vec();
            c.push(m.to_string());
            return Some(c);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for t in g.get(m).into_iter().flatten() {
            if let Some(c) = visit(g, t, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys()
        .find_map(|m| visit(g, m, &mut Vec::new(), &mut done))
}

/// `src` with comments and the contents of string and character literals blanked (lines kept).
fn code_only(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = c.clone();
    let blank = |out: &mut Vec<char>, from: usize, to: usize| {
        for ch in &mut out[from..to.min(c.len())] {
            if *ch != '\n' {
                *ch = ' ';
            }
        }
    };
    let at = |i: usize, s: &str| s.chars().enumerate().all(|(k, x)| c.get(i + k) == Some(&x));
    let mut i = 0;
    while i < c.len() {
        if at(i, "//") {
            let end = (i..c.len()).find(|&j| c[j] == '\n').unwrap_or(c.len());
            blank(&mut out, i, end);
            i = end;
        } else if at(i, "/*") {
            let (mut j, mut depth) = (i + 2, 1);
            while j < c.len() && depth > 0 {
                if at(j, "/*") {
                    depth += 1;
                    j += 2;
                } else if at(j, "*/") {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if c[i] == 'r' && {
            let h = (i + 1..c.len()).take_while(|&j| c[j] == '#').count();
            c.get(i + 1 + h) == Some(&'"')
        } {
            let h = (i + 1..c.len()).take_while(|&j| c[j] == '#').count();
            let close: String = std::iter::once('"').chain("#".repeat(h).chars()).collect();
            let start = i + 2 + h;
            let end = (start..c.len())
                .find(|&j| at(j, &close))
                .map_or(c.len(), |j| j + close.len());
            blank(&mut out, start, end - 1);
            i = end;
        } else if c[i] == '"' {
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            blank(&mut out, i + 1, j);
            i = j + 1;
        } else if c[i] == '\'' {
            // A character literal ('x', '\n', '\u{..}'); otherwise a lifetime or a label.
            let end = if c.get(i + 1) == Some(&'\\') {
                (i + 2..c.len()).find(|&j| c[j] == '\'' && j > i + 2)
            } else if c.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    blank(&mut out, i + 1, e);
                    i = e + 1;
                }
                None => i += 1,
            }
        } else {
            i += 1;
        }
    }
    out.into_iter().collect()
}

fn is_ident(ch: char) -> bool {
    ch.is_alphanumeric() || ch == '_'
}

/// The first names of the paths `code` starts with `crate::` (`crate::{a, b::c}` gives `a` and
/// `b`), each with its line.
fn crate_paths(code: &str) -> Vec<(usize, String)> {
    let c: Vec<char> = code.chars().collect();
    let skip_ws = |mut i: usize| {
        while i < c.len() && c[i].is_whitespace() {
            i += 1;
        }
        i
    };
    let ident = |i: usize| -> String { c[i..].iter().take_while(|&&ch| is_ident(ch)).collect() };
    let line_of = |i: usize| c[..i].iter().filter(|&&ch| ch == '\n').count() + 1;
    let mut found = Vec::new();
    let mut i = 0;
    while let Some(k) = (i..c.len()).find(|&k| c[k..].starts_with(&['c', 'r', 'a', 't', 'e'])) {
        i = k + 5;
        if (k > 0 && is_ident(c[k - 1])) || c.get(k + 5).is_some_and(|&ch| is_ident(ch)) {
            continue;
        }
        let j = skip_ws(k + 5);
        if !(c.get(j) == Some(&':') && c.get(j + 1) == Some(&':')) {
            continue;
        }
        let j = skip_ws(j + 2);
        if c.get(j) == Some(&'{') {
            // The first name of every item of the group.
            let (mut d, mut item_start) = (0, true);
            for (p, &ch) in c.iter().enumerate().skip(j) {
                match ch {
                    '{' => {
                        d += 1;
                        item_start = d == 1;
                    }
                    '}' => {
                        d -= 1;
                        if d == 0 {
                            break;
                        }
                    }
                    ',' if d == 1 => item_start = true,
                    ch if item_start && d == 1 && is_ident(ch) => {
                        found.push((line_of(p), ident(p)));
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            found.push((line_of(j), ident(j)));
        }
    }
    found
}

/// The top-level modules `lib.rs` declares, and the names it re-exports with their modules.
fn crate_root(lib: &str) -> (BTreeSet<String>, BTreeMap<String, String>) {
    let code = code_only(lib);
    let mut modules = BTreeSet::new();
    let mut reexports = BTreeMap::new();
    for stmt in code
        .split(';')
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
    {
        // Attributes (`#[cfg(..)] mod x`) and visibility do not matter here.
        let stmt = stmt.rsplit("] ").next().unwrap_or("");
        let stmt = stmt
            .trim_start_matches("pub ")
            .trim_start_matches("pub(crate) ");
        if let Some(m) = stmt.strip_prefix("mod ") {
            modules.insert(m.trim().to_string());
        } else if let Some(path) = stmt.strip_prefix("use ") {
            let module = path.split("::").next().unwrap_or("").trim().to_string();
            let tail = path.rsplit_once("::").map_or(path, |(_, t)| t);
            for item in tail.trim_matches(|ch| ch == '{' || ch == '}').split(',') {
                let name = item.rsplit(" as ").next().unwrap_or("").trim();
                if !name.is_empty() {
                    reexports.insert(name.to_string(), module.clone());
                }
            }
        }
    }
    (modules, reexports)
}

/// Every way the sources break the layering: (`files` are paths relative to `src/` with their
/// text; `lib.rs` among them).
fn violations(files: &[(String, String)]) -> Vec<String> {
    let lib = files
        .iter()
        .find(|(p, _)| p == "lib.rs")
        .map_or("", |(_, t)| t.as_str());
    let (modules, reexports) = crate_root(lib);
    let table = allowed();
    let mut bad = Vec::new();
    if let Some(c) = find_cycle(&table) {
        bad.push(format!("the allowed graph has a cycle: {}", c.join(" -> ")));
    }
    for m in &modules {
        if !table.contains_key(m) {
            bad.push(format!(
                "top-level module `{m}` has no place in the layers: add it to ALLOWED"
            ));
        }
    }
    let mut actual = Graph::new();
    for (path, text) in files {
        let top = path.split(['/', '.']).next().unwrap_or("");
        if !modules.contains(top) {
            continue; // lib.rs, and bin/ (its own crates)
        }
        for (line, name) in crate_paths(&code_only(text)) {
            let Some(to) = (if modules.contains(&name) {
                Some(name.clone())
            } else {
                reexports.get(&name).cloned()
            }) else {
                continue;
            };
            if to == top {
                continue;
            }
            actual
                .entry(top.to_string())
                .or_default()
                .insert(to.clone());
            if !table.get(top).is_some_and(|may| may.contains(&to)) {
                bad.push(format!(
                    "src/{path}:{line}: `{top}` uses `crate::{name}` (module `{to}`): \
                     {top} -> {to} is not an allowed edge"
                ));
            }
        }
    }
    // Every cycle at least once: each found is broken at its last edge before looking again.
    while let Some(c) = find_cycle(&actual) {
        bad.push(format!("module cycle: {}", c.join(" -> ")));
        if let Some(to) = actual.get_mut(&c[c.len() - 2]) {
            to.remove(&c[c.len() - 1]);
        }
    }
    bad
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn modules_depend_only_downwards() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    rs_files(&src, &mut paths);
    let files: Vec<(String, String)> = paths
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
            (rel, std::fs::read_to_string(p).unwrap())
        })
        .collect();
    assert!(files.iter().any(|(p, _)| p == "lib.rs"));
    let bad = violations(&files);
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
}

#[test]
fn the_check_sees_upward_edges_cycles_and_unplaced_modules() {
    let f = |p: &str, t: &str| (p.to_string(), t.to_string());
    let files = [
        f(
            "lib.rs",
            "pub mod hooks;\npub mod ffi;\npub mod control;\npub mod newcomer;\n\
             pub use ffi::{catch as caught, Thing};",
        ),
        f(
            "hooks/interpose.rs",
            "// crate::control in a comment\nlet s = \"crate::control\";\nlet c = '\"';\n\
             use crate::{\n    ffi::catch,\n};\nfn f<'a>() { crate::Thing::new() }",
        ),
        f("ffi/mod.rs", "use crate::hooks::runtime;"),
        f("control/mod.rs", "pub fn g() { r#\"crate::hooks\"#; }"),
    ];
    let bad = violations(&files);
    let expect = [
        "`newcomer` has no place",
        "src/hooks/interpose.rs:5: `hooks` uses `crate::ffi` (module `ffi`): hooks -> ffi",
        "src/hooks/interpose.rs:7: `hooks` uses `crate::Thing` (module `ffi`)",
        "src/ffi/mod.rs:1: `ffi` uses `crate::hooks`",
        "module cycle: ffi -> hooks -> ffi",
    ];
    for e in expect {
        assert!(bad.iter().any(|b| b.contains(e)), "{e:?} not in {bad:#?}");
    }
    assert_eq!(bad.len(), expect.len(), "{bad:#?}");
}

/// The modules a parent file declares (`mod x;`, `pub mod x;`), and its other code lines
/// (line number, text) apart from re-exports and `#[cfg(test)]`.
fn declarations(src: &str) -> (BTreeSet<String>, Vec<(usize, String)>) {
    let mut modules = BTreeSet::new();
    let mut other = Vec::new();
    for (n, line) in code_only(src).lines().enumerate() {
        let l = line.trim();
        let decl = l
            .strip_prefix("pub mod ")
            .or_else(|| l.strip_prefix("pub(super) mod "))
            .or_else(|| l.strip_prefix("mod "))
            .and_then(|r| r.strip_suffix(';'));
        if let Some(m) = decl {
            modules.insert(m.trim().to_string());
        } else if !(l.is_empty() || l.starts_with("pub use ") || l.starts_with("#[cfg(test)]")) {
            other.push((n + 1, l.to_string()));
        }
    }
    (modules, other)
}

/// Inside `engine/`: `mod.rs` only declares the files and re-exports (it defines nothing);
/// every file names its siblings directly (`super::registry::Pick`, never an item through its
/// parent: `super::Pick`), in `engine/` and in its subfolders alike (`pipeline/worker.rs` names
/// `super::shared::Shared`, not an item of `pipeline.rs`); and the files' `super::<file>` edges
/// have no cycle. `files` are (path under `engine/`, source).
fn engine_violations(files: &[(String, String)]) -> Vec<String> {
    let mut bad = Vec::new();
    let Some((_, facade)) = files.iter().find(|(p, _)| p == "mod.rs") else {
        return vec!["engine/mod.rs is missing".into()];
    };
    for (n, l) in declarations(facade).1 {
        bad.push(format!(
            "src/engine/mod.rs:{n}: the facade only declares and re-exports: `{l}`"
        ));
    }
    let mut graph = Graph::new();
    for (path, src) in files
        .iter()
        .filter(|(p, _)| p != "mod.rs" && p != "tests.rs")
    {
        // The folder's parent file: `mod.rs` for `engine/`, `x.rs` for `engine/x/`.
        let (folder, parent) = match path.rsplit_once('/') {
            Some((dir, _)) => (format!("{dir}/"), format!("{dir}.rs")),
            None => (String::new(), "mod.rs".to_string()),
        };
        let Some((_, parent_src)) = files.iter().find(|(p, _)| *p == parent) else {
            bad.push(format!("src/engine/{path}: no {parent} declares it"));
            continue;
        };
        let modules = declarations(parent_src).0;
        let from = path.trim_end_matches(".rs").to_string();
        graph.entry(from.clone()).or_default();
        let code = code_only(src);
        // A file's own inline test module (its end) names the file as `super`.
        let own = code.lines().take_while(|l| l.trim() != "#[cfg(test)]");
        for (n, line) in own.enumerate() {
            for (i, _) in line.match_indices("super::") {
                let before = line[..i].chars().next_back();
                if before.is_some_and(|c| is_ident(c) || c == ':') {
                    continue; // `super::super::`, `crate::x::super::` and the like
                }
                let name: String = line[i + 7..].chars().take_while(|&c| is_ident(c)).collect();
                let grouped = line[i + 7..].starts_with('{') || line[i + 7..].starts_with('*');
                if grouped || !modules.contains(&name) {
                    let what = if grouped {
                        line[i + 7..].trim()
                    } else {
                        name.as_str()
                    };
                    bad.push(format!(
                        "src/engine/{path}:{}: `super::{what}` goes through {parent}; name the \
                         file that defines it",
                        n + 1
                    ));
                } else {
                    let to = format!("{folder}{name}");
                    if to != from {
                        graph.entry(from.clone()).or_default().insert(to);
                    }
                }
            }
        }
    }
    while let Some(c) = find_cycle(&graph) {
        bad.push(format!("engine file cycle: {}", c.join(" -> ")));
        if let Some(to) = graph.get_mut(&c[c.len() - 2]) {
            to.remove(&c[c.len() - 1]);
        }
    }
    bad
}

#[test]
fn engine_files_name_each_other_directly_without_cycles() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine");
    let mut paths = Vec::new();
    rs_files(&dir, &mut paths);
    let files: Vec<(String, String)> = paths
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(&dir).unwrap().to_string_lossy().into_owned();
            (rel, std::fs::read_to_string(p).unwrap())
        })
        .collect();
    assert!(files.len() > 10, "{} files", files.len());
    let bad = engine_violations(&files);
    assert!(bad.is_empty(), "engine layout broken:\n{}", bad.join("\n"));
}

#[test]
fn the_engine_check_sees_facade_items_imports_through_it_and_cycles() {
    let f = |p: &str, t: &str| (p.to_string(), t.to_string());
    let files = [
        f(
            "mod.rs",
            "//! docs\nmod a;\nmod b;\npub mod c;\npub use a::Thing;\n#[cfg(test)]\nmod tests;\n\
             fn helper() {}",
        ),
        f(
            "a.rs",
            "mod x;\nmod y;\nuse super::b::X;\n// super::Nope in a comment\nfn f() {}",
        ),
        f("b.rs", "use super::c::Y;\nuse super::{a, c};\n"),
        f(
            "c.rs",
            "use super::a::Thing;\nfn g() -> super::Thing { todo!() }\n#[cfg(test)]\n\
             mod tests {\n    use super::*;\n}",
        ),
        f("tests.rs", "use super::*;"),
        f("a/x.rs", "use super::y::Z;\nuse super::Item;"),
        f("a/y.rs", "pub struct Z;"),
        f("d/z.rs", "fn orphan() {}"),
    ];
    let bad = engine_violations(&files);
    let expect = [
        "src/engine/mod.rs:8: the facade only declares and re-exports: `fn helper() {}`",
        "src/engine/b.rs:2: `super::{a, c};` goes through mod.rs",
        "src/engine/c.rs:2: `super::Thing` goes through mod.rs",
        "src/engine/a/x.rs:2: `super::Item` goes through a.rs",
        "src/engine/d/z.rs: no d.rs declares it",
        "engine file cycle: a -> b -> c -> a",
    ];
    for e in expect {
        assert!(bad.iter().any(|b| b.contains(e)), "{e:?} not in {bad:#?}");
    }
    assert_eq!(bad.len(), expect.len(), "{bad:#?}");
}
