//! Progress of the running pause or resume, for whoever watches it from another thread: the
//! control server's `status` (tmsctl), the C ABI's `tms_get_progress` (Python's progress
//! callback). It covers every transaction, whoever started it.
//!
//! The copy workers only add to counters and store the phase (atomics: no lock on the copy
//! path, and a reader never slows a copy down). What an operation is (which, what it acts on,
//! its thread, its start) is set when it starts and cleared when it ends, under a small lock
//! that readers take briefly and the copy path never takes. Transactions run one at a time
//! (the operations lock), so there is at most one; an operation that ends clears only its own
//! entry, since a resume gives host memory back after the next one may have started.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

/// Which transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    /// A pause.
    Pause,
    /// A resume.
    Resume,
}

/// What a running pause or resume is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Choosing its allocations, checking host memory or disk space, making backups.
    Preparing = 0,
    /// Waiting for the work queued on the device (a pause).
    Synchronizing,
    /// Mapping device memory (a resume), before its copies start.
    Mapping,
    /// Copying device memory into host backups (a pause).
    CopyingToHost,
    /// Writing device memory into disk backup files (a pause).
    WritingToDisk,
    /// Reading disk backup files back (a resume).
    ReadingFromDisk,
    /// Copying host backups back to the device (a resume).
    CopyingToDevice,
    /// Giving memory back: the device memory of what is saved (a pause), host backups (a
    /// resume without retention).
    Releasing,
}

impl Phase {
    /// Every phase, in the order of their numbers.
    pub const ALL: [Phase; 8] = [
        Phase::Preparing,
        Phase::Synchronizing,
        Phase::Mapping,
        Phase::CopyingToHost,
        Phase::WritingToDisk,
        Phase::ReadingFromDisk,
        Phase::CopyingToDevice,
        Phase::Releasing,
    ];

    /// Its name, as the control protocol and the C ABI give it (`"writing_to_disk"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Preparing => "preparing",
            Phase::Synchronizing => "synchronizing",
            Phase::Mapping => "mapping",
            Phase::CopyingToHost => "copying_to_host",
            Phase::WritingToDisk => "writing_to_disk",
            Phase::ReadingFromDisk => "reading_from_disk",
            Phase::CopyingToDevice => "copying_to_device",
            Phase::Releasing => "releasing",
        }
    }

    fn from_u8(v: u8) -> Phase {
        Phase::ALL
            .get(usize::from(v))
            .copied()
            .unwrap_or(Phase::Preparing)
    }
}

/// The counters of one operation, shared with its copy workers.
pub(super) struct Counters {
    t0: Instant,
    phase: AtomicU8,
    total: AtomicU64,
    done: AtomicU64,
    /// Nanoseconds from `t0` to the first bytes copied (0: none yet), for a rate that leaves
    /// out the time spent preparing and waiting for the device.
    first_ns: AtomicU64,
}

impl Counters {
    pub(super) fn new() -> Counters {
        Counters {
            t0: Instant::now(),
            phase: AtomicU8::new(Phase::Preparing as u8),
            total: AtomicU64::new(0),
            done: AtomicU64::new(0),
            first_ns: AtomicU64::new(0),
        }
    }

    /// From now on the operation is doing `p`.
    pub(super) fn phase(&self, p: Phase) {
        self.phase.store(p as u8, Ordering::Relaxed);
    }

    /// `bytes` more were copied.
    pub(super) fn moved(&self, bytes: u64) {
        if self.first_ns.load(Ordering::Relaxed) == 0 {
            let ns = (self.t0.elapsed().as_nanos() as u64).max(1);
            let _ = self
                .first_ns
                .compare_exchange(0, ns, Ordering::Relaxed, Ordering::Relaxed);
        }
        self.done.fetch_add(bytes, Ordering::Relaxed);
    }

    /// `bytes` more for the operation to copy (a failed pause adds the restore of what it
    /// released part of).
    pub(super) fn add_total(&self, bytes: u64) {
        self.total.fetch_add(bytes, Ordering::Relaxed);
    }

    /// `bytes` of the total need no copy after all (unchanged since their backup took them).
    pub(super) fn skipped(&self, bytes: u64) {
        let _ = self
            .total
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                Some(t.saturating_sub(bytes))
            });
    }

    /// True once the copies are all done (or there were none).
    pub(super) fn copied_all(&self) -> bool {
        self.done.load(Ordering::Relaxed) >= self.total.load(Ordering::Relaxed)
    }
}

/// Which kinds of backup an operation's copies go to or come from: host memory, disk files,
/// both or neither. (A backup itself is a `backup::Backing`; the control protocol's one-word
/// form of this is `tms_proto::Backing`.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backings {
    /// Host memory (CPU backups).
    pub host: bool,
    /// Disk backup files.
    pub disk: bool,
}

/// A snapshot of the running pause or resume ([`super::Engine::progress`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Progress {
    /// Which transaction.
    pub which: Which,
    /// Its tag (every tag if `None`); for chunks of an allocation named by address, the
    /// allocation's tag.
    pub tag: Option<String>,
    /// The chunks it acts on, as inclusive ranges, when it names some (and they are few enough
    /// to list).
    pub chunks: Option<Vec<[u64; 2]>>,
    /// What the caller labelled it with ([`super::Pick::label`]): the control server's request
    /// number; `None` for the API's calls.
    pub label: Option<u64>,
    /// The operating system's id of the thread running it (`gettid`).
    pub thread: u64,
    /// What it is doing now.
    pub phase: Phase,
    /// Bytes it is to copy in all (known once it has prepared its backups).
    pub bytes_total: u64,
    /// Of those, bytes copied so far.
    pub bytes_done: u64,
    /// Where the copies go or come from (neither: nothing to copy).
    pub backing: Backings,
    /// Seconds since it started (after waiting for the operations lock).
    pub seconds: f64,
    /// Seconds since its first bytes were copied (0 before).
    pub copy_seconds: f64,
}

impl Progress {
    /// Bytes per second copied so far (0 before the first copy).
    pub fn rate(&self) -> f64 {
        if self.copy_seconds > 0.0 {
            self.bytes_done as f64 / self.copy_seconds
        } else {
            0.0
        }
    }
}

/// Longest chunk list a progress snapshot carries, in ranges: a status lists it on every poll.
const MAX_SHOWN_RANGES: usize = 256;

struct Current {
    id: u64,
    which: Which,
    tag: Option<String>,
    chunks: Option<Vec<[u64; 2]>>,
    label: Option<u64>,
    thread: u64,
    backing: Backings,
    counters: Arc<Counters>,
}

/// The running operation, if any.
#[derive(Default)]
pub(super) struct Tracker {
    current: Mutex<Option<Current>>,
    next: AtomicU64,
}

/// What [`Tracker::begin`] records about an operation.
pub(super) struct Start<'a> {
    pub which: Which,
    pub tag: Option<&'a str>,
    pub chunks: Option<&'a [usize]>,
    pub label: Option<u64>,
}

impl Tracker {
    /// Record that an operation starts now, on this thread; it is the running one until the
    /// guard is dropped.
    pub(super) fn begin(&self, s: Start<'_>) -> Tracked<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let counters = Arc::new(Counters::new());
        let chunks = s.chunks.map(ranges).filter(|r| r.len() <= MAX_SHOWN_RANGES);
        *self.current.lock() = Some(Current {
            id,
            which: s.which,
            tag: s.tag.map(str::to_string),
            chunks,
            label: s.label,
            thread: nix::unistd::gettid().as_raw() as u64,
            backing: Backings::default(),
            counters: counters.clone(),
        });
        Tracked {
            tracker: self,
            id,
            counters,
        }
    }

    /// The running operation, if any.
    pub(super) fn snapshot(&self) -> Option<Progress> {
        let g = self.current.lock();
        let c = g.as_ref()?;
        let k = &c.counters;
        let seconds = k.t0.elapsed().as_secs_f64();
        let first = k.first_ns.load(Ordering::Relaxed);
        Some(Progress {
            which: c.which,
            tag: c.tag.clone(),
            chunks: c.chunks.clone(),
            label: c.label,
            thread: c.thread,
            phase: Phase::from_u8(k.phase.load(Ordering::Relaxed)),
            bytes_total: k.total.load(Ordering::Relaxed),
            bytes_done: k.done.load(Ordering::Relaxed),
            backing: c.backing,
            seconds,
            copy_seconds: if first == 0 {
                0.0
            } else {
                (seconds - first as f64 * 1e-9).max(0.0)
            },
        })
    }
}

/// The running operation's entry: its counters, and the entry cleared when dropped.
pub(super) struct Tracked<'a> {
    tracker: &'a Tracker,
    id: u64,
    counters: Arc<Counters>,
}

impl Tracked<'_> {
    /// Its counters.
    pub(super) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Once its backups are known: how many bytes it copies, and where to (more of both for
    /// a failed pause's restore).
    pub(super) fn prepared(&self, total: u64, backing: Backings) {
        self.counters.add_total(total);
        if let Some(c) = self
            .tracker
            .current
            .lock()
            .as_mut()
            .filter(|c| c.id == self.id)
        {
            c.backing.host |= backing.host;
            c.backing.disk |= backing.disk;
        }
    }

    /// The tag it acts on, once known (chunks of an allocation named by its address).
    pub(super) fn set_tag(&self, tag: &str) {
        if let Some(c) = self
            .tracker
            .current
            .lock()
            .as_mut()
            .filter(|c| c.id == self.id)
        {
            c.tag = Some(tag.to_string());
        }
    }
}

impl Drop for Tracked<'_> {
    fn drop(&mut self) {
        let mut g = self.tracker.current.lock();
        if g.as_ref().is_some_and(|c| c.id == self.id) {
            *g = None;
        }
    }
}

/// Sorted, distinct indices as inclusive ranges.
fn ranges(idx: &[usize]) -> Vec<[u64; 2]> {
    let mut out: Vec<[u64; 2]> = Vec::new();
    for &i in idx {
        let i = i as u64;
        match out.last_mut() {
            Some(r) if r[1] + 1 == i => r[1] = i,
            _ => out.push([i, i]),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operation_is_seen_until_it_ends_and_only_its_own_end_clears_it() {
        let t = Tracker::default();
        assert!(t.snapshot().is_none());
        let a = t.begin(Start {
            which: Which::Pause,
            tag: Some("kv"),
            chunks: Some(&[1, 2, 3, 7]),
            label: Some(9),
        });
        a.prepared(
            100,
            Backings {
                host: false,
                disk: true,
            },
        );
        a.counters().phase(Phase::WritingToDisk);
        a.counters().moved(40);
        let s = t.snapshot().expect("running");
        assert_eq!(s.which, Which::Pause);
        assert_eq!(s.tag.as_deref(), Some("kv"));
        assert_eq!(s.chunks, Some(vec![[1, 3], [7, 7]]));
        assert_eq!(s.label, Some(9));
        assert_eq!((s.bytes_done, s.bytes_total), (40, 100));
        assert_eq!(s.phase, Phase::WritingToDisk);
        assert!(s.backing.disk && !s.backing.host);
        assert!(!a.counters().copied_all());
        // The next operation starts before the first has dropped its entry (a resume giving
        // host memory back): the first's end leaves the second's alone.
        let b = t.begin(Start {
            which: Which::Resume,
            tag: None,
            chunks: None,
            label: None,
        });
        drop(a);
        let s = t.snapshot().expect("the second runs");
        assert_eq!(
            (s.which, s.bytes_done, s.phase),
            (Which::Resume, 0, Phase::Preparing)
        );
        assert_eq!(s.copy_seconds, 0.0);
        assert!(b.counters().copied_all(), "nothing to copy");
        drop(b);
        assert!(t.snapshot().is_none());
    }

    #[test]
    fn phases_have_their_wire_names() {
        for (i, p) in Phase::ALL.iter().enumerate() {
            assert_eq!(Phase::from_u8(i as u8), *p);
        }
        assert_eq!(Phase::WritingToDisk.as_str(), "writing_to_disk");
        assert_eq!(Phase::from_u8(200), Phase::Preparing);
    }
}
