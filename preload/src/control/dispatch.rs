//! Requests to the engine: each operation calls the same engine methods as the C ABI and the
//! Python shim, so it takes the same engine locks (the operations lock for a pause or resume,
//! the registry lock briefly for status) and the same pause/resume path (which synchronises
//! each device concerned before unmapping anything).
//!
//! Replies stay within the client's limit ([`MAX_REPLY_BYTES`]) whatever the process holds: a
//! tag longer than [`MAX_SHOWN_TAG_BYTES`] is shown shortened ([`shown_tag`]), and a status
//! with more tags than fit lists the first ones and counts the rest ([`Status::tags_omitted`]).
//!
//! Chunks (Note [Chunked allocations] in the engine): a pause or resume with `chunks` acts on
//! those chunks of the tag's one chunked allocation ([`Engine::chunked`]), through the same
//! [`Engine::pause_pick`] and [`Engine::resume_pick`] as the C ABI's chunk calls; `chunk_state`
//! is the C ABI's `tms_pause_ex`/`tms_resume_ex` flag. `chunks` lists a chunked allocation's
//! chunk states, one character each, so that even half a million chunks fit a reply.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

use tms_proto::{
    Backing, BackupBackend, Changed, ChunkRanges, ChunkStatus, DeviceMemory, ErrorKind, ErrorReply,
    NcclStatus, Op, OpDone, OpTiming, Phase, RegionInfo, RegionUpdate, Reply, Request, Running,
    Status, TagStatus, MAX_CHUNK_INDICES, MAX_REPLY_BYTES,
};
use tms_units::{chunk_ranges, expand_chunk_ranges};

/// How replies show a tag: in the protocol crate, as clients compare the tags they named in it.
pub use tms_proto::{shown_tag, MAX_SHOWN_TAG_BYTES};

use crate::backup::BackupKind;
use crate::engine::{self, CommStats, Engine, OpReport, OpStats, Pick, Progress, Record, Stats};
use crate::error::{status, Error, Result};
use crate::process::settings::RegionSettings;

/// What the server acts on: the engine and the process-wide default region. The process's
/// implementation uses the one [`Runtime`](crate::Runtime) and the settings module; tests use
/// their own engine.
pub trait Host: Sync {
    /// The engine.
    fn engine(&self) -> &Engine;
    /// A non-blocking resume of `tag` on the engine (which the resume's thread must hold on
    /// to), its progress labelled `label`: no stream waits, the process's own waits see it.
    fn resume_nonblocking(&self, tag: Option<&str>, label: u64) -> Result<OpReport>;
    /// Region settings of threads that have not set their own.
    fn default_region(&self) -> Result<RegionSettings>;
    /// Change them.
    fn set_default_region(&self, r: RegionSettings);
}

/// The error kind of an engine error.
pub fn kind_of(e: &Error) -> ErrorKind {
    match e.status() {
        status::OUT_OF_MEMORY => ErrorKind::OutOfMemory,
        status::DRIVER => ErrorKind::Driver,
        status::INVALID_ARGUMENT => ErrorKind::InvalidArgument,
        status::INVALID_STATE => ErrorKind::InvalidState,
        status::NOT_FOUND => ErrorKind::NotFound,
        status::UNSUPPORTED => ErrorKind::Unsupported,
        status::IO => ErrorKind::Io,
        _ => ErrorKind::Internal,
    }
}

/// The error reply of `e`, with what a failed pause or resume changed all the same where the
/// engine said (every other request's error says nothing of it).
fn error_reply(e: &Error) -> Reply {
    Reply::Error(ErrorReply {
        kind: kind_of(e),
        message: e.to_string(),
        changed: e.changed().map(|c| Changed {
            allocations: c.allocations as u64,
            bytes: c.bytes,
            communicators: c.communicators as u64,
        }),
    })
}

/// Answer one request (any but the hello, which the session handles).
pub fn dispatch(host: &dyn Host, req: Request) -> Reply {
    let r = match req {
        Request::Ping => Ok(Reply::Pong {
            pid: std::process::id(),
        }),
        Request::Status => Ok(Reply::Status(Box::new(status_of(host)))),
        Request::Pause {
            tag,
            chunks,
            chunk_state,
            job_record,
        } => state(chunk_state, job_record)
            .map_err(Error::unchanged)
            .and_then(|r| op(host, Op::Pause, tag, chunks, r, (false, false))),
        Request::Resume {
            tag,
            chunks,
            chunk_state,
            job_record,
            no_wait,
            verify,
        } => state(chunk_state, job_record)
            .map_err(Error::unchanged)
            .and_then(|r| op(host, Op::Resume, tag, chunks, r, (no_wait, verify))),
        Request::Chunks { tag } => chunks_of(host, &tag),
        Request::GetRegion => host
            .default_region()
            .map(|r| Reply::Region(region_info(&r))),
        Request::SetRegion(u) => set_region(host, u),
        Request::Hello(_) => Ok(Reply::error(
            ErrorKind::BadRequest,
            "hello may only be sent once, first",
        )),
    };
    r.unwrap_or_else(|e| error_reply(&e))
}

/// The pauses and resumes asked for over the socket that have not ended, by order of arrival:
/// `status` lists them, so that a client whose wait ran out can tell that its request still
/// runs, and when it has ended. The process has one engine, hence one table. Each request's
/// number labels its engine operation ([`Pick::label`]), which is how `status` tells the
/// engine's progress report of a request from that of an operation started in the process.
static IN_FLIGHT: Mutex<BTreeMap<u64, Asked>> = Mutex::new(BTreeMap::new());
static NEXT_OP: AtomicU64 = AtomicU64::new(0);

/// An operation of [`IN_FLIGHT`]: what was asked (the tag as replies show it), and when.
type Asked = (Op, Option<String>, Option<ChunkRanges>, Instant);

/// An entry of [`IN_FLIGHT`], removed when dropped (the operation ended, or unwound).
struct InFlight(u64);

impl InFlight {
    /// Record a request; its number labels the engine operation.
    fn new(op: Op, tag: Option<&str>, chunks: Option<&ChunkRanges>) -> InFlight {
        let id = NEXT_OP.fetch_add(1, Ordering::Relaxed);
        IN_FLIGHT.lock().insert(
            id,
            (op, tag.map(shown_tag), chunks.cloned(), Instant::now()),
        );
        InFlight(id)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.lock().remove(&self.0);
    }
}

/// The pauses and resumes that have not ended, with their progress: those asked over the
/// socket (running, or waiting for another operation), oldest first, then the one started in
/// the process through its API, if that is the one running.
fn operations(engine: &Engine) -> Vec<Running> {
    let running = engine.progress();
    // One look at the table, for both lists: an entry gone in between is in neither twice.
    let table = IN_FLIGHT.lock();
    let mut out: Vec<Running> = table
        .iter()
        .map(|(id, (op, tag, chunks, t0))| {
            let mut r = Running::new(
                *op,
                tag.clone(),
                chunks.clone(),
                finite(t0.elapsed().as_secs_f64()),
            );
            match running.as_ref().filter(|p| p.label == Some(*id)) {
                Some(p) => with_progress(&mut r, p),
                // Not started yet (or ending): behind another operation, most of the time.
                None => r.phase = Some(Phase::Waiting),
            }
            r
        })
        .collect();
    // Started in the process, or over the socket but answered already (a resume without
    // waiting, restoring after its reply): its origin is the label's.
    let answered = |p: &engine::Progress| p.label.is_some_and(|id| !table.contains_key(&id));
    if let Some(p) = running.filter(|p| p.label.is_none() || answered(p)) {
        let op = match p.which {
            engine::Which::Pause => Op::Pause,
            engine::Which::Resume => Op::Resume,
        };
        let mut r = Running::new(
            op,
            p.tag.as_deref().map(shown_tag),
            p.chunks.clone(),
            finite(p.seconds),
        );
        r.in_process = p.label.is_none();
        with_progress(&mut r, &p);
        out.push(r);
    }
    drop(table);
    out
}

/// The wire's name for an engine phase (the engine knows no wire types; the C ABI gives the
/// engine's own names, which a test keeps equal to these).
fn wire_phase(p: engine::Phase) -> Phase {
    use engine::Phase as E;
    match p {
        E::Preparing => Phase::Preparing,
        E::Synchronizing => Phase::Synchronizing,
        E::Mapping => Phase::Mapping,
        E::CopyingToHost => Phase::CopyingToHost,
        E::WritingToDisk => Phase::WritingToDisk,
        E::ReadingFromDisk => Phase::ReadingFromDisk,
        E::CopyingToDevice => Phase::CopyingToDevice,
        E::Releasing => Phase::Releasing,
    }
}

/// `r` with the engine's progress report `p` of it.
fn with_progress(r: &mut Running, p: &Progress) {
    r.phase = Some(wire_phase(p.phase));
    r.bytes_total = Some(p.bytes_total);
    r.bytes_done = Some(p.bytes_done.min(p.bytes_total));
    r.backing = match (p.backing.host, p.backing.disk) {
        (true, true) => Some(Backing::HostAndDisk),
        (true, false) => Some(Backing::Host),
        (false, true) => Some(Backing::Disk),
        (false, false) => None,
    };
    r.gib_per_s = (p.copy_seconds > 0.0).then(|| finite(p.rate() / (1u64 << 30) as f64));
}

/// The record of chunk states a request saves or restores, if any: the job's with
/// `job_record`, else the program's.
fn state(chunk_state: bool, job_record: bool) -> Result<Option<Record>> {
    match (chunk_state, job_record) {
        (false, true) => Err(Error::invalid_argument(
            "job_record names the record chunk_state saves or restores: not without chunk_state",
        )),
        (false, false) => Ok(None),
        (true, false) => Ok(Some(Record::Program)),
        (true, true) => Ok(Some(Record::Job)),
    }
}

/// A pause or resume; `record`: the chunk states it saves or restores; `no_wait`: a resume
/// answered once the memory is mapped (Note [Non-blocking resume] in the engine), of a whole
/// tag only; `verify`: a resume that checks what came back (Note [Skipping unchanged memory]),
/// which waits for it.
fn op(
    host: &dyn Host,
    which: Op,
    tag: Option<String>,
    chunks: Option<ChunkRanges>,
    record: Option<Record>,
    (no_wait, verify): (bool, bool),
) -> Result<Reply> {
    let chunk_state = record.is_some();
    if no_wait && (chunks.is_some() || chunk_state) {
        return Err(Error::invalid_argument(
            "a resume without waiting takes a whole tag: not with chunks or chunk_state",
        )
        .unchanged());
    }
    if no_wait && verify {
        return Err(Error::invalid_argument(
            "a verified resume waits for what it checks: not with no_wait",
        )
        .unchanged());
    }
    let in_flight = InFlight::new(which, tag.as_deref(), chunks.as_ref());
    let e = host.engine();
    let run = |pick: &Pick<'_>| {
        let pick = Pick {
            label: Some(in_flight.0),
            verify,
            ..*pick
        };
        match which {
            Op::Pause => e.pause_pick(&pick),
            Op::Resume => e.resume_pick(&pick),
        }
    };
    let done = |r: OpReport, chunks: Option<ChunkRanges>, unknown_tag: bool| {
        Reply::Done(OpDone {
            op: which,
            tag: tag.clone(),
            chunks,
            allocations: r.allocations as u64,
            bytes: r.bytes,
            copied_bytes: r.copied,
            disk_copied_bytes: Some(r.disk_copied),
            seconds: finite(r.seconds),
            unknown_tag,
            pending_bytes: r.pending,
            communicators: r.communicators as u64,
            unchanged_bytes: r.unchanged,
            verified_bytes: r.verified,
        })
    };
    let Some(ranges) = chunks else {
        let r = if no_wait {
            host.resume_nonblocking(tag.as_deref(), in_flight.0)?
        } else {
            run(&Pick {
                chunk_state,
                record: record.unwrap_or_default(),
                ..Pick::tag(tag.as_deref())
            })?
        };
        // Asked after the operation (which refuses an empty tag), from the engine's record of
        // every tag ever allocated: a tag of freed allocations is known, a misspelt one is not.
        let unknown_tag = tag.as_deref().is_some_and(|t| !e.tag_known(t));
        return Ok(done(r, None, unknown_tag));
    };
    let idx = chunk_indices(tag.as_deref(), &ranges, chunk_state).map_err(Error::unchanged)?;
    let t = tag.as_deref().unwrap_or_default();
    if !e.tag_known(t) {
        // As for a whole tag: nothing to act on, and the reply says why (a typo, perhaps).
        return Ok(done(OpReport::default(), Some(chunk_ranges(&idx)), true));
    }
    let ptr = e.chunked(t).map_err(Error::unchanged)?;
    // The tag too, so that an allocation freed meanwhile and another made at its address are
    // never taken for each other.
    let r = run(&Pick {
        tag: Some(t),
        ..Pick::chunks(ptr, &idx)
    })?;
    Ok(done(r, Some(chunk_ranges(&idx)), false))
}

/// The chunk indices a pause or resume of `ranges` of `tag` asks for, sorted and each once;
/// refused without a tag, with `chunk_state`, when empty or more than [`MAX_CHUNK_INDICES`].
/// Whether the allocation has them is the engine's to say (it names any it lacks).
fn chunk_indices(tag: Option<&str>, ranges: &[[u64; 2]], chunk_state: bool) -> Result<Vec<usize>> {
    let bad = |m: String| Err(Error::invalid_argument(m));
    let Some(t) = tag else {
        return bad(
            "chunks need a tag: they are chunks of the tag's chunked allocation".to_string(),
        );
    };
    if t.is_empty() {
        return bad("tag must not be empty (no tag means every tag)".to_string());
    }
    if chunk_state {
        return bad(
            "chunk_state records or restores the chunk states of whole allocations: not \
             with chunks"
                .to_string(),
        );
    }
    let idx = expand_chunk_ranges(ranges, MAX_CHUNK_INDICES)?;
    if idx.is_empty() {
        return bad("an empty chunk list: name at least one chunk".to_string());
    }
    Ok(idx)
}

/// The chunk states of the one chunked allocation of `tag`.
fn chunks_of(host: &dyn Host, tag: &str) -> Result<Reply> {
    let e = host.engine();
    let ptr = e.chunked(tag).map_err(|err| {
        if tag.is_empty() || e.tag_known(tag) {
            err
        } else {
            Error::not_found(format!(
                "no allocation of this process ever had tag {:?}",
                shown_tag(tag)
            ))
        }
    })?;
    let info = e.chunk_info(ptr)?;
    // One byte a chunk: a reply about more chunks than fit could not be read.
    let room = MAX_REPLY_BYTES.saturating_sub(MAX_SHOWN_TAG_BYTES * 6 + 4096);
    if info.active.len() > room {
        return Err(Error::unsupported(format!(
            "allocation {ptr:#x} (tag {:?}) has {} chunks, more than a reply can list ({room})",
            shown_tag(tag),
            info.active.len()
        )));
    }
    Ok(Reply::Chunks(ChunkStatus {
        tag: shown_tag(&info.tag),
        addr: info.addr,
        chunk_size: info.chunk,
        count: info.active.len() as u64,
        states: ChunkStatus::states_of(&info.active),
    }))
}

fn finite(x: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}

fn backend_of(b: BackupKind) -> BackupBackend {
    match b {
        BackupKind::Mmap => BackupBackend::Mmap,
        // Never Disk: region backends are parsed by BackupKind::parse, which refuses it.
        BackupKind::Pinned | BackupKind::Disk => BackupBackend::Pinned,
    }
}

fn region_info(r: &RegionSettings) -> RegionInfo {
    RegionInfo {
        enabled: r.enabled,
        tag: shown_tag(&r.tag),
        cpu_backup: r.cpu_backup,
        backend: backend_of(r.backend),
        disk_backup: r.disk_backup,
    }
}

/// Held from reading the default region to writing it back: two clients changing different
/// fields at once (one the tag, one `enabled`) would otherwise both start from the same region,
/// and the later write would put back the field the earlier one changed. Nothing under it
/// waits for a client.
static REGION_UPDATE: Mutex<()> = Mutex::new(());

fn set_region(host: &dyn Host, u: RegionUpdate) -> Result<Reply> {
    let _one_at_a_time = REGION_UPDATE.lock();
    let mut r = host.default_region()?;
    if let Some(t) = u.tag {
        if t.is_empty() {
            return Err(Error::invalid_argument("a region's tag must not be empty"));
        }
        r.tag = t;
    }
    if let Some(e) = u.enabled {
        r.enabled = e;
    }
    if let Some(c) = u.cpu_backup {
        r.cpu_backup = c;
    }
    if let Some(d) = u.disk_backup {
        r.disk_backup = d;
    }
    if let Some(b) = u.backend {
        if !r.cpu_backup {
            return Err(Error::invalid_argument(format!(
                "CPU backup backend {:?} given without enabling CPU backup",
                b.as_str()
            )));
        }
        r.backend = match b {
            BackupBackend::Pinned => BackupKind::Pinned,
            BackupBackend::Mmap => BackupKind::Mmap,
        };
    }
    // The check every other way of setting a region makes: a region with both would report
    // one backup and apply the other, and every C setter of threads without a region of their
    // own would fail on it afterwards.
    r.check().map_err(|e| {
        e.context(if r.cpu_backup && r.disk_backup {
            "default region unchanged (turn one backup off in the same request: tmsctl region \
             --cpu-backup --no-disk-backup, or --disk-backup --no-cpu-backup)"
        } else {
            "default region unchanged"
        })
    })?;
    host.set_default_region(r.clone());
    tracing::info!("default region set by tmsctl: {r:?}");
    Ok(Reply::Region(region_info(&r)))
}

/// The communicators' numbers on the wire: the protocol's fields are the engine's, by name.
fn nccl_status(c: &CommStats) -> Option<NcclStatus> {
    let wire = serde_json::to_value(c).and_then(serde_json::from_value);
    wire.map_err(|e| tracing::error!("the tag nccl's numbers on the wire: {e}"))
        .ok()
}

fn timing(o: &Option<OpStats>) -> Option<OpTiming> {
    o.map(|o| OpTiming {
        allocations: o.allocations as u64,
        bytes: o.bytes,
        copied_bytes: o.copied_bytes,
        seconds: finite(o.seconds),
        gib_per_s: finite(o.gib_per_s),
    })
}

/// The status of the process. Device memory is reported for the devices that hold pauseable
/// allocations only: asking the CUDA driver about any other device would create a context on
/// it, taking device memory the process never wanted. Long tags are shortened and the tags
/// that do not fit the reply limit are counted, not listed ([`fit_reply`]).
pub fn status_of(host: &dyn Host) -> Status {
    fit_reply(full_status(host), MAX_REPLY_BYTES)
}

fn encoded_len<T: serde::Serialize>(x: &T) -> usize {
    serde_json::to_vec(x).map_or(usize::MAX, |v| v.len())
}

/// `s` with as many of its last tags left out (and counted in `tags_omitted`) as it takes for
/// its reply line to fit `max` bytes.
pub fn fit_reply(mut s: Status, max: usize) -> Status {
    // Room for `{"reply":"status",` around the status and for the `tags_omitted` field.
    let budget = max.saturating_sub(128);
    let total = encoded_len(&s);
    if total <= budget {
        return s;
    }
    let mut over = total - budget;
    let mut keep = s.tags.len();
    while over > 0 && keep > 0 {
        keep -= 1;
        // The entry and its comma.
        over = over.saturating_sub(encoded_len(&s.tags[keep]).saturating_add(1));
    }
    s.tags_omitted = (s.tags.len() - keep) as u64;
    s.tags.truncate(keep);
    tracing::debug!(
        "status: {} tags left out to keep the reply under {max} bytes",
        s.tags_omitted
    );
    s
}

fn full_status(host: &dyn Host) -> Status {
    let engine = host.engine();
    // The operations first: a status that lists none then shows the state they left (read
    // after them, the tags could predate an operation that ended in between).
    let operations = operations(engine);
    let stats: Stats = engine.stats();
    let devices: BTreeSet<i32> = engine.allocations().iter().map(|a| a.device).collect();
    let d = engine.driver();
    let devices = devices
        .into_iter()
        .map(|device| match d.mem_info(device) {
            Ok(m) => DeviceMemory {
                device,
                free_bytes: m.free,
                total_bytes: m.total,
                error: None,
            },
            Err(e) => DeviceMemory {
                device,
                error: Some(e.to_string()),
                ..Default::default()
            },
        })
        .collect();
    Status {
        pid: std::process::id(),
        backend: stats.backend.clone(),
        retain_cpu_backup: stats.retain_cpu_backup,
        memory_margin_bytes: stats.memory_margin_bytes,
        devices,
        tags: stats
            .tags
            .iter()
            .map(|t| TagStatus {
                tag: shown_tag(&t.tag),
                allocations: t.allocations as u64,
                active_allocations: t.active_allocations as u64,
                paused_allocations: t.paused_allocations as u64,
                partial_allocations: t.partial_allocations as u64,
                restoring_allocations: t.restoring_allocations as u64,
                resident_allocations: t.resident_allocations as u64,
                bytes_requested: t.bytes_requested,
                bytes_active: t.bytes_active,
                bytes_paused: t.bytes_paused,
                bytes_restoring: t.bytes_restoring,
                bytes_unrestored: t.bytes_unrestored,
                failed_restore: t.failed_restore.clone(),
                host_backup_bytes: t.host_backup_bytes,
                disk_backup_bytes: t.disk_backup_bytes,
                last_pause: timing(&t.last_pause),
                last_resume: timing(&t.last_resume),
                nccl: t.nccl.as_ref().and_then(nccl_status),
            })
            .collect(),
        tags_omitted: 0,
        default_region: host.default_region().ok().map(|r| region_info(&r)),
        operations,
    }
}

#[cfg(test)]
mod phase_tests {
    /// tmsctl and `tms_get_progress` (the Python callback) name a phase alike.
    #[test]
    fn the_wire_and_the_c_abi_name_every_phase_alike() {
        for p in crate::engine::Phase::ALL {
            assert_eq!(super::wire_phase(p).as_str(), p.as_str(), "{p:?}");
        }
    }
}
