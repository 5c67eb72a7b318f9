//! Strategies for the property tests: any message of the protocol, every field set or not,
//! strings of any characters.

use proptest::prelude::*;

use crate::*;

/// Any characters, control characters and newlines included: a tag is the peer's to choose,
/// and must not break the line it travels in.
fn arb_text(max: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(any::<char>(), 0..=max).prop_map(String::from_iter)
}

fn arb_tag() -> impl Strategy<Value = Option<String>> {
    prop::option::of(arb_text(24))
}

fn arb_chunks() -> impl Strategy<Value = Option<ChunkRanges>> {
    prop::option::of(prop::collection::vec(
        (any::<u64>(), any::<u64>()).prop_map(|(a, b)| [a.min(b), a.max(b)]),
        0..6,
    ))
}

fn arb_hello() -> impl Strategy<Value = Hello> {
    (
        any::<u32>(),
        any::<u32>(),
        arb_text(16),
        prop::option::of(arb_text(8)),
        prop::collection::vec(arb_text(8), 0..3),
    )
        .prop_map(|(protocol, pid, software, backend, features)| Hello {
            protocol,
            pid,
            software,
            backend,
            features,
        })
}

pub fn arb_request() -> impl Strategy<Value = Request> {
    prop_oneof![
        arb_hello().prop_map(Request::Hello),
        Just(Request::Ping),
        Just(Request::Status),
        Just(Request::GetRegion),
        (arb_tag(), arb_chunks(), any::<[bool; 2]>()).prop_map(
            |(tag, chunks, [chunk_state, job_record])| Request::Pause {
                tag,
                chunks,
                chunk_state,
                job_record,
            }
        ),
        (arb_tag(), arb_chunks(), any::<[bool; 4]>()).prop_map(
            |(tag, chunks, [chunk_state, job_record, no_wait, verify])| Request::Resume {
                tag,
                chunks,
                chunk_state,
                job_record,
                no_wait,
                verify,
            }
        ),
        arb_text(24).prop_map(|tag| Request::Chunks { tag }),
        (
            prop::option::of(any::<bool>()),
            arb_tag(),
            prop::option::of(any::<bool>()),
            prop::option::of(prop_oneof![
                Just(BackupBackend::Pinned),
                Just(BackupBackend::Mmap)
            ]),
            prop::option::of(any::<bool>()),
        )
            .prop_map(|(enabled, tag, cpu_backup, backend, disk_backup)| {
                Request::SetRegion(RegionUpdate {
                    enabled,
                    tag,
                    cpu_backup,
                    backend,
                    disk_backup,
                })
            }),
    ]
}

/// A duration or rate as a server sends it: finite and not negative. Any such double, by its
/// bits: subnormal, huge and all between.
fn arb_quantity() -> impl Strategy<Value = f64> {
    (0u64..0x7ff0_0000_0000_0000).prop_map(f64::from_bits)
}

fn arb_timing() -> impl Strategy<Value = OpTiming> {
    (any::<[u64; 3]>(), arb_quantity(), arb_quantity()).prop_map(|(n, seconds, gib_per_s)| {
        OpTiming {
            allocations: n[0],
            bytes: n[1],
            copied_bytes: n[2],
            seconds,
            gib_per_s,
        }
    })
}

fn arb_nccl() -> impl Strategy<Value = NcclStatus> {
    let text = || prop::option::of(arb_text(8));
    (
        text(),
        text(),
        text(),
        any::<[u64; 8]>(),
        any::<bool>(),
        arb_text(6),
    )
        .prop_map(
            |(version, unsupported, error, n, in_all_tags, registered_policy)| NcclStatus {
                version,
                unsupported,
                error,
                communicators: n[0],
                suspended: n[1],
                suspendable_bytes: n[2],
                suspended_bytes: n[3],
                persistent_bytes: n[4],
                total_bytes: n[5],
                registered_buffers: n[6],
                registered_bytes: n[7],
                in_all_tags,
                registered_policy,
            },
        )
}

fn arb_tag_status() -> impl Strategy<Value = TagStatus> {
    let timing = || prop::option::of(arb_timing());
    let extra = (prop::option::of(arb_text(8)), prop::option::of(arb_nccl()));
    (arb_text(12), any::<[u64; 13]>(), timing(), timing(), extra).prop_map(
        |(tag, n, last_pause, last_resume, (failed_restore, nccl))| TagStatus {
            tag,
            allocations: n[0],
            active_allocations: n[1],
            paused_allocations: n[2],
            partial_allocations: n[3],
            restoring_allocations: n[4],
            resident_allocations: n[5],
            bytes_requested: n[6],
            bytes_active: n[7],
            bytes_paused: n[8],
            bytes_restoring: n[9],
            bytes_unrestored: n[10],
            failed_restore,
            host_backup_bytes: n[11],
            disk_backup_bytes: n[12],
            last_pause,
            last_resume,
            nccl,
        },
    )
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop::sample::select(vec![Op::Pause, Op::Resume])
}

fn arb_running() -> impl Strategy<Value = Running> {
    let phase = prop::sample::select(Phase::ALL.to_vec());
    let backing = prop::sample::select(vec![
        Backing::Host,
        Backing::Disk,
        Backing::HostAndDisk,
        Backing::Unknown,
    ]);
    let progress = (
        prop::option::of(phase),
        prop::option::of(any::<u64>()),
        prop::option::of(any::<u64>()),
        prop::option::of(backing),
        prop::option::of(arb_quantity()),
    );
    let base = (
        arb_op(),
        prop::option::of(arb_text(8)),
        arb_chunks(),
        arb_quantity(),
        any::<bool>(),
    );
    (base, progress).prop_map(
        |((op, tag, chunks, seconds, in_process), (phase, total, done, backing, rate))| Running {
            in_process,
            phase,
            bytes_total: total,
            bytes_done: done,
            backing,
            gib_per_s: rate,
            ..Running::new(op, tag, chunks, seconds)
        },
    )
}

fn arb_region() -> impl Strategy<Value = RegionInfo> {
    let backend = prop::sample::select(vec![BackupBackend::Pinned, BackupBackend::Mmap]);
    (any::<[bool; 3]>(), arb_text(8), backend).prop_map(|(b, tag, backend)| RegionInfo {
        enabled: b[0],
        tag,
        cpu_backup: b[1],
        backend,
        disk_backup: b[2],
    })
}

fn arb_status() -> impl Strategy<Value = Status> {
    let device = (
        any::<i32>(),
        any::<[u64; 2]>(),
        prop::option::of(arb_text(8)),
    )
        .prop_map(|(device, n, error)| DeviceMemory {
            device,
            free_bytes: n[0],
            total_bytes: n[1],
            error,
        });
    let lists = (
        prop::collection::vec(device, 0..3),
        prop::collection::vec(arb_tag_status(), 0..3),
        prop::collection::vec(arb_running(), 0..3),
    );
    let head = (any::<u32>(), arb_text(6), any::<bool>(), any::<[u64; 2]>());
    (head, lists, prop::option::of(arb_region())).prop_map(
        |((pid, backend, retain_cpu_backup, n), (devices, tags, operations), default_region)| {
            Status {
                pid,
                backend,
                retain_cpu_backup,
                memory_margin_bytes: n[0],
                devices,
                tags,
                tags_omitted: n[1],
                default_region,
                operations,
            }
        },
    )
}

fn arb_done() -> impl Strategy<Value = OpDone> {
    let what = (arb_op(), prop::option::of(arb_text(8)), arb_chunks());
    let n = (any::<[u64; 7]>(), prop::option::of(any::<u64>()));
    (what, n, arb_quantity(), any::<bool>()).prop_map(
        |((op, tag, chunks), (n, disk_copied_bytes), seconds, unknown_tag)| OpDone {
            op,
            tag,
            chunks,
            allocations: n[0],
            bytes: n[1],
            copied_bytes: n[2],
            disk_copied_bytes,
            seconds,
            unknown_tag,
            pending_bytes: n[3],
            communicators: n[4],
            unchanged_bytes: n[5],
            verified_bytes: n[6],
        },
    )
}

pub fn arb_reply() -> impl Strategy<Value = Reply> {
    let kind = prop::sample::select(ErrorKind::ALL.to_vec());
    let chunks =
        (arb_text(8), any::<[u64; 3]>(), "[01]{0,16}").prop_map(|(tag, n, states)| ChunkStatus {
            tag,
            addr: n[0],
            chunk_size: n[1],
            count: n[2],
            states,
        });
    prop_oneof![
        arb_hello().prop_map(Reply::Hello),
        any::<u32>().prop_map(|pid| Reply::Pong { pid }),
        arb_status().prop_map(|s| Reply::Status(Box::new(s))),
        arb_done().prop_map(Reply::Done),
        arb_region().prop_map(Reply::Region),
        chunks.prop_map(Reply::Chunks),
        (kind, arb_text(24), prop::option::of(any::<[u64; 3]>())).prop_map(|(k, m, c)| {
            Reply::Error(ErrorReply {
                kind: k,
                message: m,
                changed: c.map(|[allocations, bytes, communicators]| Changed {
                    allocations,
                    bytes,
                    communicators,
                }),
            })
        }),
    ]
}
