//! Requests to the engine: each operation calls the same engine methods as the C ABI and the
//! Python shim, so it takes the same registry lock and the same pause/resume path (which
//! synchronises each device concerned before unmapping anything).

use std::collections::BTreeSet;

use tms_proto::{
    BackupBackend, DeviceMemory, ErrorKind, Op, OpDone, OpTiming, RegionInfo, RegionUpdate, Reply,
    Request, Status, TagStatus,
};

use crate::driver::HostBackend;
use crate::engine::{Engine, OpStats, Stats};
use crate::error::{status, Error, Result};
use crate::hooks::settings::RegionSettings;

/// What the server acts on: the engine and the process-wide default region. The process's
/// implementation uses the one [`Runtime`](crate::Runtime) and the settings module; tests use
/// their own engine.
pub trait Host: Sync {
    /// The engine.
    fn engine(&self) -> &Engine;
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

fn error_reply(e: &Error) -> Reply {
    Reply::error(kind_of(e), e.to_string())
}

/// Answer one request (any but the hello, which the session handles).
pub fn dispatch(host: &dyn Host, req: Request) -> Reply {
    let r = match req {
        Request::Ping => Ok(Reply::Pong {
            pid: std::process::id(),
        }),
        Request::Status => Ok(Reply::Status(Box::new(status_of(host)))),
        Request::Pause { tag } => op(host, Op::Pause, tag),
        Request::Resume { tag } => op(host, Op::Resume, tag),
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

fn op(host: &dyn Host, which: Op, tag: Option<String>) -> Result<Reply> {
    let e = host.engine();
    let r = match which {
        Op::Pause => e.pause(tag.as_deref())?,
        Op::Resume => e.resume(tag.as_deref())?,
    };
    Ok(Reply::Done(OpDone {
        op: which,
        tag,
        allocations: r.allocations as u64,
        bytes: r.bytes,
        copied_bytes: r.copied,
        seconds: finite(r.seconds),
        unknown_tag: false,
    }))
}

fn finite(x: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}

fn backend_of(b: HostBackend) -> BackupBackend {
    match b {
        HostBackend::Pinned => BackupBackend::Pinned,
        HostBackend::Mmap => BackupBackend::Mmap,
    }
}

fn region_info(r: &RegionSettings) -> RegionInfo {
    RegionInfo {
        enabled: r.enabled,
        tag: r.tag.clone(),
        cpu_backup: r.cpu_backup,
        backend: backend_of(r.backend),
    }
}

fn set_region(host: &dyn Host, u: RegionUpdate) -> Result<Reply> {
    let mut r = host.default_region()?;
    if let Some(t) = u.tag {
        if t.is_empty() {
            return Err(Error::InvalidArgument(
                "a region's tag must not be empty".into(),
            ));
        }
        r.tag = t;
    }
    if let Some(e) = u.enabled {
        r.enabled = e;
    }
    if let Some(c) = u.cpu_backup {
        r.cpu_backup = c;
    }
    if let Some(b) = u.backend {
        if !r.cpu_backup {
            return Err(Error::InvalidArgument(format!(
                "CPU backup backend {:?} given without enabling CPU backup",
                b.as_str()
            )));
        }
        r.backend = match b {
            BackupBackend::Pinned => HostBackend::Pinned,
            BackupBackend::Mmap => HostBackend::Mmap,
        };
    }
    host.set_default_region(r.clone());
    tracing::info!("default region set by tmsctl: {r:?}");
    Ok(Reply::Region(region_info(&r)))
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
/// it, taking device memory the process never wanted.
pub fn status_of(host: &dyn Host) -> Status {
    let engine = host.engine();
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
                tag: t.tag.clone(),
                allocations: t.allocations as u64,
                active_allocations: t.active_allocations as u64,
                paused_allocations: t.paused_allocations as u64,
                bytes_requested: t.bytes_requested,
                bytes_active: t.bytes_active,
                bytes_paused: t.bytes_paused,
                host_backup_bytes: t.host_backup_bytes,
                last_pause: timing(&t.last_pause),
                last_resume: timing(&t.last_resume),
            })
            .collect(),
        default_region: host.default_region().ok().map(|r| region_info(&r)),
    }
}
