//! Wire types of the Torch Memory Saver control protocol: line-delimited JSON over a Unix
//! socket. This crate holds the types, the limits, the framing and the naming convention of
//! the socket files, and the layout of the disk backup folder ([`disk_layout`]), which the
//! library and `tmsctl` share; no I/O policy (timeouts, permissions and threads belong to the
//! server in `libtms.so` and to `tmsctl`).
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
//! then any number of requests, each answered by exactly one reply, in order. A request the
//! server cannot accept (not JSON, not a known operation, a field it does not know, longer
//! than [`MAX_LINE_BYTES`], no hello first, another protocol version) is answered with
//! [`Reply::Error`] and the server closes the connection; so is a connection the server has no
//! room for ([`ErrorKind::Busy`], possibly in place of any reply). An operation that fails (out of
//! memory on resume, say) is answered with [`Reply::Error`] too, but the connection stays
//! open.
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

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub mod disk_layout;
mod parse;
pub use parse::{ListFault, ParseError};

/// Protocol version; a client and server agree on it in the hello exchange.
pub const PROTOCOL_VERSION: u32 = 1;

/// Longest request line the server accepts, in bytes, not counting the `\n`.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Longest reply line a client accepts, in bytes, not counting the `\n` (a status of a
/// process with many tags is longer than any request).
pub const MAX_REPLY_BYTES: usize = 4 * 1024 * 1024;

/// Most chunk indices one request may name (a typo cannot ask for billions).
pub const MAX_CHUNK_INDICES: usize = 1 << 20;

/// The feature of servers that pause and resume single chunks ([`Request::Pause`]'s `chunks`),
/// record and restore chunk states (`chunk_state`) and answer [`Request::Chunks`].
pub const FEATURE_CHUNKS: &str = "chunks";

/// The feature of servers whose [`Status`] lists the pauses and resumes that control clients
/// asked for and that have not ended ([`Status::operations`]).
pub const FEATURE_OPERATIONS: &str = "operations";

/// The feature of servers that report the progress of pauses and resumes: each entry of
/// [`Status::operations`] says what it is doing and how many bytes it has moved
/// ([`Running::phase`], [`Running::bytes_done`], ...), the list includes the operations
/// started inside the process through its API ([`Running::in_process`]), and
/// [`OpDone::disk_copied_bytes`] says which part of the copy went to or came from disk.
pub const FEATURE_PROGRESS: &str = "progress";

/// The feature of servers that resume without waiting for the data ([`Request::Resume`]'s
/// `no_wait`, [`OpDone::pending_bytes`]).
pub const FEATURE_NO_WAIT: &str = "no_wait";

/// The feature of servers that keep a second record of chunk states for job-wide operations
/// (`job_record` of [`Request::Pause`] and [`Request::Resume`]): `tmsctl pause --atomic` records
/// there for its undo, leaving the program's own record (`pause(save_chunk_state=True)`) alone.
pub const FEATURE_JOB_RECORD: &str = "job_record";

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

/// Longest error message a decoder produces (a message may quote part of the input).
const MAX_MESSAGE_CHARS: usize = 240;

// ---------------------------------------------------------------------------------------------
// Messages

/// The first message in each direction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol: u32,
    /// Process id of the sender.
    pub pid: u32,
    /// Name and version of the sender's software (`"tmsctl 0.1.0"`, `"libtms 0.1.0"`).
    #[serde(default)]
    pub software: String,
    /// Server only: the driver the process runs on (`"cuda"` or `"sim"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Server only: what it supports beyond the first release of this protocol version
    /// ([`FEATURE_CHUNKS`]); absent (empty) from servers that predate features.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
}

impl Hello {
    /// True if the peer announced `feature`.
    pub fn has(&self, feature: &str) -> bool {
        self.features.iter().any(|f| f == feature)
    }
}

/// Chunk indices on the wire: inclusive ranges `[first, last]`, sorted (`[[8,15],[20,20]]` is
/// chunks 8 to 15 and 20). Ranges rather than single indices, so that a request naming many
/// chunks still fits a request line ([`MAX_LINE_BYTES`]).
pub type ChunkRanges = Vec<[u64; 2]>;

/// The ranges of sorted, distinct chunk indices (`[2,3,4,9]` -> `[[2,4],[9,9]]`).
pub fn chunk_ranges(idx: &[usize]) -> ChunkRanges {
    let mut out: ChunkRanges = Vec::new();
    for &i in idx {
        let i = i as u64;
        match out.last_mut() {
            Some(r) if r[1].checked_add(1) == Some(i) => r[1] = i,
            _ => out.push([i, i]),
        }
    }
    out
}

/// The chunk indices of `ranges`, sorted, each once (ranges may overlap or come in any order).
/// At most `limit` indices in all, counted before duplicates go.
pub fn expand_chunk_ranges(ranges: &[[u64; 2]], limit: usize) -> Result<Vec<usize>, ParseError> {
    let mut total: u64 = 0;
    for &[a, b] in ranges {
        if a > b {
            return Err(ParseError::RangeBackwards { first: a, last: b });
        }
        total = total.saturating_add((b - a).saturating_add(1));
        if total > limit as u64 {
            return Err(ParseError::TooManyChunks { limit });
        }
    }
    let mut out = Vec::with_capacity(total as usize);
    let index =
        |chunk: u64| usize::try_from(chunk).map_err(|_| ParseError::ChunkOutOfRange { chunk });
    for &[a, b] in ranges {
        // Bounded by `limit` above; indices past usize cannot be chunks of anything.
        let (a, b) = (index(a)?, index(b)?);
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Kind of host memory a CPU backup lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackupBackend {
    /// Page-locked host memory.
    Pinned,
    /// Pageable anonymous memory.
    Mmap,
}

impl BackupBackend {
    /// `"pinned"` or `"mmap"`.
    pub fn as_str(self) -> &'static str {
        match self {
            BackupBackend::Pinned => "pinned",
            BackupBackend::Mmap => "mmap",
        }
    }
}

/// A change to the process-wide default region (what threads that have not entered a region
/// of their own get). Fields left out keep their current value.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionUpdate {
    /// Allocations are pauseable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Their tag (not empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// They keep a CPU backup across pause.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_backup: Option<bool>,
    /// In this kind of host memory (only with a CPU backup).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<BackupBackend>,
    /// They keep a disk backup across pause (never together with a CPU backup). Servers that
    /// report `disk_backup` in [`RegionInfo`] take it; older ones refuse it as unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_backup: Option<bool>,
}

/// What a client asks for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Must come first; answered by [`Reply::Hello`].
    Hello(Hello),
    /// Answered by [`Reply::Pong`].
    Ping,
    /// Tags, allocations, bytes, device memory; answered by [`Reply::Status`].
    Status,
    /// Pause the active allocations of `tag` (every tag when absent), or some chunks of its
    /// chunked allocation; answered by [`Reply::Done`].
    Pause {
        /// The tag, or none for every tag.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tag: Option<String>,
        /// Only these chunks of the tag's one chunked allocation (a tag is needed; an error
        /// when it has no chunked allocation, or several). Servers with [`FEATURE_CHUNKS`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        chunks: Option<ChunkRanges>,
        /// First record which chunks of each chunked allocation are active, for a resume with
        /// `chunk_state` (not with `chunks`). Servers with [`FEATURE_CHUNKS`].
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        chunk_state: bool,
        /// With `chunk_state`: the job's record (a job-wide operation's, for its undo), not the
        /// program's. Servers with [`FEATURE_JOB_RECORD`].
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        job_record: bool,
    },
    /// Resume the paused allocations of `tag` (every tag when absent), or some chunks of its
    /// chunked allocation; answered by [`Reply::Done`].
    Resume {
        /// The tag, or none for every tag.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tag: Option<String>,
        /// Only these chunks of the tag's one chunked allocation, as for [`Request::Pause`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        chunks: Option<ChunkRanges>,
        /// Resume only the chunks a pause with `chunk_state` recorded active (every chunk of
        /// an allocation without such a record; not with `chunks`). Servers with
        /// [`FEATURE_CHUNKS`].
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        chunk_state: bool,
        /// With `chunk_state`: the job's record, as for [`Request::Pause`]. Servers with
        /// [`FEATURE_JOB_RECORD`].
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        job_record: bool,
        /// Answer once the memory is mapped, with the contents still being restored in the
        /// process (a whole tag only: not with `chunks` or `chunk_state`). Servers with
        /// [`FEATURE_NO_WAIT`].
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        no_wait: bool,
    },
    /// The chunks of the one chunked allocation of `tag` and which are active; answered by
    /// [`Reply::Chunks`]. Servers with [`FEATURE_CHUNKS`].
    Chunks {
        /// The tag.
        tag: String,
    },
    /// The process-wide default region; answered by [`Reply::Region`].
    GetRegion,
    /// Change the process-wide default region; answered by [`Reply::Region`] with the result.
    SetRegion(RegionUpdate),
}

/// The process-wide default region.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    /// Allocations of threads without a region of their own are pauseable.
    pub enabled: bool,
    /// Their tag.
    pub tag: String,
    /// They keep a CPU backup across pause.
    pub cpu_backup: bool,
    /// The host memory of that backup.
    pub backend: BackupBackend,
    /// They keep a disk backup across pause instead. Absent (false) from servers that predate
    /// it in this reply.
    #[serde(default)]
    pub disk_backup: bool,
}

/// Duration and size of the last pause or resume that touched a tag.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpTiming {
    /// Allocations that changed state.
    pub allocations: u64,
    /// Device bytes released or re-taken.
    pub bytes: u64,
    /// Bytes copied to or from host backups.
    pub copied_bytes: u64,
    /// Wall time of the whole call.
    pub seconds: f64,
    /// Throughput in GiB/s (copied bytes, or device bytes when nothing was copied).
    pub gib_per_s: f64,
}

/// One tag's numbers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TagStatus {
    /// The tag.
    pub tag: String,
    /// Allocations of the tag.
    pub allocations: u64,
    /// Of those, active.
    pub active_allocations: u64,
    /// Of those, paused.
    pub paused_allocations: u64,
    /// Of those, allocations with some parts active and the others paused (neither active nor
    /// paused above): chunked ones, or one a failed pause could not make whole again. Absent
    /// (0) from servers that predate chunks.
    #[serde(default)]
    pub partial_allocations: u64,
    /// Of those, allocations a non-blocking resume is restoring (mapped again, contents on
    /// their way): neither active nor paused. Absent (0) from servers that predate it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub restoring_allocations: u64,
    /// Of the active ones, allocations kept resident (`keep_resident`), which a pause leaves
    /// mapped. Absent (0) where none, and from servers that predate it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub resident_allocations: u64,
    /// Bytes asked for, all allocations.
    pub bytes_requested: u64,
    /// Mapped bytes of active allocations and of the active chunks of partial ones (device
    /// memory held).
    pub bytes_active: u64,
    /// Mapped bytes of paused allocations and of the paused chunks of partial ones (device
    /// memory given back).
    pub bytes_paused: u64,
    /// Mapped bytes a non-blocking resume mapped again whose contents are on their way (device
    /// memory held): neither active nor paused. Absent (0) from servers that predate it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bytes_restoring: u64,
    /// Mapped bytes a non-blocking resume left mapped when it failed after returning: device
    /// memory held, contents not restored (paused with their backups; a pause gives the memory
    /// back, a resume restores them). Neither active nor paused. Absent (0) where none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bytes_unrestored: u64,
    /// The error of a non-blocking resume that failed after returning, while allocations of
    /// the tag it left unrestored are so. Absent where none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_restore: Option<String>,
    /// Host memory held by backups.
    pub host_backup_bytes: u64,
    /// Bytes of disk backup files.
    #[serde(default)]
    pub disk_backup_bytes: u64,
    /// Last pause that touched the tag.
    #[serde(default)]
    pub last_pause: Option<OpTiming>,
    /// Last resume that touched the tag.
    #[serde(default)]
    pub last_resume: Option<OpTiming>,
}

/// Free and total memory of one device, as the driver reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemory {
    /// Device ordinal.
    pub device: i32,
    /// Bytes free.
    pub free_bytes: u64,
    /// Bytes the device has.
    pub total_bytes: u64,
    /// Why the numbers are missing, when the driver could not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Everything `status` reports about a process.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// Process id.
    pub pid: u32,
    /// `"cuda"` or `"sim"`.
    pub backend: String,
    /// Whether host backups are kept across resume.
    pub retain_cpu_backup: bool,
    /// Pauseable allocations leaving fewer bytes free are refused.
    pub memory_margin_bytes: u64,
    /// Device memory, per device.
    pub devices: Vec<DeviceMemory>,
    /// Per tag, sorted by tag. A tag longer than the server's bound is shown shortened (its
    /// start, then `…(N bytes, hash H)`), so that the reply always fits [`MAX_REPLY_BYTES`].
    pub tags: Vec<TagStatus>,
    /// Tags left out at the end of `tags` because the reply would not fit [`MAX_REPLY_BYTES`]
    /// otherwise. Absent (0) when every tag is listed, and from servers that predate it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tags_omitted: u64,
    /// The process-wide default region, when it can be read.
    #[serde(default)]
    pub default_region: Option<RegionInfo>,
    /// Pauses and resumes asked for over the control socket that have not ended (running, or
    /// waiting for another to end), oldest first. Servers with [`FEATURE_OPERATIONS`].
    /// Servers with [`FEATURE_PROGRESS`] list the one started inside the process through its
    /// API too (last), and give each its progress.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub operations: Vec<Running>,
}

/// What a running pause or resume is doing ([`Running::phase`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Phase {
    /// Asked for, waiting for another pause or resume of the process to end.
    Waiting,
    /// Choosing its allocations, checking host memory or disk space, making backups.
    Preparing,
    /// Waiting for the work queued on the device to finish (a pause).
    Synchronizing,
    /// Mapping device memory again (a resume), before or between copies.
    Mapping,
    /// Copying device memory to host backups (a pause).
    CopyingToHost,
    /// Writing device memory to disk backup files (a pause).
    WritingToDisk,
    /// Reading disk backup files back (a resume).
    ReadingFromDisk,
    /// Copying host backups back to the device (a resume).
    CopyingToDevice,
    /// Giving memory back: the device memory of what is saved (a pause), the host backups
    /// (a resume without retention).
    Releasing,
    /// A phase this side does not know (sent by a newer peer).
    #[serde(other)]
    Unknown,
}

impl Phase {
    /// The wire name (`"writing_to_disk"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Waiting => "waiting",
            Phase::Preparing => "preparing",
            Phase::Synchronizing => "synchronizing",
            Phase::Mapping => "mapping",
            Phase::CopyingToHost => "copying_to_host",
            Phase::WritingToDisk => "writing_to_disk",
            Phase::ReadingFromDisk => "reading_from_disk",
            Phase::CopyingToDevice => "copying_to_device",
            Phase::Releasing => "releasing",
            Phase::Unknown => "unknown",
        }
    }
}

/// Where the contents a pause or resume copies go or come from ([`Running::backing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Backing {
    /// Host memory (CPU backups).
    Host,
    /// Disk backup files.
    Disk,
    /// Some of each (a pause or resume of several tags).
    HostAndDisk,
    /// A kind this side does not know (sent by a newer peer).
    #[serde(other)]
    Unknown,
}

/// A pause or resume that has not ended: asked for over the control socket, or (servers with
/// [`FEATURE_PROGRESS`]) started inside the process through its API.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Running {
    /// Which operation.
    pub op: Op,
    /// The tag, or none for every tag (shown shortened past the server's bound, as in
    /// [`Status::tags`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// The chunks asked for, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<ChunkRanges>,
    /// Seconds since it was asked for (since it started, for one started in the process).
    pub seconds: f64,
    /// Started inside the process through its API (Python, C), not over the socket. Absent
    /// (false) otherwise, and from servers that predate [`FEATURE_PROGRESS`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_process: bool,
    /// What it is doing now. Servers with [`FEATURE_PROGRESS`]; absent from older ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// Bytes it is to copy to or from backups in all (0: nothing to copy), known once it has
    /// prepared (absent while it waits for another operation). Servers with
    /// [`FEATURE_PROGRESS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_total: Option<u64>,
    /// Of those, bytes copied so far. Servers with [`FEATURE_PROGRESS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_done: Option<u64>,
    /// Where the copies go or come from; absent when nothing is copied. Servers with
    /// [`FEATURE_PROGRESS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backing: Option<Backing>,
    /// Copy rate so far, `bytes_done` over the time since its first copy, in GiB/s. Servers
    /// with [`FEATURE_PROGRESS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gib_per_s: Option<f64>,
}

impl Running {
    /// A pause or resume of `tag` with no progress known (what servers that predate
    /// [`FEATURE_PROGRESS`] report).
    pub fn new(op: Op, tag: Option<String>, chunks: Option<ChunkRanges>, seconds: f64) -> Running {
        Running {
            op,
            tag,
            chunks,
            seconds,
            in_process: false,
            phase: None,
            bytes_total: None,
            bytes_done: None,
            backing: None,
            gib_per_s: None,
        }
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Status {
    /// Sum of `bytes_active` over the tags.
    pub fn bytes_active(&self) -> u64 {
        self.tags.iter().map(|t| t.bytes_active).sum()
    }

    /// Sum of `bytes_paused` over the tags.
    pub fn bytes_paused(&self) -> u64 {
        self.tags.iter().map(|t| t.bytes_paused).sum()
    }

    /// Sum of `host_backup_bytes` over the tags.
    pub fn host_backup_bytes(&self) -> u64 {
        self.tags.iter().map(|t| t.host_backup_bytes).sum()
    }
}

/// Which operation a [`Reply::Done`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// A pause.
    Pause,
    /// A resume.
    Resume,
}

/// Outcome of a pause or resume.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpDone {
    /// Which operation.
    pub op: Op,
    /// The tag, or none for every tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// The chunks asked for, when the request named some (as it gave them, normalised).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<ChunkRanges>,
    /// Allocations that changed state.
    pub allocations: u64,
    /// Device bytes released (pause) or re-taken (resume).
    pub bytes: u64,
    /// Bytes copied to or from backups (host memory or disk files).
    pub copied_bytes: u64,
    /// Of `copied_bytes`, those written to or read from disk backup files (the rest went to or
    /// came from host memory). Absent from servers that predate [`FEATURE_PROGRESS`], which
    /// do not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_copied_bytes: Option<u64>,
    /// Wall time of the call.
    pub seconds: f64,
    /// A tag was given that no allocation of the process has: nothing could change (a typo,
    /// perhaps). Absent (false) otherwise, and from servers that predate it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unknown_tag: bool,
    /// Of `bytes`, those a `no_wait` resume was still restoring when it answered. Absent
    /// (zero) otherwise.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pending_bytes: u64,
}

/// The chunks of one chunked allocation and their states.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkStatus {
    /// The tag.
    pub tag: String,
    /// Start address of the allocation.
    pub addr: u64,
    /// Bytes of each chunk.
    pub chunk_size: u64,
    /// Chunks of the allocation.
    pub count: u64,
    /// One character per chunk, in order: `1` active (mapped, its contents on the device), `0`
    /// paused. A character rather than a list entry each, so that a reply about half a million
    /// chunks takes half a megabyte.
    pub states: String,
}

impl ChunkStatus {
    /// `states` from one flag per chunk (true: active).
    pub fn states_of(active: &[bool]) -> String {
        active.iter().map(|a| if *a { '1' } else { '0' }).collect()
    }

    /// Indices of the active chunks.
    pub fn active(&self) -> Vec<usize> {
        self.with_state(b'1')
    }

    /// Indices of the paused chunks.
    pub fn paused(&self) -> Vec<usize> {
        self.with_state(b'0')
    }

    fn with_state(&self, c: u8) -> Vec<usize> {
        self.states
            .bytes()
            .enumerate()
            .filter(|(_, s)| *s == c)
            .map(|(i, _)| i)
            .collect()
    }
}

/// What kind of failure an error reply reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorKind {
    /// The line is not a request of this protocol (not JSON, unknown operation or field).
    BadRequest,
    /// The line is longer than [`MAX_LINE_BYTES`].
    LineTooLong,
    /// The client did not send a whole line in time.
    Timeout,
    /// The client speaks another protocol version.
    VersionMismatch,
    /// The first message was not a hello.
    HelloRequired,
    /// The client runs as another user.
    PermissionDenied,
    /// Device or host memory ran out (a resume stays paused with its backups; retry later).
    OutOfMemory,
    /// A value in the request cannot be right.
    InvalidArgument,
    /// Not valid in the process's current state.
    InvalidState,
    /// Unknown tag or address.
    NotFound,
    /// A driver call failed.
    Driver,
    /// Not available with this driver or build.
    Unsupported,
    /// An operating-system call failed.
    Io,
    /// A bug in the server (caught; the process carries on).
    Internal,
    /// The server has no room for this connection (too many at once), or closed it to make
    /// room for a newer one while it sat idle; connect again.
    Busy,
    /// A kind this side does not know (sent by a newer peer).
    #[serde(other)]
    Unknown,
}

impl ErrorKind {
    /// True for kinds after which the server closes the connection (the request itself was
    /// unacceptable, as opposed to an operation that failed).
    pub fn closes_connection(self) -> bool {
        matches!(
            self,
            ErrorKind::BadRequest
                | ErrorKind::LineTooLong
                | ErrorKind::Timeout
                | ErrorKind::VersionMismatch
                | ErrorKind::HelloRequired
                | ErrorKind::PermissionDenied
                | ErrorKind::Busy
        )
    }
}

/// An error reply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// What failed and where, for people.
    pub message: String,
}

/// What the server answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// Answer to [`Request::Hello`].
    Hello(Hello),
    /// Answer to [`Request::Ping`].
    Pong {
        /// The server's process id.
        pid: u32,
    },
    /// Answer to [`Request::Status`].
    Status(Box<Status>),
    /// Answer to [`Request::Pause`] and [`Request::Resume`].
    Done(OpDone),
    /// Answer to [`Request::GetRegion`] and [`Request::SetRegion`].
    Region(RegionInfo),
    /// Answer to [`Request::Chunks`].
    Chunks(ChunkStatus),
    /// The request failed.
    Error(ErrorReply),
}

impl Reply {
    /// An error reply.
    pub fn error(kind: ErrorKind, message: impl Into<String>) -> Reply {
        Reply::Error(ErrorReply {
            kind,
            message: message.into(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding and encoding

/// Why a line could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtoError {
    /// Longer than the limit.
    TooLong {
        /// Bytes seen (at least).
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Nothing but white space.
    Empty,
    /// Not a message of this protocol.
    Malformed(String),
}

impl ProtoError {
    /// The error kind of the reply that reports this.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ProtoError::TooLong { .. } => ErrorKind::LineTooLong,
            ProtoError::Empty | ProtoError::Malformed(_) => ErrorKind::BadRequest,
        }
    }

    /// The error reply that reports this.
    pub fn to_reply(&self) -> Reply {
        Reply::error(self.kind(), self.to_string())
    }
}

impl fmt::Display for ProtoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtoError::TooLong { len, max } => {
                write!(f, "line of {len} bytes or more is over the limit of {max}")
            }
            ProtoError::Empty => f.write_str("empty line"),
            ProtoError::Malformed(m) => write!(f, "malformed message: {m}"),
        }
    }
}

impl std::error::Error for ProtoError {}

fn shorten(mut s: String) -> String {
    if s.chars().count() > MAX_MESSAGE_CHARS {
        s = s.chars().take(MAX_MESSAGE_CHARS).collect();
        s.push_str("...");
    }
    s
}

fn decode<T: serde::de::DeserializeOwned>(line: &[u8], max: usize) -> Result<T, ProtoError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.len() > max {
        return Err(ProtoError::TooLong {
            len: line.len(),
            max,
        });
    }
    if line.iter().all(u8::is_ascii_whitespace) {
        return Err(ProtoError::Empty);
    }
    serde_json::from_slice(line).map_err(|e| ProtoError::Malformed(shorten(e.to_string())))
}

/// The keys a request without fields may have: `op` only.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpOnly {
    #[serde(rename = "op")]
    _op: serde::de::IgnoredAny,
}

/// Decode one request line (with or without its `\n`). Never panics, whatever the bytes.
///
/// A field the request does not have is rejected, for the operations without fields
/// (`ping`, `status`, `get_region`) too: serde ignores extra keys of a unit variant of an
/// internally tagged enum, so those are checked again here.
pub fn decode_request(line: &[u8]) -> Result<Request, ProtoError> {
    let r: Request = decode(line, MAX_LINE_BYTES)?;
    if matches!(r, Request::Ping | Request::Status | Request::GetRegion) {
        decode::<OpOnly>(line, MAX_LINE_BYTES)?;
    }
    Ok(r)
}

/// Decode one reply line (with or without its `\n`). Never panics, whatever the bytes.
pub fn decode_reply(line: &[u8]) -> Result<Reply, ProtoError> {
    let r: Reply = decode(line, MAX_REPLY_BYTES)?;
    check_quantities(&r).map_err(ProtoError::Malformed)?;
    Ok(r)
}

/// Durations and rates a reply reports are finite and not negative: a server that says
/// otherwise (a bug, or a peer that is not ours) is refused rather than printed.
fn check_quantities(r: &Reply) -> Result<(), String> {
    let check = |what: &str, v: f64| {
        if v.is_finite() && v >= 0.0 {
            Ok(())
        } else {
            Err(format!("{what} is {v}: not a duration or a rate"))
        }
    };
    let timing = |what: &str, t: &Option<OpTiming>| match t {
        Some(t) => check(what, t.seconds).and_then(|()| check(what, t.gib_per_s)),
        None => Ok(()),
    };
    match r {
        Reply::Done(d) => check("seconds", d.seconds),
        Reply::Status(s) => {
            for t in &s.tags {
                timing("last_pause", &t.last_pause)?;
                timing("last_resume", &t.last_resume)?;
            }
            for o in &s.operations {
                check("seconds", o.seconds)?;
                if let Some(g) = o.gib_per_s {
                    check("gib_per_s", g)?;
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// One message as a line: compact JSON and `\n`.
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    // The protocol's types have string keys and finite numbers only, so serialising cannot
    // fail; should it ever, the peer gets a line it rejects rather than this side panicking.
    let mut v = serde_json::to_vec(msg).unwrap_or_else(|e| {
        serde_json::to_vec(&Reply::error(
            ErrorKind::Internal,
            format!("encoding a message: {e}"),
        ))
        .unwrap_or_default()
    });
    v.push(b'\n');
    v
}

// ---------------------------------------------------------------------------------------------
// Framing

/// Splits a byte stream into lines of at most `max` bytes. Pure: the caller reads from its
/// socket (with its own timeouts) and [`push`](LineBuffer::push)es what arrived.
#[derive(Debug)]
pub struct LineBuffer {
    buf: Vec<u8>,
    /// Bytes at the start of `buf` already searched for a newline.
    scanned: usize,
    max: usize,
}

impl LineBuffer {
    /// A buffer for lines of at most `max` bytes (not counting the `\n`).
    pub fn new(max: usize) -> Self {
        LineBuffer {
            buf: Vec::new(),
            scanned: 0,
            max,
        }
    }

    /// Append bytes that arrived.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete line (without its `\n`), an error once more than `max` bytes have
    /// arrived without a newline, or `None` when more bytes are needed.
    pub fn next_line(&mut self) -> Option<Result<Vec<u8>, ProtoError>> {
        let limit = self.buf.len().min(self.max.saturating_add(1));
        if let Some(i) = self.buf[self.scanned..limit]
            .iter()
            .position(|b| *b == b'\n')
        {
            let end = self.scanned + i;
            let mut line: Vec<u8> = self.buf.drain(..=end).collect();
            line.pop();
            self.scanned = 0;
            return Some(Ok(line));
        }
        self.scanned = limit;
        if self.buf.len() > self.max {
            return Some(Err(ProtoError::TooLong {
                len: self.buf.len(),
                max: self.max,
            }));
        }
        None
    }

    /// Bytes received of a line not yet complete.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

// ---------------------------------------------------------------------------------------------
// Where the sockets are

/// The folder of the control sockets: `tms_socket_dir` (`$TMS_SOCKET_DIR`) if set and not
/// empty, else `<xdg_runtime_dir>/tms` (`$XDG_RUNTIME_DIR`) if set and not empty, else
/// `/tmp/tms-<uid>`. Server and client compute it the same way.
pub fn socket_dir(
    tms_socket_dir: Option<OsString>,
    xdg_runtime_dir: Option<OsString>,
    uid: u32,
) -> PathBuf {
    match (tms_socket_dir, xdg_runtime_dir) {
        (Some(d), _) if !d.is_empty() => PathBuf::from(d),
        (_, Some(x)) if !x.is_empty() => PathBuf::from(x).join("tms"),
        _ => PathBuf::from(format!("/tmp/tms-{uid}")),
    }
}

/// [`socket_dir`] from this process's environment.
pub fn socket_dir_from_env(uid: u32) -> PathBuf {
    socket_dir(
        std::env::var_os("TMS_SOCKET_DIR"),
        std::env::var_os("XDG_RUNTIME_DIR"),
        uid,
    )
}

/// Where a socket file says its process is: the pid as that process sees it, and the inode of
/// its pid namespace (`/proc/self/ns/pid`), which tells processes of different namespaces
/// apart (two of them can have the same pid, and a pid of another namespace cannot be probed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SocketName {
    /// The process id, in the process's own pid namespace.
    pub pid: u32,
    /// The inode of that pid namespace; `None` where it could not be read (no `/proc`), and for
    /// sockets named by earlier versions.
    pub pidns: Option<u64>,
}

impl SocketName {
    /// File name of the socket: `<pid>.<pidns>.sock`, or `<pid>.sock` without a namespace.
    pub fn file_name(&self) -> String {
        match self.pidns {
            Some(ns) => format!("{}.{ns}.sock", self.pid),
            None => format!("{}.sock", self.pid),
        }
    }

    /// Parse a socket file name; `None` for any other name.
    pub fn parse(name: &str) -> Option<SocketName> {
        fn number<T: std::str::FromStr>(s: &str) -> Option<T> {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || s.starts_with('0') {
                return None;
            }
            s.parse().ok()
        }
        let stem = name.strip_suffix(".sock")?;
        let (pid, pidns) = match stem.split_once('.') {
            Some((pid, ns)) => (pid, Some(number::<u64>(ns)?)),
            None => (stem, None),
        };
        let pid = number::<u32>(pid).filter(|p| *p > 0 && *p <= i32::MAX as u32)?;
        Some(SocketName { pid, pidns })
    }
}

/// The inode of this process's pid namespace, or `None` where `/proc` cannot say.
pub fn pid_namespace() -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

/// File name of the socket of process `pid` in this process's pid namespace.
pub fn socket_file_name(pid: u32) -> String {
    SocketName {
        pid,
        pidns: pid_namespace(),
    }
    .file_name()
}

/// The pid in a socket file name (`"1234.4026531836.sock"` or `"1234.sock"` -> 1234); `None`
/// for any other name.
pub fn pid_of_socket_file(name: &str) -> Option<u32> {
    SocketName::parse(name).map(|n| n.pid)
}

/// Parse a byte count: a plain integer, or one with a suffix `K`, `M`, `G`, `T` (powers of
/// 1024; `KiB`/`KB`/`k` spellings accepted). Shared by the library's settings and tmsctl.
pub fn parse_bytes(s: &str) -> Result<u64, ParseError> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || ParseError::ByteSize { text: s.into() };
    let n: u64 = num.parse().map_err(|_| bad())?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

/// A byte count in the largest binary unit that leaves at least 1 (up to TiB): `(1.5, "GiB")`.
/// Under 1 KiB the unit is `"B"` and the value the count itself.
pub fn scaled_bytes(bytes: u64) -> (f64, &'static str) {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    (v, UNITS[i])
}

/// `1.50 GiB`-style rendering of a byte count, shared by the library's messages and tmsctl.
pub fn human_bytes(bytes: u64) -> String {
    match scaled_bytes(bytes) {
        (_, "B") => format!("{bytes} B"),
        (v, unit) => format!("{v:.2} {unit}"),
    }
}

#[cfg(test)]
mod tests;

/// Chunk indices as ranges, the way `tmsctl --chunks` takes them: `"0-3,8,10-11"` (sorted,
/// each index once; `""` for none).
pub fn format_ranges(idx: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && idx[j + 1] == idx[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            idx[i].to_string()
        } else {
            format!("{}-{}", idx[i], idx[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// Parse chunk indices: comma-separated indices and inclusive ranges (`"8-15,20"`), returned
/// sorted, each once; no whitespace. At most `limit` indices, so that a typo cannot ask for
/// billions.
pub fn parse_ranges(s: &str, limit: usize) -> Result<Vec<usize>, ParseError> {
    let bad = |fault: ListFault| ParseError::ChunkList {
        text: s.into(),
        fault,
    };
    // One way to write a list: a stray space is more likely a mistake (a shell quote, two
    // arguments run together) than a layout.
    if s.chars().any(char::is_whitespace) {
        return Err(bad(ListFault::Whitespace));
    }
    let mut out = Vec::new();
    for part in s.split(',') {
        if part.is_empty() {
            return Err(bad(ListFault::EmptyItem));
        }
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        // Digits only: `parse` would take "+1" for 1.
        let num = |x: &str| {
            x.bytes()
                .all(|b| b.is_ascii_digit())
                .then(|| x.parse::<usize>().ok())
                .flatten()
                .ok_or_else(|| bad(ListFault::NotAnIndex { item: x.into() }))
        };
        let (a, b) = (num(a)?, num(b)?);
        if a > b {
            return Err(bad(ListFault::Backwards { first: a, last: b }));
        }
        if b - a >= limit || out.len() + (b - a + 1) > limit {
            return Err(bad(ListFault::TooMany { limit }));
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}
