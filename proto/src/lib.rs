//! The Torch Memory Saver control protocol: line-delimited JSON over a Unix socket. This crate
//! holds the messages, the version and the features ([`messages`]), the lines and their limits
//! ([`framing`]), the naming of the socket files, with the one safe removal of a stale one
//! ([`socket`]), and the rule for the folders above a socket folder that the server and
//! `tmsctl` both apply ([`ancestors`]); no other I/O policy (timeouts, the socket folder's own
//! permissions and threads belong to the server in `libtms.so` and to `tmsctl`).
//!
//! # The exchange
//!
//! Every message is one JSON object on one line, ended by `\n`. The client speaks first:
//!
//! ```text
//! C: {"op":"hello","protocol":1,"pid":4242,"software":"tmsctl 0.1.0"}
//! S: {"reply":"hello","protocol":1,"pid":1234,"software":"libtms 0.1.0","backend":"cuda",...}
//! C: {"op":"pause","tag":"kv"}
//! S: {"reply":"done","op":"pause","tag":"kv","allocations":3,"bytes":21474836480,...}
//! ```
//!
//! then any number of requests, each answered by exactly one reply, in order. A request the server
//! cannot accept (not JSON, not an object, not a known operation, a field it does not know, longer
//! than [`MAX_LINE_BYTES`], no hello first, another protocol version) is answered with
//! [`Reply::Error`] and the server closes the connection; so is a connection the server has no room
//! for ([`ErrorKind::Busy`], possibly in place of any reply). An operation that fails (out of
//! memory on resume, say) is answered with [`Reply::Error`] too, but the connection stays open;
//! a failed pause or resume says there what it changed all the same ([`ErrorReply::changed`]).
//!
//! # Versioning
//!
//! [`PROTOCOL_VERSION`] changes when a message changes incompatibly. The hello is the one
//! message every version must keep decodable: it ignores fields it does not know, so a client
//! of another version still gets a clean [`ErrorKind::VersionMismatch`] reply.
//!
//! Additions that old peers can live with keep the version: a new reply field has a default
//! (an old server's reply still decodes), and a new request or request field is refused by an
//! old server as a bad request (requests deny fields they do not know), never half-understood:
//! an old server never takes a pause of some chunks for a pause of the whole tag. A server says
//! what it has added in its hello's [`Hello::features`], so a client can tell its user that a
//! process's library is too old for an operation before asking for it ([`FEATURE_CHUNKS`]).

pub mod ancestors;
pub mod framing;
pub mod messages;
pub mod socket;

pub use ancestors::{check_ancestors, AncestorFault, UnsafeAncestor};
pub use framing::{
    decode_reply, decode_request, encode, LineBuffer, ProtoError, ReadFault, MAX_LINE_BYTES,
    MAX_REPLY_BYTES,
};
pub use messages::*;
pub use socket::{
    hold_folder, pid_namespace, pid_of_socket_file, remove_if_stale, runtime_dir_usable,
    socket_dir, socket_dir_from_env, socket_file_name, via_short_path, SocketName, SOCKET_PATH_MAX,
};

/// The git commit this build was made from (short), or `"unknown"`: `git rev-parse --short
/// HEAD` of the checkout it was built in, else `$TMS_BUILD_COMMIT` at build time (builds from an
/// sdist, which has no `.git`). See `build.rs`.
pub const BUILD_COMMIT: &str = env!("TMS_BUILD_COMMIT_ID");

/// What a build is, after the program's name: `0.1.0 (torch-memory-saver, Rust implementation;
/// commit abc1234)`. `tmsctl --version` prints it.
pub const BUILD_INFO: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (torch-memory-saver, Rust implementation; commit ",
    env!("TMS_BUILD_COMMIT_ID"),
    ")"
);

/// The library's [`BUILD_INFO`], named and NUL-terminated for its C ABI (`tms_build_info()`):
/// `libtms 0.1.0 (torch-memory-saver, Rust implementation; commit abc1234)`.
pub const LIBRARY_BUILD_INFO: &std::ffi::CStr = match std::ffi::CStr::from_bytes_with_nul(
    concat!(
        "libtms ",
        env!("CARGO_PKG_VERSION"),
        " (torch-memory-saver, Rust implementation; commit ",
        env!("TMS_BUILD_COMMIT_ID"),
        ")\0"
    )
    .as_bytes(),
) {
    Ok(s) => s,
    Err(_) => panic!("the build information holds a NUL"),
};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod hostile_tests;

#[cfg(test)]
mod generators;
