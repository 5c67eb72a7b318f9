//! tms-smoke's device digest step: the driver's digests against `driver::digest` on the same
//! bytes (pieces of several sizes, a short last piece, a short last block), a one-byte change
//! seen in its piece alone, and the digest's speed beside a D2H copy of the same memory.

use std::sync::Arc;
use std::time::Instant;

use tms::backup::{BackupKind, HostBuffer, HostLayout};
use tms::driver::digest::{self, BLOCK_BYTES};
use tms::driver::Driver;
use tms::error::ErrorKind;
use tms::units::human;
use tms::Engine;

use super::common::{self, req, s};
use super::Checks;

const SEED: u64 = 0x5EED_0123_4567_89AB;

/// The digest checks; `size` sets the timed digest (twice it).
pub fn run(driver: &Arc<dyn Driver>, e: &Engine, size: u64, c: &mut Checks) -> Result<(), String> {
    let d = &**driver;
    let stream = s(d.stream(0))?;
    // A short last piece for every piece size below, and a short last block for most.
    let len = (24 << 20) + 8 * (256 * 5 + 17);
    let p = s(e.alloc(&req(len, "digest", None)))?;
    let mut data = common::pattern(len as usize, 4242);
    s(e.write_bytes(p, &data))?;

    let piece = 2 << 20;
    let t = Instant::now();
    let first = match d.digest(0, p, len, piece, SEED, stream) {
        Err(err) if matches!(err.kind(), ErrorKind::Unsupported) => {
            println!("SKIP  device digest: {err}");
            return s(e.free(p)).map(drop);
        }
        r => s(r)?,
    };
    let first_s = t.elapsed().as_secs_f64();
    c.check(
        "device digest equals the definition",
        first == digest::pieces(&data, piece, SEED),
        format!(
            "{} pieces of {} over {len} bytes (first call, loading the kernel: {first_s:.3} s)",
            first.len(),
            human(piece)
        ),
    );
    for piece in [(1 << 20) + 8, BLOCK_BYTES, 4096, len + 8] {
        let got = s(d.digest(0, p, len, piece, SEED, stream))?;
        c.check(
            &format!("device digest in pieces of {piece} bytes"),
            got == digest::pieces(&data, piece, SEED),
            format!("{} pieces over {len} bytes", got.len()),
        );
    }
    if d.name() == "cuda" {
        let r = d.digest(0, p, len - 4, piece, SEED, stream);
        c.check(
            "device digest refuses a length not a multiple of 8",
            matches!(&r, Err(err) if matches!(err.kind(), ErrorKind::InvalidArgument)),
            match &r {
                Err(err) => err.to_string(),
                Ok(_) => "accepted".into(),
            },
        );
    }

    // One byte flipped on the device: its piece's digest changes, no other.
    let at = 5 * piece + 12345;
    data[at as usize] ^= 0x10;
    s(e.write_bytes(p + at, &data[at as usize..at as usize + 1]))?;
    let after = s(d.digest(0, p, len, piece, SEED, stream))?;
    let changed: Vec<usize> = (0..first.len()).filter(|&i| first[i] != after[i]).collect();
    c.check(
        "a one-byte change is seen in its piece alone",
        changed == [5] && after == digest::pieces(&data, piece, SEED),
        format!("byte {at} flipped; pieces changed: {changed:?}"),
    );
    s(e.free(p))?;

    speed(driver, e, (2 * size) & !7, c)
}

/// Time a digest of `len` bytes (best of three) and a D2H copy of them into pinned memory.
fn speed(driver: &Arc<dyn Driver>, e: &Engine, len: u64, c: &mut Checks) -> Result<(), String> {
    let d = &**driver;
    let stream = s(d.stream(0))?;
    let p = s(e.alloc(&req(len, "digest-speed", None)))?;
    s(e.write_bytes(p, &common::pattern(len.min(64 << 20) as usize, 1)))?;
    let piece = 2 << 20;
    let mut best = f64::MAX;
    let mut pieces = 0;
    for _ in 0..3 {
        let t = Instant::now();
        pieces = s(d.digest(0, p, len, piece, SEED, stream))?.len();
        best = best.min(t.elapsed().as_secs_f64());
    }
    let layout = HostLayout {
        chunk: len.next_multiple_of(tms::os::page_size()),
        hugepages: false,
        streaming: false,
    };
    let mut host = s(HostBuffer::new(
        driver.clone(),
        0,
        BackupKind::Pinned,
        len,
        layout,
    ))?;
    s(host.pin_all())?;
    let t = Instant::now();
    s(e.read_bytes(p, host.as_mut_slice()))?;
    let copy_s = t.elapsed().as_secs_f64();
    drop(host);
    s(e.free(p))?;
    let gb = |secs: f64| len as f64 / secs / 1e9;
    c.check(
        "device digest speed",
        pieces as u64 == len.div_ceil(piece),
        format!(
            "{} in {:.2} ms: {:.0} GB/s; a D2H copy of it to pinned memory {:.0} GB/s ({:.2} ms)",
            human(len),
            best * 1e3,
            gb(best),
            gb(copy_s),
            copy_s * 1e3
        ),
    );
    Ok(())
}
