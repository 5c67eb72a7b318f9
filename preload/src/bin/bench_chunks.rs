//! The chunked-allocation scenarios of `tms-bench` (engine Note [Chunked allocations]).

use std::sync::Arc;

use tms::backup::BackupKind;
use tms::driver::{DevPtr, Driver};
use tms::engine::{AllocRequest, Pick};
use tms::units::human;
use tms::Engine;

use super::common::{req, s};
use super::machine::{bare_vmm, Limits};
use super::{device_pattern, vs, Opts, Table};

/// Chunked allocations (engine Note [Chunked allocations]): resuming k of n chunks without a
/// backup against the bare VMM calls for k such chunks, measured here; and half the chunks of a
/// TOTAL-sized allocation paused and resumed with a pinned backup against the link.
pub(super) fn chunk_scenarios(
    driver: &Arc<dyn Driver>,
    e: &Engine,
    o: &Opts,
    lim: &Limits,
    t: &mut Table,
) -> Result<(), String> {
    let d = &**driver;
    let g = s(d.granularity(0))?;
    // 64 of 512 chunks, fewer where TOTAL is small (the sim).
    let n = (o.total / g).clamp(8, 512);
    let k = n / 8;
    println!(
        "
chunked, no backup: {k} of {n} chunks of {}",
        human(g)
    );
    // The bare calls for k chunks, in k reserved pieces.
    let ranges: Vec<DevPtr> = (0..k)
        .map(|_| s(d.reserve(0, g)))
        .collect::<Result<_, _>>()?;
    let pieces: Vec<(DevPtr, u64)> = ranges.iter().map(|p| (*p, g)).collect();
    let (map_s, unmap_s, _) = bare_vmm(d, &pieces)?;
    for p in &ranges {
        s(d.free_range(*p, g))?;
    }
    t.add(
        format!("bare create+map+access, {k} x {}", human(g)),
        k * g,
        map_s,
    );
    t.add(
        format!("bare unmap+release, {k} x {}", human(g)),
        k * g,
        unmap_s,
    );
    let p = s(e.alloc(&AllocRequest {
        chunk: g,
        ..req(n * g, "chunks", None)
    }))?;
    // Every eighth chunk: k runs of one chunk, the costly case.
    let idx: Vec<usize> = (0..n as usize).step_by((n / k) as usize).collect();
    let pick = Pick::chunks(p, &idx);
    for cycle in 1..=3 {
        t.timed(
            format!("chunks: pause {k} of {n} #{cycle}"),
            k * g,
            Some(("bare unmap+release s", unmap_s)),
            || e.pause_pick(&pick),
        )?;
        t.timed(
            format!("chunks: resume {k} of {n} #{cycle}"),
            k * g,
            Some(("bare create+map s", map_s)),
            || e.resume_pick(&pick),
        )?;
    }
    s(e.free(p))?;

    // With a pinned backup: half of TOTAL's chunks (every other one), for chunks of 64 MiB and
    // of 1 GiB.
    for chunk in [64u64 << 20, 1 << 30] {
        let chunk = chunk.next_multiple_of(g);
        let n = o.total / chunk;
        if n < 2 {
            continue;
        }
        let size = n * chunk;
        let tag = format!("chunks-{}", human(chunk).replace(' ', ""));
        println!(
            "
chunked, pinned backup: half of {n} chunks of {}",
            human(chunk)
        );
        let p = s(e.alloc(&AllocRequest {
            chunk,
            ..req(size, &tag, Some(BackupKind::Pinned))
        }))?;
        device_pattern(e, p, size, 7, false)?;
        let idx: Vec<usize> = (0..n as usize).step_by(2).collect();
        let bytes = idx.len() as u64 * chunk;
        let pick = Pick::chunks(p, &idx);
        e.set_retain_cpu_backup(true);
        t.timed(
            format!("{tag}: pause half, fresh host memory"),
            bytes,
            lim.cold_pause(),
            || e.pause_pick(&pick),
        )?;
        t.timed(
            format!("{tag}: resume half"),
            bytes,
            vs("pinned H2D", lim.h2d),
            || e.resume_pick(&pick),
        )?;
        if !e.wait_for_background_pinning(std::time::Duration::from_secs(120)) {
            t.problems
                .push(format!("{tag}: background page-locking did not finish"));
        }
        for cycle in 2..=3 {
            t.timed(
                format!("{tag}: pause half #{cycle}, retained"),
                bytes,
                vs("pinned D2H", lim.d2h),
                || e.pause_pick(&pick),
            )?;
            t.timed(
                format!("{tag}: resume half #{cycle}, retained"),
                bytes,
                vs("pinned H2D", lim.h2d),
                || e.resume_pick(&pick),
            )?;
        }
        e.set_retain_cpu_backup(false);
        if !device_pattern(e, p, size, 7, true)? {
            t.problems
                .push(format!("{tag}: contents differ after the cycles"));
        }
        s(e.free(p))?;
    }
    Ok(())
}
