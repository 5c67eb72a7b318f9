//! The `TMS_*` environment variables of the project (the library, the Python package, tmsctl),
//! and the warning for a name one typo away from one of them: a misspelled setting would
//! otherwise be ignored without a word (`TMS_INIT_ENABEL=1` leaving every allocation ordinary).
//! Names far from all of ours are left alone: other software may use the prefix.

/// Every `TMS_*` variable read anywhere in the project (a test keeps this list whole).
pub const KNOWN: &[&str] = &[
    "TMS_BACKEND",
    "TMS_BUILD_COMMIT_ID",
    "TMS_CONTROL",
    "TMS_COPY_CHUNK",
    "TMS_COPY_THREADS",
    "TMS_DISK_BACKUP_CHUNK_MB",
    "TMS_DISK_BACKUP_DIR",
    "TMS_DISK_FAULTS",
    "TMS_HIP_LIBRARY",
    "TMS_HIP_RESERVE_AGAIN",
    "TMS_HOST_HUGEPAGES",
    "TMS_INIT_CPU_BACKUP_BACKEND",
    "TMS_INIT_ENABLE",
    "TMS_INIT_ENABLE_CPU_BACKUP",
    "TMS_INIT_ENABLE_DISK_BACKUP",
    "TMS_INIT_TAG",
    "TMS_KEEP_STAGING",
    "TMS_LIB",
    "TMS_LIBRARY_PATH",
    "TMS_LOG",
    "TMS_LOG_FORMAT",
    "TMS_MEMORY_MARGIN_BYTES",
    "TMS_NCCL_IN_ALL",
    "TMS_NCCL_REGISTERED",
    "TMS_PIN",
    "TMS_PTXAS",
    "TMS_RDMA",
    "TMS_RETAIN_CPU_BACKUP",
    "TMS_SAVE_STREAMS",
    "TMS_SHAREABLE",
    "TMS_SIM_BANDWIDTH",
    "TMS_SIM_CAPACITY",
    "TMS_SIM_DEVICES",
    "TMS_SIM_FAULTS",
    "TMS_SIM_GRANULARITY",
    "TMS_SIM_HOST_MEMORY",
    "TMS_SIM_SYNC_DELAY_MS",
    "TMS_SKIP_UNCHANGED",
    "TMS_SOCKET_DIR",
    "TMS_STAGING_SLOT",
    "TMS_STAGING_SLOT_SAVE",
    "TMS_STREAMING_STORES",
    "TMS_TEST_CHILD",
    "TMS_VERIFY_RESUME",
];

/// The known name `name` is likely a misspelling of: not itself known, and at most two edits
/// (a letter added, dropped, changed; two letters swapped) from one that is.
pub fn misspelling_of(name: &str) -> Option<&'static str> {
    if !name.starts_with("TMS_") || KNOWN.contains(&name) {
        return None;
    }
    KNOWN
        .iter()
        .map(|k| (edits(name, k), *k))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, k)| k)
}

/// The lines to print for the environment's names `names`: one per likely misspelling.
pub fn warnings<'a>(names: impl Iterator<Item = &'a str>) -> Vec<String> {
    names
        .filter_map(|n| {
            misspelling_of(n).map(|k| {
                format!(
                    "torch-memory-saver: environment variable {n} is not a setting; did you mean \
                     {k}? ({n} is ignored)"
                )
            })
        })
        .collect()
}

/// Optimal string alignment distance (Levenshtein with adjacent swaps), on bytes.
fn edits(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::path::Path;

    #[test]
    fn a_name_one_typo_away_from_a_setting_is_told_and_others_left_alone() {
        assert_eq!(misspelling_of("TMS_INIT_ENABEL"), Some("TMS_INIT_ENABLE"));
        assert_eq!(misspelling_of("TMS_COPY_THREAD"), Some("TMS_COPY_THREADS"));
        assert_eq!(misspelling_of("TMS_INIT_TAGS"), Some("TMS_INIT_TAG"));
        assert_eq!(misspelling_of("TMS_LOGG"), Some("TMS_LOG"));
        for fine in [
            "TMS_INIT_ENABLE",
            "TMS_LOG",
            "TMS_SOMETHING_ELSE_ENTIRELY",
            "PATH",
            "TMS_",
        ] {
            assert_eq!(misspelling_of(fine), None, "{fine}");
        }
        let w = warnings(["TMS_INIT_ENABEL", "HOME", "TMS_PIN"].into_iter());
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("did you mean TMS_INIT_ENABLE?"), "{w:?}");
    }

    /// Every `"TMS_..."` string of the sources that names a variable is in [`KNOWN`] (the C
    /// status names `TMS_OK`, `TMS_ERR_*` are not variables), and nothing is known that no
    /// source reads.
    #[test]
    fn the_list_is_every_variable_the_project_reads() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut found = BTreeSet::new();
        let mut stack: Vec<_> = [
            "preload/src",
            "ctl/src",
            "proto/src",
            "python/torch_memory_saver",
        ]
        .iter()
        .map(|d| root.join(d))
        .collect();
        while let Some(p) = stack.pop() {
            if p.is_dir() {
                stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
                continue;
            }
            // This file holds the list, and misspellings for its tests.
            let this = p.file_name().is_some_and(|n| n == "env_names.rs");
            if this || !matches!(p.extension().and_then(|e| e.to_str()), Some("rs" | "py")) {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            for (i, _) in text.match_indices("\"TMS_") {
                let name: String = text[i + 1..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                let closed = text[i + 1 + name.len()..].starts_with('"');
                if closed && name != "TMS_OK" && !name.starts_with("TMS_ERR_") {
                    found.insert(name);
                }
            }
        }
        let known: BTreeSet<String> = KNOWN.iter().map(|k| k.to_string()).collect();
        assert_eq!(found, known);
    }
}
