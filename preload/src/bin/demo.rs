//! The demo: allocate pauseable memory, write a pattern, pause (device memory comes back),
//! resume at the same address, check the pattern. CUDA where there is a GPU, else the sim.
//!
//! Usage: `tms-demo [SIZE]` (default 1GiB; e.g. `tms-demo 256MiB`).

#[path = "common.rs"]
mod common;

use common::{req, s};

use std::process::ExitCode;
use std::time::Instant;

use tms::backup::BackupKind;
use tms::units::{human, parse_bytes};
use tms::Engine;

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("tms-demo: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<bool, String> {
    let size = match std::env::args().nth(1) {
        Some(a) if a == "-h" || a == "--help" => {
            println!("usage: tms-demo [SIZE]   (default 1GiB)\nEnvironment: TMS_BACKEND=auto|cuda|hip|sim, TMS_SIM_CAPACITY");
            return Ok(true);
        }
        Some(a) => parse_bytes(&a).map_err(|e| e.to_string())?,
        None => 1 << 30,
    };
    let driver = common::choose_driver(size.saturating_mul(4).max(1 << 30))?;
    let engine = Engine::new(driver.clone());
    let d = &*driver;
    let dev = 0;
    println!(
        "torch-memory-saver demo: driver {}, device {dev}, {} pauseable with CPU backup (pinned)\n",
        d.name(),
        human(size)
    );

    let mut rows: Vec<(String, u64, String)> = Vec::new();
    let f0 = common::free_bytes(d, dev);
    rows.push(("start".into(), f0, String::new()));

    let ptr = s(engine.alloc(&req(size, "demo", Some(BackupKind::Pinned))))?;
    let f1 = common::free_bytes(d, dev);
    rows.push((format!("allocated at {ptr:#x}"), f1, String::new()));

    let data = common::pattern(size as usize, 42);
    s(engine.write_bytes(ptr, &data))?;

    let t = Instant::now();
    let p = s(engine.pause(Some("demo")))?;
    let pause_s = t.elapsed().as_secs_f64();
    let f2 = common::free_bytes(d, dev);
    rows.push((
        "paused".into(),
        f2,
        format!(
            "{pause_s:.3} s, {:.1} GiB/s",
            common::gib_per_s(p.copied, pause_s)
        ),
    ));

    let t = Instant::now();
    let r = s(engine.resume(Some("demo")))?;
    let resume_s = t.elapsed().as_secs_f64();
    let f3 = common::free_bytes(d, dev);
    rows.push((
        "resumed".into(),
        f3,
        format!(
            "{resume_s:.3} s, {:.1} GiB/s",
            common::gib_per_s(r.copied, resume_s)
        ),
    ));

    let same_addr = engine.allocations().first().map(|a| a.addr) == Some(ptr);
    let mut back = vec![0u8; size as usize];
    s(engine.read_bytes(ptr, &mut back))?;
    let intact = back == data;

    println!(
        "{:<28} {:>14} {:>12}  time",
        "step", "device free", "change"
    );
    let mut prev = f0;
    for (step, free, time) in &rows {
        println!(
            "{step:<28} {:>14} {:>12}  {time}",
            human(*free),
            common::delta_gib(*free, prev)
        );
        prev = *free;
    }
    let released = f2.saturating_sub(f1);
    println!();
    println!(
        "memory given back on pause : {} of {} mapped",
        human(released),
        human(p.bytes)
    );
    println!(
        "same address after resume  : {}",
        if same_addr { "yes" } else { "NO" }
    );
    println!(
        "pattern after resume       : {}",
        if intact { "identical" } else { "DIFFERENT" }
    );
    s(engine.free(ptr))?;
    let ok = same_addr && intact && released as f64 >= 0.99 * p.bytes as f64;
    println!("\ndemo {}", if ok { "OK" } else { "FAILED" });
    Ok(ok)
}
