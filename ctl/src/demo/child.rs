//! The demo's child: this executable again (`tmsctl __demo-child`) with libtms.so preloaded. It
//! allocates pauseable memory through the library, writes a pattern, says so on stdout, and
//! then takes commands on stdin (the demo module's doc lists the lines and the commands).

use std::ffi::{c_void, CStr, CString};
use std::io::{BufRead, Write};

use nix::sys::prctl::set_pdeathsig;
use nix::sys::signal::{signal, SigHandler, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, getppid, ForkResult, Pid};
use serde_json::json;

use super::api::Api;
use super::ChildArgs;
use tms_units::parse_bytes;

/// The hidden `__demo-child` command. Exit status: 0 after `exit` or end of input; 3 when
/// libtms.so is not preloaded; 4 when the library cannot start (no usable driver); 1 otherwise.
pub fn child(a: &ChildArgs) -> anyhow::Result<()> {
    // Behave like a C program that never ignored SIGPIPE: the library must not raise it.
    // SAFETY: the default disposition runs no handler of ours, so nothing can be unsound.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
    if let Some(parent) = a.parent {
        // A parent killed alone would leave the child running on, to die of SIGPIPE on its next
        // line, which leaves its control socket behind; SIGTERM has the library remove it.
        let _ = set_pdeathsig(Signal::SIGTERM);
        if getppid() != Pid::from_raw(parent) {
            std::process::exit(1);
        }
    }
    let api = match Api::load() {
        Ok(api) => api,
        Err(e) => {
            say(&format!("ERROR nolib {e}"));
            std::process::exit(3);
        }
    };
    let backend = match api.init() {
        Ok(b) => b,
        Err(_) => {
            say(&format!("ERROR init {}", api.last_error()));
            std::process::exit(4);
        }
    };
    let fail = |stage: &str, e: String| -> ! {
        say(&format!("ERROR {stage} {e}"));
        std::process::exit(1);
    };
    let tag = CString::new(a.tag.clone()).unwrap_or_default();
    let rc = if a.disk {
        match api.region_enter(&tag, false, None) {
            0 => api.set_disk_backup(true),
            rc => rc,
        }
    } else {
        api.region_enter(&tag, true, Some(c"pinned"))
    };
    if let Err(e) = api.check(rc) {
        fail("region", e);
    }
    if let Some(chunk) = a.chunk {
        // Looked up only here: a library that predates chunks still runs the plain demo.
        let set = api.set_chunk_size().unwrap_or_else(|e| fail("chunk", e));
        let Ok(bytes) = usize::try_from(chunk) else {
            fail("chunk", format!("{chunk} bytes is too large"));
        };
        if let Err(e) = api.check(set.call(bytes)) {
            fail("chunk", e);
        }
    }
    let Ok(size) = isize::try_from(a.size) else {
        fail("alloc", format!("{} bytes is too large", a.size));
    };
    let p = api.torch_malloc(size);
    let alloc_err = p.is_null().then(|| api.last_error());
    let _ = api.region_exit();
    if let Some(e) = alloc_err {
        fail("alloc", e);
    }
    let ptr = p as u64;
    // Before the pattern, which takes seconds for gigabytes: the parent shows which device.
    say(&format!("STARTED {backend}"));
    if let Err(e) = write_pattern(&api, ptr, a.size, a.seed) {
        fail("write", e);
    }
    let socket = api.control_socket();
    say(&format!(
        "READY {}",
        json!({
            "pid": std::process::id(),
            "ptr": ptr,
            "size": a.size,
            "backend": backend,
            "socket": socket.as_ref().ok(),
            "socket_error": socket.as_ref().err(),
        })
    ));

    let mut mallocs: Vec<*mut c_void> = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let mut words = line.split_whitespace();
        match words.next() {
            Some("verify") => match verify_range(words, a.size)
                .and_then(|(from, to)| verify_pattern(&api, ptr, from, to, a.seed))
            {
                Ok(None) => say("VERIFY ok"),
                Ok(Some(at)) => say(&format!("VERIFY mismatch at byte {at}")),
                Err(e) => say(&format!("VERIFY error {e}")),
            },
            Some("malloc") => {
                let n = words
                    .next()
                    .and_then(|w| parse_bytes(w).ok())
                    .unwrap_or(1 << 20);
                let (rc, q) = api.cuda_malloc(n as usize);
                if rc == 0 && !q.is_null() {
                    mallocs.push(q);
                }
                say(&format!("MALLOC {rc} {:#x}", q as u64));
            }
            Some("resident") => {
                // Another allocation of the tag (CPU backup), kept resident: pauses leave it.
                let n = words
                    .next()
                    .and_then(|w| parse_bytes(w).ok())
                    .unwrap_or(2 << 20);
                say(&format!("RESIDENT {}", resident(&api, &tag, n)));
            }
            Some("fork") => {
                // SAFETY: the child only calls exit (running atexit handlers, which is the
                // point: they must leave the parent's socket alone).
                match unsafe { fork() } {
                    Ok(ForkResult::Child) => {
                        // SAFETY: ends the child normally, atexit handlers included.
                        unsafe { libc::exit(0) }
                    }
                    Ok(ForkResult::Parent { child }) => {
                        let code = match waitpid(child, None) {
                            Ok(WaitStatus::Exited(_, code)) => code,
                            _ => -1,
                        };
                        say(&format!("FORKED {child} {code}"));
                    }
                    Err(e) => say(&format!("FORKED -1 {e}")),
                }
            }
            Some("exit") => break,
            Some(other) => say(&format!("ERROR command unknown command {other:?}")),
            None => {}
        }
    }
    for q in mallocs {
        // SAFETY: q came from cudaMalloc above and is freed once.
        unsafe { api.cuda_free(q) };
    }
    // SAFETY: p came from tms_torch_malloc of size bytes above and is freed once.
    unsafe { api.torch_free(p, size) };
    say("BYE");
    Ok(())
}

/// The child's `resident N` command: a pauseable allocation of `n` bytes in `tag` with a CPU
/// backup, kept resident; `"0 ADDR"` or `"ERR why"`.
fn resident(api: &Api, tag: &CStr, n: u64) -> String {
    let keep = match api.keep_resident() {
        Ok(f) => f,
        Err(e) => return format!("ERR {e}"),
    };
    if let Err(e) = api.check(api.region_enter(tag, true, Some(c"pinned"))) {
        return format!("ERR {e}");
    }
    let p = api.torch_malloc(n as isize);
    let err = p.is_null().then(|| api.last_error());
    let _ = api.region_exit();
    if let Some(e) = err {
        return format!("ERR {e}");
    }
    let mut size = 0u64;
    match api.check(keep.call(p as u64, &mut size)) {
        Ok(()) => format!("0 {:#x}", p as u64),
        Err(e) => format!("ERR {e}"),
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", line.replace('\n', " "));
    let _ = out.flush();
}

/// Byte `i` of the pattern.
fn pattern_byte(i: u64, seed: u8) -> u8 {
    let x = i ^ (i >> 7) ^ (i >> 17);
    (x.wrapping_mul(0x9E37_79B9) >> 5) as u8 ^ seed
}

const CHUNK: u64 = 32 << 20;

fn fill(buf: &mut [u8], start: u64, seed: u8) {
    for (k, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(start + k as u64, seed);
    }
}

fn write_pattern(api: &Api, ptr: u64, size: u64, seed: u8) -> Result<(), String> {
    let mut buf = vec![0u8; CHUNK.min(size) as usize];
    let mut off = 0;
    while off < size {
        let n = CHUNK.min(size - off) as usize;
        fill(&mut buf[..n], off, seed);
        api.check(api.write(ptr + off, &buf[..n]))?;
        off += n as u64;
    }
    Ok(())
}

/// Check bytes `[from, to)` of the allocation at `ptr` against the pattern; the offset of the
/// first byte that differs, if any.
fn verify_pattern(
    api: &Api,
    ptr: u64,
    from: u64,
    to: u64,
    seed: u8,
) -> Result<Option<u64>, String> {
    let mut got = vec![0u8; CHUNK.min(to.saturating_sub(from)) as usize];
    let mut want = vec![0u8; got.len()];
    let mut off = from;
    while off < to {
        let n = CHUNK.min(to - off) as usize;
        api.check(api.read(ptr + off, &mut got[..n]))?;
        fill(&mut want[..n], off, seed);
        if let Some(i) = (0..n).find(|i| got[*i] != want[*i]) {
            return Ok(Some(off + i as u64));
        }
        off += n as u64;
    }
    Ok(None)
}

/// The range `verify` checks: `[OFFSET LENGTH]` of the words after it (sizes such as 2MiB),
/// else the whole allocation.
fn verify_range<'a>(
    mut words: impl Iterator<Item = &'a str>,
    size: u64,
) -> Result<(u64, u64), String> {
    let Some(off) = words.next() else {
        return Ok((0, size));
    };
    let off = parse_bytes(off).map_err(|e| e.to_string())?;
    let len = words.next().ok_or("verify OFFSET LENGTH: no length")?;
    let len = parse_bytes(len).map_err(|e| e.to_string())?;
    match off.checked_add(len) {
        Some(end) if end <= size => Ok((off, end)),
        _ => Err(format!("{off}+{len} is outside the {size} bytes allocated")),
    }
}
