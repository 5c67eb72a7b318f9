//! The layout of a disk backup folder, as the library makes it and the sweep reads it: the
//! names of the files, where they go, and which of them may be stale.

use std::time::{Duration, SystemTime};

/// Prefix of finished backup files.
pub const FILE_PREFIX: &str = "tms-backup-";

/// Prefix of a backup file being made: created under this name, locked, then renamed (so no
/// sweep can take a file between its creation and its lock). A dot hides it from listings.
pub const TMP_PREFIX: &str = ".tms-backup-new-";

/// A temporary file older than this whose lock is free was left by a process that died while
/// making it; a younger one may be one a live process is making.
pub const TMP_GRACE: Duration = Duration::from_secs(60);

/// The file's type bits of `st_mode`, and those of a regular file (POSIX values, as Linux has
/// them).
const S_IFMT: u32 = 0o170_000;
const S_IFREG: u32 = 0o100_000;

/// The unique part of a backup file's name: the process that made it, when (nanoseconds since
/// the epoch, in hex) and its number in that process, `<pid>-<stamp>-<seq>.bin`. The sweep takes
/// only names of this exact form: a file of the user's own that begins like ours is left alone.
pub fn unique_part(pid: u32, stamp: u128, seq: u64) -> String {
    format!("{pid}-{stamp:x}-{seq}.bin")
}

/// `rest` has the form [`unique_part`] makes.
fn is_unique_part(rest: &[u8]) -> bool {
    let Some(stem) = rest.strip_suffix(b".bin") else {
        return false;
    };
    let mut fields = stem.split(|&b| b == b'-');
    let mut field = |ok: fn(&u8) -> bool| {
        fields
            .next()
            .is_some_and(|f| !f.is_empty() && f.iter().all(ok))
    };
    field(u8::is_ascii_digit)
        && field(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
        && field(u8::is_ascii_digit)
        && fields.next().is_none()
}

/// The name of a finished backup file whose unique part is `unique`.
pub fn file_name(unique: &str) -> String {
    format!("{FILE_PREFIX}{unique}")
}

/// The name a backup file has while it is made.
pub fn tmp_name(unique: &str) -> String {
    format!("{TMP_PREFIX}{unique}")
}

/// The subfolder of ours made in a directory others can write to: `tms-backups-<uid>`.
pub fn private_subfolder_name(uid: u32) -> String {
    format!("tms-backups-{uid}")
}

/// The files go in the chosen directory itself, owned by `owner` with mode `mode`, only when
/// nobody else can make, rename or remove entries there: it is `me`'s and neither group nor
/// others may write to it. Otherwise they go in [`private_subfolder_name`].
pub fn files_go_in_directory(owner: u32, mode: u32, me: u32) -> bool {
    owner == me && mode & 0o022 == 0
}

/// Our subfolder, owned by `owner` with mode `mode`, is acceptable: `me`'s, closed to group and
/// others.
pub fn subfolder_is_private(owner: u32, mode: u32, me: u32) -> bool {
    owner == me && mode & 0o077 == 0
}

/// An entry of a disk backup folder, as the sweep sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A finished backup file (stale once its lock can be taken).
    File,
    /// One being made (stale once older than [`TMP_GRACE`] and its lock can be taken).
    Tmp,
}

impl Entry {
    /// What the name `name` is, if it is one of ours: a prefix and a [`unique_part`].
    pub fn of(name: &[u8]) -> Option<Entry> {
        let (kind, rest) = if let Some(rest) = name.strip_prefix(TMP_PREFIX.as_bytes()) {
            (Entry::Tmp, rest)
        } else {
            (Entry::File, name.strip_prefix(FILE_PREFIX.as_bytes())?)
        };
        is_unique_part(rest).then_some(kind)
    }

    /// The entry may be removed (if its lock can be taken), given its `st_mode`, owner and
    /// modification time (`st_mtime`, seconds since the epoch) as `fstatat` gives them without
    /// following a link: a regular file of `me`'s, and not a temporary file young enough to be
    /// in the making (one whose age cannot be told counts as young).
    pub fn may_be_stale(self, mode: u32, owner: u32, mtime: i64, me: u32) -> bool {
        if !is_regular_file_of(mode, owner, me) {
            return false;
        }
        match self {
            Entry::File => true,
            Entry::Tmp => {
                let modified = SystemTime::UNIX_EPOCH + Duration::from_secs(mtime.max(0) as u64);
                modified.elapsed().is_ok_and(|age| age >= TMP_GRACE)
            }
        }
    }
}

/// A file of `st_mode` `mode` owned by `owner` is a regular file of `me`'s: the only kind the
/// sweep opens (checked again on the open file, as the name may change hands meanwhile).
pub fn is_regular_file_of(mode: u32, owner: u32, me: u32) -> bool {
    mode & S_IFMT == S_IFREG && owner == me
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> i64 {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
    }

    #[test]
    fn names_are_recognised_only_in_the_form_the_library_makes() {
        let unique = unique_part(4242, 0x187_abc0_1234, 7);
        assert_eq!(unique, "4242-187abc01234-7.bin");
        assert_eq!(file_name("1-a-0.bin"), "tms-backup-1-a-0.bin");
        assert_eq!(tmp_name("1-a-0.bin"), ".tms-backup-new-1-a-0.bin");
        assert_eq!(Entry::of(file_name(&unique).as_bytes()), Some(Entry::File));
        assert_eq!(Entry::of(tmp_name(&unique).as_bytes()), Some(Entry::Tmp));
        // The user's own files that begin like ours, and near misses of the form.
        for other in [
            "tms-backups-1000",
            "unrelated.bin",
            ".tms-backup",
            "",
            "tms-backup-weights.pt",
            "tms-backup-notes.txt",
            "tms-backup-2024.tar",
            "tms-backup-1-a-0.bin.bak",
            "tms-backup-1-a-0",
            "tms-backup-1-A-0.bin",
            "tms-backup-1-a-0-2.bin",
            "tms-backup--a-0.bin",
            "tms-backup-x-a-0.bin",
            "tms-backup-1-a-.bin",
            ".tms-backup-new-mine.bin",
            "tms-backup-.tms-backup-new-1-a-0.bin",
        ] {
            assert_eq!(Entry::of(other.as_bytes()), None, "{other}");
        }
        assert_eq!(private_subfolder_name(1000), "tms-backups-1000");
    }

    #[test]
    fn only_regular_files_of_ours_and_old_temporary_ones_may_be_stale() {
        let file = 0o100_600;
        let (me, other) = (1000, 1001);
        let old = now() - 2 * TMP_GRACE.as_secs() as i64;
        assert!(Entry::File.may_be_stale(file, me, now(), me));
        assert!(!Entry::File.may_be_stale(file, other, old, me), "not ours");
        for kind in [0o010_600, 0o120_777, 0o040_700, 0o140_600] {
            assert!(!Entry::File.may_be_stale(kind, me, old, me), "{kind:o}");
        }
        assert!(Entry::Tmp.may_be_stale(file, me, old, me));
        assert!(!Entry::Tmp.may_be_stale(file, me, now(), me), "being made");
        assert!(
            !Entry::Tmp.may_be_stale(file, me, now() + 3600, me),
            "from the future"
        );
    }

    #[test]
    fn where_the_files_go() {
        let me = 1000;
        assert!(files_go_in_directory(me, 0o700, me));
        assert!(files_go_in_directory(me, 0o755, me));
        assert!(!files_go_in_directory(me, 0o775, me), "group may write");
        assert!(!files_go_in_directory(me, 0o1777, me), "others may write");
        assert!(!files_go_in_directory(0, 0o755, me), "not ours");
        assert!(subfolder_is_private(me, 0o700, me));
        assert!(!subfolder_is_private(me, 0o750, me));
        assert!(!subfolder_is_private(0, 0o700, me));
    }
}
