//! What every command is given: tmsctl's own socket folder and where it comes from, how long to
//! wait for each process, and whether to print JSON.

use std::path::PathBuf;
use std::time::Duration;

use crate::procfs::euid;

/// Settings every command shares.
pub struct Ctx {
    /// The socket folder.
    pub dir: PathBuf,
    /// Where it comes from.
    pub origin: Origin,
    /// Per-process answer timeout.
    pub timeout: Duration,
    /// JSON output.
    pub json: bool,
}

impl Ctx {
    /// The settings of `--socket-dir`, `--timeout` and `--json`, with tmsctl's environment.
    pub fn new(socket_dir: Option<PathBuf>, timeout: Duration, json: bool) -> Ctx {
        Ctx {
            origin: Origin::of_env(socket_dir.is_some()),
            dir: socket_dir.unwrap_or_else(|| tms_proto::socket_dir_from_env(euid())),
            timeout,
            json,
        }
    }
}

/// Where tmsctl's own socket folder comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// `--socket-dir`.
    Flag,
    /// tmsctl's `TMS_SOCKET_DIR`.
    TmsSocketDir,
    /// tmsctl's `XDG_RUNTIME_DIR` (`TMS_SOCKET_DIR` unset).
    XdgRuntimeDir,
    /// Neither gives it: `/tmp/tms-<uid>`.
    Default,
}

impl Origin {
    /// Where the folder comes from, `--socket-dir` given or not (the variables are read as
    /// [`tms_proto::socket_dir`] reads them: an empty one is unset).
    pub fn of_env(flag: bool) -> Origin {
        let set = |v: &str| std::env::var_os(v).is_some_and(|x| !x.is_empty());
        if flag {
            Origin::Flag
        } else if set("TMS_SOCKET_DIR") {
            Origin::TmsSocketDir
        } else if std::env::var_os("XDG_RUNTIME_DIR")
            .is_some_and(|x| tms_proto::runtime_dir_usable(&x, euid()))
        {
            Origin::XdgRuntimeDir
        } else {
            Origin::Default
        }
    }

    /// The folder was named (`--socket-dir`, `TMS_SOCKET_DIR`): without `--pid` it is the only
    /// one looked in.
    pub fn named(self) -> bool {
        matches!(self, Origin::Flag | Origin::TmsSocketDir)
    }

    /// What the folder is, for messages.
    pub fn about(self) -> &'static str {
        match self {
            Origin::Flag => "tmsctl's folder, from --socket-dir",
            Origin::TmsSocketDir => "tmsctl's folder, from its TMS_SOCKET_DIR",
            Origin::XdgRuntimeDir => {
                "tmsctl's folder, from its XDG_RUNTIME_DIR; its TMS_SOCKET_DIR is unset"
            }
            Origin::Default => {
                "tmsctl's folder: its TMS_SOCKET_DIR is unset, its XDG_RUNTIME_DIR unset or not a \
                 folder of its user's"
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_folder_is_the_only_one_looked_in() {
        assert!(Origin::Flag.named() && Origin::TmsSocketDir.named());
        assert!(!Origin::XdgRuntimeDir.named() && !Origin::Default.named());
        for o in [
            Origin::Flag,
            Origin::TmsSocketDir,
            Origin::XdgRuntimeDir,
            Origin::Default,
        ] {
            assert!(o.about().starts_with("tmsctl's folder"), "{o:?}");
        }
    }
}
