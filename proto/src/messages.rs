//! The messages of the control protocol: what a client asks ([`Request`]), what the server
//! answers ([`Reply`]), and the values they carry; the protocol's version, and the features a
//! server announces beyond it ([`Hello::features`]).

use serde::{Deserialize, Serialize};

/// Protocol version; a client and server agree on it in the hello exchange.
pub const PROTOCOL_VERSION: u32 = 1;

/// Most chunk indices one request may name (a typo cannot ask for billions).
pub const MAX_CHUNK_INDICES: usize = 1 << 20;

/// Longest tag a reply shows whole, in bytes; a longer one is shown by [`shown_tag`].
pub const MAX_SHOWN_TAG_BYTES: usize = 1024;

/// `tag` as replies show it: whole up to [`MAX_SHOWN_TAG_BYTES`], else its first bytes (cut at
/// a character boundary), then `…(N bytes, hash H)` with its length and a 64-bit FNV-1a hash of
/// it, so two long tags with the same beginning still look different. Here, not in the server
/// alone, so that a client finds a tag it named in a reply by comparing it in this form.
pub fn shown_tag(tag: &str) -> String {
    if tag.len() <= MAX_SHOWN_TAG_BYTES {
        return tag.to_string();
    }
    let mut end = MAX_SHOWN_TAG_BYTES;
    while !tag.is_char_boundary(end) {
        end -= 1;
    }
    let hash = tag.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!(
        "{}\u{2026}({} bytes, hash {hash:016x})",
        &tag[..end],
        tag.len()
    )
}

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

/// The feature of servers that check a resume's contents against the backups
/// ([`Request::Resume`]'s `verify`, [`OpDone::verified_bytes`]) and skip unchanged memory at
/// pause ([`OpDone::unchanged_bytes`]).
pub const FEATURE_VERIFY: &str = "verify";

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
/// chunks still fits a request line ([`MAX_LINE_BYTES`](crate::MAX_LINE_BYTES)). `tms_units::runs` makes them from
/// indices, reads them back and writes them for people.
pub type ChunkRanges = Vec<[u64; 2]>;

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
        /// Check what came back against the backups, failing (and staying paused) on a
        /// difference. Servers with [`FEATURE_VERIFY`].
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        verify: bool,
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
    /// Mapped bytes a non-blocking resume left mapped when it failed after returning, or that
    /// the undo of another failed call could not unmap: device memory held, contents not
    /// restored (paused with their backups; a pause gives the memory back, a resume restores
    /// them). Neither active nor paused. Absent (0) where none.
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
    /// The tag `nccl` only: NCCL's communicators (its allocations count communicators, its
    /// bytes NCCL's own). Absent from every other tag, and from servers that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nccl: Option<NcclStatus>,
}

/// NCCL's communicators, as the status of the tag `nccl` reports them
/// (`ncclCommMemStats`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NcclStatus {
    /// The NCCL the process loaded (`2.29.7`); absent where none was found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Why the communicators cannot be suspended (an NCCL without `ncclCommSuspend`); absent
    /// where they can.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unsupported: Option<String>,
    /// Live communicators known to the library.
    #[serde(default)]
    pub communicators: u64,
    /// Of those, suspended.
    #[serde(default)]
    pub suspended: u64,
    /// Device memory NCCL can give back, all communicators.
    #[serde(default)]
    pub suspendable_bytes: u64,
    /// Of that, given back now (the suspended communicators').
    #[serde(default)]
    pub suspended_bytes: u64,
    /// Device memory NCCL keeps while suspended.
    #[serde(default)]
    pub persistent_bytes: u64,
    /// Device memory NCCL tracks.
    #[serde(default)]
    pub total_bytes: u64,
    /// The first failure to read those numbers, where one failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Buffers registered with NCCL (`ncclCommRegister`, `ncclCommWindowRegister`).
    #[serde(default)]
    pub registered_buffers: u64,
    /// Their bytes.
    #[serde(default)]
    pub registered_bytes: u64,
    /// A pause or resume of every tag includes the communicators.
    #[serde(default)]
    pub in_all_tags: bool,
    /// What a pause does with an allocation holding a registered buffer: `keep` or `refuse`.
    #[serde(default)]
    pub registered_policy: String,
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
    /// start, then `…(N bytes, hash H)`), so that the reply always fits [`MAX_REPLY_BYTES`](crate::MAX_REPLY_BYTES).
    pub tags: Vec<TagStatus>,
    /// Tags left out at the end of `tags` because the reply would not fit [`MAX_REPLY_BYTES`](crate::MAX_REPLY_BYTES)
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
    /// Every phase, `Unknown` last.
    pub const ALL: [Phase; 10] = [
        Phase::Waiting,
        Phase::Preparing,
        Phase::Synchronizing,
        Phase::Mapping,
        Phase::CopyingToHost,
        Phase::WritingToDisk,
        Phase::ReadingFromDisk,
        Phase::CopyingToDevice,
        Phase::Releasing,
        Phase::Unknown,
    ];

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
    /// NCCL communicators suspended or resumed (the tag `nccl`; their bytes are in `bytes`).
    /// Absent (zero) otherwise, and from servers that predate it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub communicators: u64,
    /// A pause: bytes found unchanged since the retained backup took them, not copied (not in
    /// `copied_bytes`). Absent (zero) otherwise.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unchanged_bytes: u64,
    /// A resume: bytes checked against the backups after the restore. Absent (zero)
    /// otherwise.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub verified_bytes: u64,
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
    /// The line is longer than [`MAX_LINE_BYTES`](crate::MAX_LINE_BYTES).
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
    /// The server has no room for this connection (too many at once), closed it to make room
    /// for a newer one while it sat idle, or the connection has served its most requests;
    /// connect again.
    Busy,
    /// A kind this side does not know (sent by a newer peer).
    #[serde(other)]
    Unknown,
}

impl ErrorKind {
    /// Every kind, `Unknown` last.
    pub const ALL: [ErrorKind; 16] = [
        ErrorKind::BadRequest,
        ErrorKind::LineTooLong,
        ErrorKind::Timeout,
        ErrorKind::VersionMismatch,
        ErrorKind::HelloRequired,
        ErrorKind::PermissionDenied,
        ErrorKind::OutOfMemory,
        ErrorKind::InvalidArgument,
        ErrorKind::InvalidState,
        ErrorKind::NotFound,
        ErrorKind::Driver,
        ErrorKind::Unsupported,
        ErrorKind::Io,
        ErrorKind::Internal,
        ErrorKind::Busy,
        ErrorKind::Unknown,
    ];

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
    /// A pause or resume that failed: what it changed all the same and left so (all zero where
    /// it changed nothing), for a client that undoes it (`tmsctl pause --atomic`) to decide
    /// from, not from the state, which the program may change meanwhile. Absent from other
    /// failures, from a pause or resume whose server cannot tell (a caught panic), and from
    /// servers that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changed: Option<Changed>,
}

/// What a failed pause or resume changed all the same ([`ErrorReply::changed`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Changed {
    /// Allocations it left in another state than before it: some or all of their memory (their
    /// chunks) paused by a pause, resumed by a resume.
    pub allocations: u64,
    /// The device bytes of that memory, and of the communicators below (as NCCL counts them).
    pub bytes: u64,
    /// NCCL communicators it left suspended (a pause) or resumed (a resume). Absent (zero)
    /// where none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub communicators: u64,
}

impl Changed {
    /// Whether it changed nothing.
    pub fn is_nothing(&self) -> bool {
        *self == Changed::default()
    }
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
            changed: None,
        })
    }
}
