//! The engine: a registry of pauseable allocations and the pause/resume transactions over
//! [`Driver`].
//!
//! # Note [Pause and resume as transactions]
//!
//! Every allocation is one reserved address range with physical memory mapped over all of it in
//! segments of up to 1 GiB, one handle each (`segment.rs`): VMM calls cost per handle, so
//! segments are large, but a resume can copy into the first segments of a huge allocation while
//! it maps the next.
//!
//! The registry (`registry.rs`) is a small index: for each allocation its place, tag, backup and
//! state, *Active*, *Pausing*, *Paused*, *Resuming* or *Partial* (Note [Chunked allocations]). Its
//! lock is held only to read or change entries, never across a driver call, a copy or a wait, so
//! the hooks' questions (is this pointer ours? a new allocation, a free of someone else's memory)
//! never wait for a pause: a thread the GPU's work depends on (a host callback, a proxy thread)
//! keeps running while a pause synchronizes the device. Pauses and resumes run one at a time (the
//! operations lock, `Ops::slots` in `txn.rs`, which also holds the staging slots); the hooks never
//! wait for it.
//!
//! *Pause* marks the tag's active allocations Pausing and works on a copy of what it needs: backups
//! are prepared (after checking the host can hold them: backups are touched only while copying, so
//! a pause larger than the host's memory would be killed mid-copy instead of failing), each device
//! is synchronized, and the copies run in the pipeline (Note [The copy pipeline] in `pipeline.rs`).
//! Each allocation is unmapped, released and recorded Paused as soon as its own copy is complete;
//! one with a backup does so segment by segment, each segment as soon as its copy is complete, so
//! that the driver's work on the memory given back overlaps the rest of the pause instead of the
//! next resume (measured on an H200: a 16 GiB resume right after a pause that gave back all 16 GiB
//! at its end ran at 87% of the link, 500 ms later at 94%). The first failure stops the work; those
//! with nothing released go back to Active, still mapped (a backup partly written for them is not
//! claimed valid). An allocation the failure caught with some segments released is then resumed (a
//! resume transaction of its own, after the pause's has ended), so that it is whole again; if that
//! fails too, it stays Partial, its released segments paused with their backup, and the error says
//! so. If only a release fails, the allocation is Paused all the same (unmapped, its contents in
//! the backup) and the handle is reported.
//!
//! *Resume* marks the tag's paused allocations Resuming, then creates, maps and enables access
//! for each (as `segment::Mapping`s) while the pipeline copies the backups back. All or
//! nothing: on any failure the mappings are dropped, which undoes them, and the tag stays paused
//! with its backups; the error (out of memory, typically) goes to the caller, who may free memory
//! and call again. A segment that undoing cannot unmap (twice) stays paused in the registry with
//! its backup and is recorded as stuck: the next resume of its allocation, or its free, unmaps it
//! first (and fails, changing nothing, if that still fails). Otherwise every allocation is
//! committed Active at once and, unless retention is on, its backup and the staging slots are
//! released, in parallel, after both locks are let go.
//!
//! Each runs as one transaction object (`txn.rs`, Note [Transactions]) that holds its guards
//! and lets go of them in one documented order: among them the one that returns every
//! allocation still in transition to where it came from when the transaction ends, by error or
//! by unwind; and after an unwind the engine refuses further pauses, resumes and allocations
//! (it cannot know what the panic left undone).
//!
//! *Free* of an allocation in transition waits for that allocation to settle (a pause retires
//! each one as soon as its copy is done), then removes it; if unmapping fails it is put back,
//! still active. A failure after the unmap (releasing the handle, or giving back the address
//! range) is reported but the allocation is gone: only that handle or range leaks.
//!
//! *Backups* are shared, never overwritten under a reader: [`Engine::acquire_cpu_backup`] hands
//! out a reference that keeps a snapshot alive and unchanged (a pause then writes a new buffer;
//! a resume without retention leaves it to its last holder), and only complete snapshots are
//! ever handed out.

//! # Note [Chunked allocations]
//!
//! An allocation made with a chunk size (`AllocRequest::chunk`, a multiple of the device's
//! granularity that divides its size) is mapped in segments of exactly that size, and each
//! segment is a *chunk* that pauses and resumes on its own (`Pick::chunks`): the registry keeps,
//! per segment, its handle while mapped and whether the backup holds its contents (`saved`). A
//! transaction works on runs of consecutive segments, one pipeline item each, so pausing or
//! resuming k chunks costs k chunks' VMM calls plus their copies. Whole-allocation pauses and
//! resumes are the same transactions over every mapped (paused) segment, so the two compose in
//! any order; an allocation with some chunks of each is *Partial*. A disk backup's file is cut
//! in chunks that divide the allocation's, so a chunk's checksum never spans two of them; a
//! host buffer may be copied in parts of its chunks. A pause can record which chunks were active
//! (`Pick::chunk_state`) for a resume to bring back only those.

//! # Note [Locks]
//!
//! Every lock of the library (all `parking_lot` unless said), what it guards, who takes it,
//! what may be taken while it is held, and what is never done under it. The engine's locks
//! belong to the owners of its state (`base.rs`: `Engine::ops`, `registry`, `settings`,
//! `leases`, `restores`). Lock order: the operations lock before the registry lock; every other
//! lock is a leaf (nothing else is taken while it is held), except where said.
//!
//! - `Ops::slots` (`txn.rs`; the operations lock): serializes pauses and resumes (taken by
//!   `Txn::begin`, let go by `Txn::end` or the transaction's drop) and the tools' copies
//!   (`with_active` in `tools.rs` and `with_segments` in `export.rs`, through `Ops::exclusive`),
//!   and holds each device's staging slots
//!   (`staging_bytes` reads them). Held for a whole transaction, across driver calls, copies,
//!   file I/O and device synchronizations. Under it: the registry lock (briefly), the progress
//!   record's lock, `Restores::failed`, a tracker's `st`, the pinner's `queue` (to hand it
//!   work), the settings' leaves, the digest policy's and each backup's digests' locks, a
//!   `BackupDir`'s `files`, the pipeline's locks, `Communicators::state` (the tag nccl's
//!   transactions and a pause's registrations), and, where a non-blocking resume fails after
//!   its return, `Leases::held` and `Releases::pending` (its give-back). `alloc`,
//!   `owns` and `stats` never take it; `free` only tries it, without waiting and with no other
//!   lock held, to drop the staging slots with the last allocation that has a backup
//!   (`Ops::drop_unused_slots`; a transaction that held it looks again once it let it go).
//!   Never taken while holding the registry lock. A pause or resume
//!   waits for the releases and enters the pinner's quiet state before taking it.
//! - `Registry::index` (`registry.rs`; the registry lock, with the `settled` condvar): the
//!   index of allocations. Taken briefly by everyone: the hooks, transactions to mark and settle
//!   allocations, `Settle` (`txn.rs`), `stats`, `free` (which waits on `settled` for an
//!   allocation in transition). Under it: `Registry::tags` and `Restores::failed`, nothing
//!   else. Never held across a driver call, a copy, file I/O or a wait other than `settled`'s,
//!   and never while taking the operations lock: a thread the device's work waits for may be in
//!   `cudaFree` while a pause synchronizes the device.
//! - `Registry::tags`, `Ops::broken`, `Leases::held`, and the settings' `copy`, `disk_dir` and
//!   `disk_default` (`settings.rs`): leaves, each guarding its field. A buffer leaving `held`
//!   is dropped after the lock is let go.
//! - `Tracker::current` (`progress.rs`): the running operation; set by `Txn::begin` under the
//!   operations lock and cleared when the transaction's progress record goes, at its very end,
//!   after that lock is let go; read by `progress` watchers. A leaf; never taken with the
//!   registry lock.
//! - `Restores::inflight` (`restoring.rs`; the non-blocking resumes not known finished): a leaf,
//!   except that it may be held while asking each tracker whether it is finished.
//!   `Restores::failed` (those that failed after returning, with the allocations they left
//!   unrestored): a leaf, taken under the registry lock where the two change together
//!   (`keep_mapped`, the commit, the pause's end; `stats` reads both), so that they are seen
//!   together. A tracker's `st` (`restoring.rs`, with the `cv` condvar) is taken under
//!   `inflight` or alone, never the other way round, and may take the registry lock briefly (an
//!   allocation landed: shown so before its waiters are told); callers wait on `cv` for the
//!   mapping or for data to land, with no other lock held. The resume's own thread updates it
//!   from the pipeline's callbacks (under the operations lock).
//! - `Pinner::queue` (`background.rs`, with the `idle` and `ops_done` condvars): the background
//!   pinner's queue and its handshake with transactions (`quiet`, `busy`). Held only to change
//!   those fields or wait on them; page-locking runs outside it. A leaf.
//! - The copy pipeline's `Ready::gate` (with `wake`; `std`'s, for loom: `pipeline/ready.rs`),
//!   `error` (`Shared`, `pipeline/shared.rs`) and each worker's lane of staging slots
//!   (`pipeline/worker.rs`), and the job slots of `per_device`: each lives for one pipeline or one
//!   call, under the operations lock. `gate` and `error` are leaves held for a store or a wait; a
//!   lane is held by its one worker for the whole run, and a job slot by the thread that runs its
//!   job, driver calls and copies included (nobody else ever wants them).
//! - `BackupDir::files` (`backup/disk.rs`): the prepared folder of disk backups; held while the
//!   path is followed to the folder, which is made and checked where it is new (file system calls
//!   that cannot block: Note [The disk backup folder]), not while sweeping. `FAULTS`: armed file faults (testing aid), a leaf.
//! - `flock` on each disk backup file: exclusive, taken without waiting when the file is made
//!   and held until the file is removed; the sweep takes others' files' locks without waiting
//!   to learn that their process died (Note [Disk backup files]). Never waited for.
//! - `control`: `conns::Table::inner` (the connections served) and `dispatch::IN_FLIGHT` (the
//!   socket's operations not ended) are leaves held for a few field changes, never across I/O
//!   or an engine call. `dispatch::REGION_UPDATE`: held by a `set_region` request from reading
//!   the default region to writing it back; under it only `DEFAULT_REGION` (and the first read
//!   of the process settings), never a client's I/O or an engine call; the hooks never take it.
//! - `settings::DEFAULT_REGION` (an `RwLock`): the process-wide default region; read by the
//!   hooks, written by `set_default_region`. A leaf.
//! - The simulated driver (`driver/sim/`): `inner` (`mod.rs`: all simulated state, that of
//!   `memory.rs`, `streams.rs`, `host.rs` and `faults.rs`; held for each primitive, so the
//!   engine's locks are always taken before it), and in `gates.rs` `holds` with `holds_changed`
//!   (held primitives wait on it, before taking `inner`), `sync_delay` and `link` (leaves; the
//!   simulated time is slept with no lock held), and `gate_waits` (`driver::GateWaits`, in the
//!   CUDA and HIP drivers too: the streams waiting for the resume gate and the device-wide calls
//!   running; a leaf, never held across a driver call). Page-locking, unlocking and device
//!   synchronizations wait on it, with no other of the driver's locks held, before they start,
//!   and stream waits until none of those runs (Note [Non-blocking resume]).
//! - `Policy::default` and `Policy::tags` (`checks.rs`: what each tag checks with digests) and
//!   `Digests::map` (`backup/digests.rs`: a backup's digests per piece): leaves, held for a read
//!   or a few changes, by transactions (under the operations lock) and by `backups.rs`.
//! - The HIP driver (`driver/hip/`): `addresses` (`mod.rs`), held across our address
//!   reservations and from freeing a range to reserving it again, so that none of ours takes
//!   the address in between; under it only `Ranges` (`ranges.rs`: the books of ROCm's reserved
//!   ranges), a leaf never held across a driver call. The CUDA driver: each device's `digests`
//!   slot (`cuda.rs`: the digest kernel and its scratch buffer), held while a digest runs, its
//!   launches and the stream's synchronization included (the device has one scratch buffer);
//!   a leaf.
//! - `Releases::pending` (`background.rs`, with `done`): the host memory being given back after
//!   resumes returned. A leaf; a transaction waits on `done` in its prologue, before it enters
//!   the pinner's quiet state or takes the operations lock.
//! - `Communicators::state` (`nccl/registry.rs`, with the `idle` condvar): NCCL's communicators
//!   and registered buffers. A leaf, held for a few field changes, never across an NCCL call:
//!   a suspend, resume or read of numbers marks its communicators busy under it and calls NCCL
//!   after letting go. Taken by the NCCL interposers (ending a communicator waits on `idle`
//!   while a call of ours is on that one), by the tag's transactions (under the operations
//!   lock, which it never takes), by pauses of memory (their registrations, before the
//!   registry lock), and by `stats` (after it lets go of the registry lock).
//! - `OnceLock`s (the runtime, the process settings, the control socket's state, the CUDA
//!   driver's contexts and streams, the interposed symbols) are set once and never waited on
//!   after that.

// One concept per file; files import one another directly (`super::registry::Pick`), never
// through this facade, which only declares and re-exports.
mod alloc;
mod background;
mod backups;
mod base;
mod checks;
mod comms;
mod devices;
mod digests;
mod export;
mod inflight;
mod leases;
mod nccl_tag;
mod pause;
mod pipeline;
mod progress;
mod queries;
mod registry;
mod report;
mod resident;
mod restoring;
mod resume;
pub mod segment;
mod settings;
mod stats;
mod tools;
mod transfer;
mod txn;
mod types;

pub use base::Engine;
pub use checks::Checks;
pub use comms::{reserved_tag, CommStats, Comms, CommsDone, NoComms};
pub use comms::{Registered, Registration, NCCL_TAG};
pub use export::Exported;
pub use pipeline::{CopyConfig, PinMode, MAX_WORKERS};
pub use progress::{Backings, Phase, Progress, Which};
pub use registry::{Pick, Record};
pub use report::OpReport;
pub use restoring::StreamOf;
pub use segment::{segments, SEGMENT_BYTES};
pub use stats::{OpStats, Stats, TagStats};
pub use transfer::LaneProbe;
pub use types::{AllocInfo, AllocRequest, Backup, BackupLease, ChunkInfo, State};

#[cfg(test)]
mod tests;
