//! Single synchronous copies for tools and tests (`write_bytes`/`read_bytes`); backups move in
//! the pipeline (`pipeline.rs`). Upholds the driver's copy contracts (range mapped; host memory
//! alive until the stream is synchronized): the callers hold the operations lock throughout
//! (the registry lock only while checking that the range is active), so no pause unmaps the
//! range, and no call returns while a copy it queued may still run, unless every wait failed
//! ([`Outcome::Queued`]).

use super::pipeline::{new_slot, Timing};
use crate::driver::{settle, DevPtr, Driver, Stream, SETTLE_TRIES};
use crate::error::{Error, Result};

/// Largest buffer of the engine's own that a staged copy moves through at a time.
const STAGE: usize = 64 << 20;

/// How a series of copies ended.
pub(super) enum Outcome {
    /// All ran.
    Done,
    /// They failed, and a wait afterwards succeeded: nothing of them is left to run.
    Failed(Error),
    /// They failed and every wait since failed too: some may still be queued, using the host
    /// memory they were given, and run at a later synchronization.
    Queued(Error),
}

impl Outcome {
    /// As a result, the error of [`Outcome::Queued`] saying what may still run.
    pub(super) fn into_result(self) -> Result<()> {
        match self {
            Outcome::Done => Ok(()),
            Outcome::Failed(e) => Err(e),
            Outcome::Queued(e) => Err(e.context(format!(
                "part of the copy may still be queued ({} waits for the stream and the device \
                 failed after this)",
                2 * SETTLE_TRIES
            ))),
        }
    }
}

/// Queue `copy(offset, n)` over `len` bytes in pieces of at most `piece` bytes, then wait for the
/// stream; after a failure, wait until nothing queued is left ([`settle`]): nothing queued may
/// outlive the caller's borrow.
fn in_pieces(
    d: &dyn Driver,
    device: i32,
    stream: Stream,
    len: usize,
    piece: usize,
    mut copy: impl FnMut(usize, usize) -> Result<()>,
) -> Outcome {
    let piece = piece.max(1);
    let mut off = 0;
    let mut failed = None;
    while off < len {
        let n = piece.min(len - off);
        if let Err(e) = copy(off, n) {
            failed = Some(e);
            break;
        }
        off += n;
    }
    let e = match failed {
        Some(e) => e,
        None => match d.stream_sync(stream) {
            Ok(()) => return Outcome::Done,
            Err(e) => e,
        },
    };
    if settle(d, device, stream) {
        Outcome::Failed(e)
    } else {
        Outcome::Queued(e)
    }
}

/// Copy `data` to `dst` in copies of at most `piece` bytes queued back to back, and wait. The
/// caller checked that the range is active and holds the operations lock.
pub(super) fn write(
    d: &dyn Driver,
    device: i32,
    dst: DevPtr,
    data: &[u8],
    piece: usize,
    stream: Stream,
) -> Outcome {
    in_pieces(d, device, stream, data.len(), piece, |off, n| {
        // SAFETY: dst..dst+data.len() lies in an active allocation (checked by the caller, who
        // holds the operations lock) and off+n <= data.len(); data is borrowed until in_pieces
        // has synchronized the stream (or, for Outcome::Queued, see the callers).
        unsafe { d.copy_h2d(dst + off as u64, data.as_ptr().add(off), n as u64, stream) }
    })
}

/// Copy from `src` into `out` in pieces, and wait. Same contract as [`write`].
pub(super) fn read(
    d: &dyn Driver,
    device: i32,
    out: &mut [u8],
    src: DevPtr,
    piece: usize,
    stream: Stream,
) -> Outcome {
    let (base, len) = (out.as_mut_ptr(), out.len());
    in_pieces(d, device, stream, len, piece, |off, n| {
        // SAFETY: as in write, with out exclusively borrowed until the synchronization.
        unsafe { d.copy_d2h(base.add(off), src + off as u64, n as u64, stream) }
    })
}

/// A buffer a copy may still use after every wait failed: never freed, so that the copy, if
/// it ever runs, lands in memory nobody else has.
fn abandon(buf: Vec<u8>) {
    tracing::warn!(
        "a copy's waits kept failing: its buffer of {} bytes is kept for good",
        buf.len()
    );
    std::mem::forget(buf);
}

/// [`write`] through buffers of the engine's own: `data` is read only here, by the CPU, so
/// even a copy left queued by waits that kept failing never touches it.
pub(super) fn write_staged(
    d: &dyn Driver,
    device: i32,
    dst: DevPtr,
    data: &[u8],
    stream: Stream,
) -> Result<()> {
    let mut buf = vec![0u8; data.len().min(STAGE)];
    for (k, part) in data.chunks(STAGE).enumerate() {
        let b = &mut buf[..part.len()];
        b.copy_from_slice(part);
        match write(d, device, dst + (k * STAGE) as u64, b, usize::MAX, stream) {
            Outcome::Done => {}
            Outcome::Failed(e) => return Err(e),
            q @ Outcome::Queued(_) => {
                abandon(buf);
                return q.into_result();
            }
        }
    }
    Ok(())
}

/// [`read`] through buffers of the engine's own, copied into `out` only once complete.
pub(super) fn read_staged(
    d: &dyn Driver,
    device: i32,
    out: &mut [u8],
    src: DevPtr,
    stream: Stream,
) -> Result<()> {
    let mut buf = vec![0u8; out.len().min(STAGE)];
    for (k, part) in out.chunks_mut(STAGE).enumerate() {
        let b = &mut buf[..part.len()];
        match read(d, device, b, src + (k * STAGE) as u64, usize::MAX, stream) {
            Outcome::Done => part.copy_from_slice(b),
            Outcome::Failed(e) => return Err(e),
            q @ Outcome::Queued(_) => {
                abandon(buf);
                return q.into_result();
            }
        }
    }
    Ok(())
}

/// What [`probe_d2h_lanes`] measured.
#[derive(Clone, Copy, Debug, Default)]
pub struct LaneProbe {
    /// Wall time of the whole copy.
    pub seconds: f64,
    /// Summed over the threads: time in the calls that queue a copy and record its event.
    pub issue_s: f64,
    /// Summed over the threads: time waiting for a lane's copy.
    pub wait_s: f64,
    /// Copies queued.
    pub pieces: u64,
}

/// The device side of a staged pause without its host copies: `threads` threads each take
/// 64 MiB of `src..src + len` at a time and copy it to the host in `piece`-byte copies through two
/// page-locked slots of their own, on the device's one stream with an event per slot, as the
/// pipeline's workers do. What the queueing calls cost there, when all threads make them at once,
/// is what a pause into fresh host memory pays per piece on top of its host copies. With
/// `own_streams`, each thread queues on its own default stream instead (where the driver has
/// them), to see whether the one stream is what the calls wait for.
#[allow(clippy::too_many_arguments)]
pub(super) fn probe_d2h_lanes(
    driver: &std::sync::Arc<dyn Driver>,
    device: i32,
    stream: Stream,
    src: DevPtr,
    len: u64,
    piece: u64,
    threads: usize,
    own_streams: bool,
    layout: crate::backup::HostLayout,
) -> Result<LaneProbe> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Instant;
    const UNIT: u64 = 64 << 20;
    if piece == 0 || threads == 0 {
        return Err(Error::invalid_argument(
            "the probe needs a piece size and a thread count above 0",
        ));
    }
    let d = &**driver;
    let next = AtomicU64::new(0);
    let (issue, wait, pieces) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    if own_streams && d.thread_stream().is_none() {
        return Err(Error::unsupported(
            "this driver has no per-thread streams to probe",
        ));
    }
    let one = || -> Result<()> {
        let _scope = crate::driver::DeviceScope::enter(d, device)?;
        let stream = match d.thread_stream() {
            Some(s) if own_streams => s,
            _ => stream,
        };
        let slots = [
            new_slot(driver, device, piece, layout)?,
            new_slot(driver, device, piece, layout)?,
        ];
        let mut events = Vec::new();
        let res = (|| -> Result<()> {
            for _ in 0..2 {
                events.push(d.event_create(device)?);
            }
            let mut queued = [false; 2];
            let mut l = 0;
            loop {
                let u = next.fetch_add(UNIT, Ordering::Relaxed);
                if u >= len {
                    break;
                }
                let mut off = u;
                while off < (u + UNIT).min(len) {
                    let n = piece.min(len - off);
                    if queued[l] {
                        Timing::add(&wait, || d.event_sync(events[l]))?;
                    }
                    let dst = slots[l].base();
                    Timing::add(&issue, || {
                        // SAFETY: the slot is this thread's page-locked buffer of `piece` >= n
                        // bytes, whose previous copy was waited for just above; the source lies
                        // in the active range the caller holds; the stream is waited for
                        // before the slots are dropped (below, or on error).
                        unsafe { d.copy_d2h(dst, src + off, n, stream)? };
                        d.event_record(events[l], stream)
                    })?;
                    queued[l] = true;
                    pieces.fetch_add(1, Ordering::Relaxed);
                    off += n;
                    l ^= 1;
                }
            }
            Ok(())
        })();
        // Nothing queued may outlive the slots, whatever happened.
        let synced = d.stream_sync(stream);
        for e in events {
            d.event_destroy(e);
        }
        res.and(synced)
    };
    let t0 = Instant::now();
    let results: Vec<Result<()>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads).map(|_| sc.spawn(one)).collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::internal("a probe thread panicked")))
            })
            .collect()
    });
    let seconds = t0.elapsed().as_secs_f64();
    results.into_iter().collect::<Result<Vec<()>>>()?;
    Ok(LaneProbe {
        seconds,
        issue_s: Timing::secs(&issue),
        wait_s: Timing::secs(&wait),
        pieces: pieces.load(Ordering::Relaxed),
    })
}
