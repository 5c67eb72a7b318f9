//! Native smoke test of the engine on whichever driver is chosen (CUDA on a GPU machine, the
//! sim elsewhere), without PyTorch; and of the driver's device digest (`smoke_digest.rs`). Prints one line per check and a summary last; exits
//! non-zero if any check fails.
//!
//! Usage: `tms-smoke [SIZE]` (default 1GiB: the size of the large allocations).

#[path = "common.rs"]
#[allow(dead_code)]
mod common;
mod smoke_digest;

use common::{req, s};

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use tms::backup::BackupKind;
use tms::driver::Driver;
use tms::engine::State;
use tms::units::{human, parse_bytes};
use tms::Engine;

struct Checks {
    passed: usize,
    failed: usize,
}

impl Checks {
    fn check(&mut self, name: &str, ok: bool, detail: String) {
        if ok {
            self.passed += 1;
            println!("PASS  {name}: {detail}");
        } else {
            self.failed += 1;
            println!("FAIL  {name}: {detail}");
        }
    }
}

fn main() -> ExitCode {
    let size = match std::env::args().nth(1) {
        Some(a) if a == "-h" || a == "--help" => {
            println!("usage: tms-smoke [SIZE]   (default 1GiB)");
            return ExitCode::SUCCESS;
        }
        Some(a) => match parse_bytes(&a) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("tms-smoke: {e}");
                return ExitCode::from(2);
            }
        },
        None => 1 << 30,
    };
    let driver = match common::choose_driver(size.saturating_mul(6)) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("tms-smoke: {e}");
            return ExitCode::from(2);
        }
    };
    let mut c = Checks {
        passed: 0,
        failed: 0,
    };
    println!(
        "tms-smoke on the {} driver, allocation size {}",
        driver.name(),
        human(size)
    );
    if let Err(e) = run(&driver, size, &mut c) {
        c.check("no unexpected error", false, e);
    }
    println!("\nSMOKE SUMMARY ({} driver)", driver.name());
    println!("{} passed, {} failed", c.passed, c.failed);
    if c.failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn run(driver: &Arc<dyn Driver>, size: u64, c: &mut Checks) -> Result<(), String> {
    let d = &**driver;
    let e = Engine::new(driver.clone());
    let start_free = common::free_bytes(d, 0);

    // 1. Pause gives the memory back, resume takes it again, addresses stay.
    let sizes = [size / 4, size / 4 + 12345, size / 2, 3 * size / 4 + 1];
    let mut ptrs = Vec::new();
    for sz in sizes {
        ptrs.push(s(e.alloc(&req(sz, "plain", None)))?);
    }
    let mapped: u64 = e.allocations().iter().map(|a| a.mapped).sum();
    let before = common::free_bytes(d, 0);
    let t = Instant::now();
    s(e.pause(Some("plain")))?;
    let pause_s = t.elapsed().as_secs_f64();
    let paused = common::free_bytes(d, 0);
    let rose = paused.saturating_sub(before);
    c.check(
        "pause releases device memory",
        rose as f64 >= 0.99 * mapped as f64,
        format!(
            "free rose by {} for {} paused ({:.4} s, {} allocations)",
            human(rose),
            human(mapped),
            pause_s,
            sizes.len()
        ),
    );
    let t = Instant::now();
    s(e.resume(Some("plain")))?;
    let resume_s = t.elapsed().as_secs_f64();
    let resumed = common::free_bytes(d, 0);
    let fell = paused.saturating_sub(resumed);
    c.check(
        "resume takes device memory again",
        fell as f64 >= 0.99 * mapped as f64,
        format!("free fell by {} ({:.4} s)", human(fell), resume_s),
    );
    let now: Vec<u64> = e.allocations().iter().map(|a| a.addr).collect();
    let mut sorted = ptrs.clone();
    sorted.sort();
    c.check(
        "addresses unchanged after resume",
        now == sorted,
        format!("{} allocations", now.len()),
    );
    for p in &ptrs {
        s(e.free(*p))?;
    }

    // 2. CPU backup keeps contents, both backends; without backup the memory is fresh.
    for backend in [BackupKind::Pinned, BackupKind::Mmap] {
        let sz = size + 4097;
        let p = s(e.alloc(&req(sz, "backup", Some(backend))))?;
        let data = common::pattern(sz as usize, 7 + backend as u64);
        s(e.write_bytes(p, &data))?;
        let t = Instant::now();
        let pr = s(e.pause(Some("backup")))?;
        let ps = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let rr = s(e.resume(Some("backup")))?;
        let rs = t.elapsed().as_secs_f64();
        let mut back = vec![0u8; sz as usize];
        s(e.read_bytes(p, &mut back))?;
        let same_addr = e
            .allocations()
            .iter()
            .any(|a| a.addr == p && a.state == State::Active);
        c.check(
            &format!("{} backup: bytes identical after resume", backend.as_str()),
            back == data && same_addr,
            format!(
                "{} bytes; pause {:.3} s ({:.1} GiB/s), resume {:.3} s ({:.1} GiB/s)",
                sz,
                ps,
                common::gib_per_s(pr.copied, ps),
                rs,
                common::gib_per_s(rr.copied, rs)
            ),
        );
        s(e.free(p))?;
    }

    // 3. Retention: the second pause reuses the host buffer.
    e.set_retain_cpu_backup(true);
    let p = s(e.alloc(&req(size / 4, "retain", Some(BackupKind::Pinned))))?;
    s(e.pause(Some("retain")))?;
    let first = s(e.cpu_backup_ptr(p, 1))?;
    s(e.resume(Some("retain")))?;
    let data = common::pattern((size / 4) as usize, 99);
    s(e.write_bytes(p, &data))?;
    s(e.pause(Some("retain")))?;
    let second = s(e.cpu_backup_ptr(p, 1))?;
    let mut kept = vec![0u8; (size / 4) as usize];
    let found = s(e.copy_cpu_backup(p, &mut kept))?;
    c.check(
        "retention reuses the host backup",
        first.is_some() && first == second && found && kept == data,
        format!("buffer {:?} both times", first),
    );
    e.set_retain_cpu_backup(false);
    s(e.resume(Some("retain")))?;
    c.check(
        "non-retaining resume releases the backup",
        s(e.cpu_backup_ptr(p, 1))?.is_none(),
        "no host backup after resume".into(),
    );
    s(e.free(p))?;

    // 4. Out of memory on resume: a status, the tag stays paused, a later resume works.
    let victim_size = size;
    let v = s(e.alloc(&req(victim_size, "victim", Some(BackupKind::Pinned))))?;
    let vdata = common::pattern(victim_size as usize, 1234);
    s(e.write_bytes(v, &vdata))?;
    s(e.pause(Some("victim")))?;
    let mut hogs = Vec::new();
    let g = d.granularity(0).map_err(|e| e.to_string())?;
    loop {
        let free = common::free_bytes(d, 0);
        if free < victim_size / 2 || hogs.len() > 10_000 {
            break;
        }
        let chunk = (free / 4).max(g).min(free.saturating_sub(g)).max(g) / g * g;
        match e.alloc(&req(chunk, "hog", None)) {
            Ok(p) => hogs.push(p),
            Err(err) if err.is_oom() => {
                if chunk == g {
                    break;
                }
                // Fall back to granularity-sized pieces near the limit.
                match e.alloc(&req(g, "hog", None)) {
                    Ok(p) => hogs.push(p),
                    Err(_) => break,
                }
            }
            Err(err) => return Err(err.to_string()),
        }
    }
    let hogged: u64 = e
        .allocations()
        .iter()
        .filter(|a| a.tag == "hog")
        .map(|a| a.mapped)
        .sum();
    let res = e.resume(Some("victim"));
    let still_paused = e
        .allocations()
        .iter()
        .any(|a| a.addr == v && a.state == State::Paused && a.host_valid);
    let msg = match &res {
        Err(err) => err.to_string(),
        Ok(_) => "resume succeeded".into(),
    };
    c.check(
        "OOM on resume is a status and leaves the tag paused",
        matches!(&res, Err(err) if err.is_oom()) && still_paused,
        format!("{} of hogs; {msg}", human(hogged)),
    );
    for h in hogs {
        s(e.free(h))?;
    }
    let res2 = e.resume(Some("victim"));
    let mut back = vec![0u8; victim_size as usize];
    let ok2 = res2.is_ok() && e.read_bytes(v, &mut back).is_ok() && back == vdata;
    c.check(
        "resume after freeing memory succeeds with contents",
        ok2,
        match res2 {
            Ok(r) => format!("{} restored", human(r.copied)),
            Err(err) => err.to_string(),
        },
    );
    s(e.free(v))?;

    // 5. Memory margin refuses with out-of-memory.
    let free = common::free_bytes(d, 0);
    e.set_memory_margin(free.saturating_sub(size / 2));
    let r = e.alloc(&req(size, "margin", None));
    c.check(
        "memory margin refuses with out-of-memory",
        matches!(&r, Err(err) if err.is_oom()),
        match &r {
            Err(err) => err.to_string(),
            Ok(_) => "allocation succeeded".into(),
        },
    );
    if let Ok(p) = r {
        s(e.free(p))?;
    }
    e.set_memory_margin(0);

    // 6. The device digest against its definition, and its speed.
    smoke_digest::run(driver, &e, size, c)?;

    // 7. Nothing left behind.
    let end = common::free_bytes(d, 0);
    c.check(
        "everything freed",
        e.allocations().is_empty() && end + (64 << 20) >= start_free,
        format!("free at start {}, at end {}", human(start_free), human(end)),
    );
    Ok(())
}
