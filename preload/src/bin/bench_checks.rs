//! `tms-bench --checks`: skipping unchanged memory and verified resumes (engine Note [Skipping
//! unchanged memory]), beside the link they avoid: the digest alone on the device; a retained
//! pause copying everything (the baseline), then with skip-unchanged on memory that did not
//! change, and on memory that all changed; a retained resume, then the same verified.

use std::sync::Arc;

use tms::backup::BackupKind;
use tms::driver::{DevPtr, Driver};
use tms::engine::Checks;
use tms::units::human;
use tms::Engine;

use super::common::{req, s};
use super::{check_and_free, device_patterns, vs, Limits, Opts, Table};

const OFF: Checks = Checks {
    skip_unchanged: false,
    verify: false,
};

/// The scenarios for 1 x TOTAL and COUNT x TOTAL/COUNT, pinned backups, retained.
pub(super) fn run(
    driver: &Arc<dyn Driver>,
    e: &Engine,
    o: &Opts,
    lim: &Limits,
    t: &mut Table,
) -> Result<(), String> {
    digest_rate(driver, e, o.total, t)?;
    let piece = o.total / o.count;
    for (n, size) in [(1, o.total), (o.count, piece)] {
        scenario(e, n, size, lim, t)?;
    }
    Ok(())
}

/// The digest kernel alone over TOTAL bytes: what skipping costs at least.
fn digest_rate(
    driver: &Arc<dyn Driver>,
    e: &Engine,
    total: u64,
    t: &mut Table,
) -> Result<(), String> {
    println!("\ndigest on the device, {}", human(total));
    let p = s(e.alloc(&req(total, "digest", None)))?;
    let g = s(driver.granularity(0))?;
    let stream = s(driver.stream(0))?;
    let len = total / 8 * 8;
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t0 = std::time::Instant::now();
        match driver.digest(0, p, len, g, 1, stream) {
            Ok(_) => best = best.min(t0.elapsed().as_secs_f64()),
            Err(err) => {
                println!("  the {} driver cannot digest: {err}", driver.name());
                s(e.free(p))?;
                return Ok(());
            }
        }
    }
    t.add(format!("digest of {} (best of 3)", human(len)), len, best);
    s(e.free(p))?;
    Ok(())
}

fn scenario(e: &Engine, n: u64, size: u64, lim: &Limits, t: &mut Table) -> Result<(), String> {
    println!(
        "\nskip-unchanged and verify, pinned backup retained, {n} x {}",
        human(size)
    );
    let tag = format!("checks-{n}");
    let ptrs: Vec<DevPtr> = (0..n)
        .map(|_| s(e.alloc(&req(size, &tag, Some(BackupKind::Pinned)))))
        .collect::<Result<_, _>>()?;
    device_patterns(e, &ptrs, size, 7, false)?;
    let bytes = n * size;
    let d2h = vs("pinned D2H", lim.d2h);
    let h2d = vs("pinned H2D", lim.h2d);
    e.set_retain_cpu_backup(true);
    e.set_checks(Some(&tag), OFF);
    // Retained buffers, page-locked, as in the cycles measured below.
    s(e.pause(Some(&tag)))?;
    s(e.resume(Some(&tag)))?;
    e.wait_for_background_pinning(std::time::Duration::from_secs(120));
    t.timed(
        format!("{tag}: pause, retained, copying all"),
        bytes,
        d2h,
        || e.pause(Some(&tag)),
    )?;
    t.timed(format!("{tag}: resume, retained"), bytes, h2d, || {
        e.resume(Some(&tag))
    })?;
    let skip = Checks {
        skip_unchanged: true,
        verify: false,
    };
    e.set_checks(Some(&tag), skip);
    // A pause with skipping on, its row, and what it copied.
    let skipping = |t: &mut Table, what: &str| -> Result<(), String> {
        let r = t.timed(format!("{tag}: pause, skip on, {what}"), bytes, d2h, || {
            e.pause(Some(&tag))
        })?;
        println!(
            "  {} unchanged, {} copied",
            human(r.unchanged),
            human(r.copied)
        );
        Ok(())
    };
    // The first pause with the setting digests and copies everything: the backup learns.
    skipping(t, "learning")?;
    s(e.resume(Some(&tag)))?;
    skipping(t, "nothing changed")?;
    s(e.resume(Some(&tag)))?;
    device_patterns(e, &ptrs, size, 8, false)?;
    skipping(t, "all changed")?;
    e.set_checks(
        Some(&tag),
        Checks {
            skip_unchanged: true,
            verify: true,
        },
    );
    let r = t.timed(
        format!("{tag}: resume, retained, verified"),
        bytes,
        h2d,
        || e.resume(Some(&tag)),
    )?;
    println!("  {} verified", human(r.verified));
    e.set_checks(Some(&tag), OFF);
    e.set_retain_cpu_backup(false);
    s(e.pause(Some(&tag)))?;
    s(e.resume(Some(&tag)))?;
    check_and_free(e, t, &tag, &ptrs, size, 8)?;
    Ok(())
}
