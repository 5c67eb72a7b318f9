//! The disk backup folder, shared by `libtms.so`, which makes its files there and sweeps it when
//! it first uses it, and `tmsctl clean`, which sweeps it on demand: the folder's layout (the
//! names of the files, where they go, which may be stale: [`layout`]) and the I/O both sides
//! apply to it ([`folder`]): opening it without blocking, and removing the files no live process
//! holds.
//!
//! The folder may be one other users can write to (the system's temporary directory is the
//! default), so the I/O opens only regular files of ours, never follows a link and never waits:
//! Note [The disk backup folder] in `preload/src/backup/disk.rs` gives the whole of the rules.

pub mod folder;
pub mod layout;

pub use folder::{
    open_folder, open_private_subfolder, restore_owner_access, sweep, sweep_keeping, Subfolder,
    SubfolderError,
};
pub use layout::{
    file_name, files_go_in_directory, is_regular_file_of, private_subfolder_name,
    subfolder_is_private, tmp_name, unique_part, Entry, FILE_PREFIX, TMP_GRACE, TMP_PREFIX,
};
