//! `tmsctl demo`: a child process with libtms.so preloaded allocates pauseable memory and
//! writes a pattern; we pause and resume it through its control socket, exactly as one would
//! an unmodified program, and the child checks the pattern afterwards.
//!
//! The child is this executable again (`tmsctl __demo-child`). It reaches the library the way
//! any preloaded program's code would, by symbol (`dlsym`): `tms_init`, `tms_region_enter`,
//! `tms_torch_malloc`, `tms_write_bytes`, ... It talks to the parent in lines on stdout
//! (`STARTED <backend>` once allocated, `READY {json}` once the pattern is written, `ERROR
//! <stage> <message>`, `VERIFY ok`, ...) and takes commands on stdin
//! (`verify [OFFSET LENGTH]`, `malloc SIZE`, `fork`, `exit`); the tests drive it the same way.
//! With `--chunk SIZE` its allocation is a chunked one (`tms_set_chunk_size`), whose chunks
//! pause and resume on their own.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use nix::sys::signal::{signal, SigHandler, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult};
use serde_json::{json, Value};
use tms_proto::{OpDone, Reply, Request, Status};

use crate::client::{self, Client, Code, Failure, Folder};
use crate::output::{human, human_delta, parse_bytes, printable};
use crate::Ctx;

fn parse_size(s: &str) -> Result<u64, String> {
    let v = parse_bytes(s).map_err(|e| e.to_string())?;
    if v == 0 {
        return Err("the size must be above 0".into());
    }
    Ok(v)
}

/// Which device the demo runs on. Not the library's `TMS_BACKEND` values: there `auto` means
/// CUDA only, so the demo's own default has a name of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DemoBackend {
    /// CUDA if the driver starts, else the simulated device (the demo's default).
    CudaOrSim,
    /// CUDA only (what TMS_BACKEND=auto and TMS_BACKEND=cuda mean in the library).
    Cuda,
    /// The simulated device (host memory standing in for a GPU).
    Sim,
}

impl DemoBackend {
    fn name(self) -> &'static str {
        match self {
            DemoBackend::CudaOrSim => "cuda-or-sim",
            DemoBackend::Cuda => "cuda",
            DemoBackend::Sim => "sim",
        }
    }
}

/// Options of `tmsctl demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// libtms.so to preload [default: $TMS_LIB, else libtms.so next to tmsctl, else
    /// ../lib/libtms.so from there, else the one pip installed: ../lib/python3*/site-packages/
    /// torch_memory_saver/libtms*.so, ../torch_memory_saver/libtms*.so (pip --target), and the
    /// torch_memory_saver_hook_mode_preload*.so beside them].
    #[arg(long, value_name = "PATH")]
    lib: Option<PathBuf>,
    /// Pauseable memory to allocate (1GiB, 256MiB, ...).
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_size)]
    size: u64,
    /// Device to run on [default: $TMS_BACKEND where set, as the library reads it (auto and
    /// cuda: CUDA only; sim), else cuda-or-sim]. The output says which was used and why.
    #[arg(long, value_enum, value_name = "BACKEND")]
    backend: Option<DemoBackend>,
    /// Tag of the demo's allocation.
    #[arg(long, value_name = "TAG", default_value = "demo")]
    tag: String,
}

/// Options of the hidden child.
#[derive(Args, Debug)]
pub struct ChildArgs {
    /// Bytes of pauseable memory.
    #[arg(long, value_parser = parse_size)]
    size: u64,
    /// Its tag.
    #[arg(long, default_value = "demo")]
    tag: String,
    /// Pattern seed.
    #[arg(long, default_value_t = 7)]
    seed: u8,
    /// Back the allocation up on disk (in `TMS_DISK_BACKUP_DIR`) instead of in host memory.
    #[arg(long)]
    disk: bool,
    /// Make the allocation a chunked one, in chunks of this many bytes (a multiple of the
    /// device's granularity that divides --size).
    #[arg(long, value_parser = parse_size)]
    chunk: Option<u64>,
}

// ---------------------------------------------------------------------------------------------
// The child

/// The child's `resident N` command: a pauseable allocation of `n` bytes in `tag` with a CPU
/// backup, kept resident; `"0 ADDR"` or `"ERR why"`.
fn resident(api: &Api, tag: &CStr, n: u64) -> String {
    let keep = match sym(c"tms_keep_resident_ex") {
        // SAFETY: the library's tms_keep_resident_ex, whose C signature (tms.h) is this.
        Ok(p) => unsafe { std::mem::transmute::<*mut c_void, KeepResidentFn>(p) },
        Err(e) => return format!("ERR {e}"),
    };
    // SAFETY: tag and the backend name are NUL-terminated strings.
    if let Err(e) = api.check(unsafe { (api.region_enter)(1, tag.as_ptr(), 1, c"pinned".as_ptr()) })
    {
        return format!("ERR {e}");
    }
    // SAFETY: a plain call of the pluggable-allocator entry point; NULL stream.
    let p = unsafe { (api.torch_malloc)(n as isize, 0, std::ptr::null_mut()) };
    let err = p.is_null().then(|| api.last_error());
    // SAFETY: no arguments.
    let _ = unsafe { (api.region_exit)() };
    if let Some(e) = err {
        return format!("ERR {e}");
    }
    let mut size = 0u64;
    // SAFETY: p is an allocation of the library; size is writable.
    match api.check(unsafe { keep(p as u64, &mut size) }) {
        Ok(()) => format!("0 {:#x}", p as u64),
        Err(e) => format!("ERR {e}"),
    }
}

type OutStrFn = unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int;
type RegionEnterFn = unsafe extern "C" fn(c_int, *const c_char, c_int, *const c_char) -> c_int;
type RegionExitFn = unsafe extern "C" fn() -> c_int;
type SetFlagFn = unsafe extern "C" fn(c_int) -> c_int;
type TorchMallocFn = unsafe extern "C" fn(isize, c_int, *mut c_void) -> *mut c_void;
type TorchFreeFn = unsafe extern "C" fn(*mut c_void, isize, c_int, *mut c_void);
type WriteFn = unsafe extern "C" fn(u64, *const c_void, u64) -> c_int;
type ReadFn = unsafe extern "C" fn(u64, *mut c_void, u64) -> c_int;
type LastErrorFn = unsafe extern "C" fn(*mut c_char, usize) -> usize;
type CudaMallocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type CudaFreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type SetChunkSizeFn = unsafe extern "C" fn(usize) -> c_int;
type KeepResidentFn = unsafe extern "C" fn(u64, *mut u64) -> c_int;

/// The preloaded library's entry points.
struct Api {
    init: OutStrFn,
    control_socket: OutStrFn,
    region_enter: RegionEnterFn,
    region_exit: RegionExitFn,
    set_disk_backup: SetFlagFn,
    torch_malloc: TorchMallocFn,
    torch_free: TorchFreeFn,
    write: WriteFn,
    read: ReadFn,
    last_error: LastErrorFn,
    cuda_malloc: CudaMallocFn,
    cuda_free: CudaFreeFn,
}

fn sym(name: &CStr) -> Result<*mut c_void, String> {
    // SAFETY: dlsym only looks a NUL-terminated name up in the loaded objects.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if p.is_null() {
        Err(format!(
            "{} not found: libtms.so is not preloaded (LD_PRELOAD)",
            name.to_string_lossy()
        ))
    } else {
        Ok(p)
    }
}

macro_rules! load {
    ($name:literal, $ty:ty) => {{
        let p = sym($name)?;
        // SAFETY: the symbol is libtms.so's function of that name, whose C signature (see
        // preload/include/tms.h and the CUDA runtime's) is exactly `$ty`.
        unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
    }};
}

impl Api {
    fn load() -> Result<Api, String> {
        Ok(Api {
            init: load!(c"tms_init", OutStrFn),
            control_socket: load!(c"tms_control_socket", OutStrFn),
            region_enter: load!(c"tms_region_enter", RegionEnterFn),
            region_exit: load!(c"tms_region_exit", RegionExitFn),
            set_disk_backup: load!(c"tms_set_enable_disk_backup", SetFlagFn),
            torch_malloc: load!(c"tms_torch_malloc", TorchMallocFn),
            torch_free: load!(c"tms_torch_free", TorchFreeFn),
            write: load!(c"tms_write_bytes", WriteFn),
            read: load!(c"tms_read_bytes", ReadFn),
            last_error: load!(c"tms_last_error", LastErrorFn),
            cuda_malloc: load!(c"cudaMalloc", CudaMallocFn),
            cuda_free: load!(c"cudaFree", CudaFreeFn),
        })
    }

    fn last_error(&self) -> String {
        let mut buf = vec![0u8; 4096];
        // SAFETY: buf is writable for its length; the function NUL-terminates within it.
        unsafe { (self.last_error)(buf.as_mut_ptr().cast(), buf.len()) };
        let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    }

    fn check(&self, rc: c_int) -> Result<(), String> {
        if rc == 0 {
            Ok(())
        } else {
            Err(format!("status {rc}: {}", self.last_error()))
        }
    }

    fn out_str(&self, f: OutStrFn) -> Result<String, String> {
        let mut buf = vec![0u8; 4096];
        let mut len = 0usize;
        // SAFETY: buf is writable for its length, len for one usize.
        let rc = unsafe { f(buf.as_mut_ptr().cast(), buf.len(), &mut len) };
        self.check(rc)?;
        buf.truncate(len.min(buf.len()));
        Ok(String::from_utf8_lossy(&buf).into_owned())
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
        // SAFETY: buf is readable for n bytes.
        api.check(unsafe { (api.write)(ptr + off, buf.as_ptr().cast(), n as u64) })?;
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
        // SAFETY: got is writable for n bytes.
        api.check(unsafe { (api.read)(ptr + off, got.as_mut_ptr().cast(), n as u64) })?;
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

/// The hidden `__demo-child` command. Exit status: 0 after `exit` or end of input; 3 when
/// libtms.so is not preloaded; 4 when the library cannot start (no usable driver); 1 otherwise.
pub fn child(a: &ChildArgs) -> anyhow::Result<()> {
    // Behave like a C program that never ignored SIGPIPE: the library must not raise it.
    // SAFETY: the default disposition runs no handler of ours, so nothing can be unsound.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
    let api = match Api::load() {
        Ok(api) => api,
        Err(e) => {
            say(&format!("ERROR nolib {e}"));
            std::process::exit(3);
        }
    };
    let backend = match api.out_str(api.init) {
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
        // SAFETY: tag is a NUL-terminated string; NULL backend; then a plain flag.
        match unsafe { (api.region_enter)(1, tag.as_ptr(), 0, std::ptr::null()) } {
            // SAFETY: tms_set_enable_disk_backup takes a plain flag, nothing it could misread.
            0 => unsafe { (api.set_disk_backup)(1) },
            rc => rc,
        }
    } else {
        // SAFETY: tag and the backend name are NUL-terminated strings.
        unsafe { (api.region_enter)(1, tag.as_ptr(), 1, c"pinned".as_ptr()) }
    };
    if let Err(e) = api.check(rc) {
        fail("region", e);
    }
    if let Some(chunk) = a.chunk {
        // Looked up only here: a library that predates chunks still runs the plain demo.
        let set = sym(c"tms_set_chunk_size").unwrap_or_else(|e| fail("chunk", e));
        // SAFETY: the library's tms_set_chunk_size, whose C signature (tms.h) is exactly this.
        let set = unsafe { std::mem::transmute::<*mut c_void, SetChunkSizeFn>(set) };
        let Ok(bytes) = usize::try_from(chunk) else {
            fail("chunk", format!("{chunk} bytes is too large"));
        };
        // SAFETY: a plain call with a number.
        if let Err(e) = api.check(unsafe { set(bytes) }) {
            fail("chunk", e);
        }
    }
    let Ok(size) = isize::try_from(a.size) else {
        fail("alloc", format!("{} bytes is too large", a.size));
    };
    // SAFETY: a plain call of the pluggable-allocator entry point; NULL stream.
    let p = unsafe { (api.torch_malloc)(size, 0, std::ptr::null_mut()) };
    let alloc_err = p.is_null().then(|| api.last_error());
    // SAFETY: no arguments.
    let _ = unsafe { (api.region_exit)() };
    if let Some(e) = alloc_err {
        fail("alloc", e);
    }
    let ptr = p as u64;
    // Before the pattern, which takes seconds for gigabytes: the parent shows which device.
    say(&format!("STARTED {backend}"));
    if let Err(e) = write_pattern(&api, ptr, a.size, a.seed) {
        fail("write", e);
    }
    let socket = api.out_str(api.control_socket);
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
                let mut q: *mut c_void = std::ptr::null_mut();
                // SAFETY: q is writable for one pointer.
                let rc = unsafe { (api.cuda_malloc)(&mut q, n as usize) };
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
        unsafe { (api.cuda_free)(q) };
    }
    // SAFETY: p came from tms_torch_malloc above and is freed once.
    unsafe { (api.torch_free)(p, size, 0, std::ptr::null_mut()) };
    say("BYE");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The parent

/// A running demo child.
struct DemoChild {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl DemoChild {
    fn spawn(
        lib: &Path,
        backend: &str,
        size: u64,
        tag: &str,
        dir: &Path,
    ) -> anyhow::Result<DemoChild> {
        let exe = std::env::current_exe()?;
        let preload = match std::env::var("LD_PRELOAD") {
            Ok(p) if !p.trim().is_empty() => format!("{}:{p}", lib.display()),
            _ => lib.display().to_string(),
        };
        let mut cmd = Command::new(exe);
        cmd.arg("__demo-child")
            .arg("--size")
            .arg(size.to_string())
            .arg("--tag")
            .arg(tag)
            .env("LD_PRELOAD", preload)
            .env("TMS_BACKEND", backend)
            .env("TMS_SOCKET_DIR", dir)
            .env_remove("TMS_CONTROL")
            .env_remove("TMS_INIT_ENABLE")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if backend == "sim" && std::env::var_os("TMS_SIM_CAPACITY").is_none() {
            cmd.env(
                "TMS_SIM_CAPACITY",
                size.saturating_mul(2).max(8 << 30).to_string(),
            );
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting the demo child: {e}"))?;
        let stdout = child.stdout.take();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            if let Some(out) = stdout {
                for l in BufReader::new(out).lines() {
                    let Ok(l) = l else { break };
                    if tx.send(l).is_err() {
                        break;
                    }
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        if let Some(mut err) = child.stderr.take() {
            let sink = stderr.clone();
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = err.read_to_string(&mut s);
                if let Ok(mut g) = sink.lock() {
                    g.push_str(&s);
                }
            });
        }
        Ok(DemoChild {
            stdin: child.stdin.take(),
            child,
            lines: rx,
            stderr,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stderr_tail(&self) -> String {
        let s = self.stderr.lock().map(|g| g.clone()).unwrap_or_default();
        let t = s.trim();
        if t.is_empty() {
            String::new()
        } else {
            format!(" (child's stderr: {})", t.lines().last().unwrap_or(t))
        }
    }

    /// The next line starting with `word`; an `ERROR` line or the end of output is
    /// `Err((stage, message))`.
    fn expect(&mut self, word: &str, timeout: Duration) -> Result<String, (String, String)> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    if let Some(rest) = l.strip_prefix("ERROR ") {
                        let (stage, msg) = rest.split_once(' ').unwrap_or((rest, ""));
                        return Err((stage.to_string(), msg.to_string()));
                    }
                    if let Some(rest) = l.strip_prefix(word) {
                        return Ok(rest.trim().to_string());
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err((
                        "timeout".into(),
                        format!(
                            "no {word} from the demo child within {:.0} s",
                            timeout.as_secs_f64()
                        ),
                    ))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let st = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                    return Err((
                        "exit".into(),
                        format!("the demo child ended ({st}){}", self.stderr_tail()),
                    ));
                }
            }
        }
    }

    fn send(&mut self, cmd: &str) -> anyhow::Result<()> {
        let Some(i) = self.stdin.as_mut() else {
            anyhow::bail!("the demo child's input is closed");
        };
        writeln!(i, "{cmd}")?;
        i.flush()?;
        Ok(())
    }

    /// Ask the child to exit and wait a little; kill it otherwise.
    fn finish(mut self) {
        let _ = self.send("exit");
        self.stdin = None;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for DemoChild {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Where `tmsctl demo` looks for the library when no `--lib` is given, in order: `$TMS_LIB`,
/// then beside this executable (`bin/`) and below its parent (`prefix`): a build tree
/// (`target/release/`), an install prefix (`../lib`), a virtual environment or `--user`
/// install (`../lib/python3*/site-packages/`) and `pip install --target DIR` (`DIR/bin/tmsctl`,
/// `DIR/torch_memory_saver/`). The Python package holds the library as `libtms*.so`
/// (`libtms.abi3.so`) and, beside the package, under the existing library's names. Entries with
/// `*` are patterns: one `*` per path component.
fn lib_candidates(exe_dir: &Path) -> Vec<PathBuf> {
    let prefix = exe_dir.parent().unwrap_or(exe_dir);
    let mut c = vec![exe_dir.join("libtms.so"), prefix.join("lib/libtms.so")];
    for base in ["lib/python3*/*-packages", ""] {
        let base = if base.is_empty() {
            prefix.to_path_buf()
        } else {
            prefix.join(base)
        };
        c.push(base.join("torch_memory_saver/libtms*.so"));
        c.push(base.join("torch_memory_saver_hook_mode_preload*.so"));
    }
    c
}

/// The files a candidate of [`lib_candidates`] names, by name (none, or itself, without `*`).
fn expand(pattern: &Path) -> Vec<PathBuf> {
    let mut found = vec![PathBuf::new()];
    for part in pattern.components() {
        let part = part.as_os_str();
        let Some((head, tail)) = part.to_str().and_then(|p| p.split_once('*')) else {
            for f in &mut found {
                f.push(part);
            }
            continue;
        };
        let mut next = Vec::new();
        for dir in &found {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            let mut names: Vec<String> = entries
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| {
                    n.len() >= head.len() + tail.len() && n.starts_with(head) && n.ends_with(tail)
                })
                .collect();
            names.sort();
            next.extend(names.into_iter().map(|n| dir.join(n)));
        }
        found = next;
    }
    found.retain(|f| f.is_file());
    found
}

fn find_lib(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    // (path, a pattern): --lib and $TMS_LIB are taken as they are.
    let mut candidates: Vec<(PathBuf, bool)> = Vec::new();
    if let Some(p) = explicit {
        candidates.push((p.to_path_buf(), false));
    } else {
        if let Some(p) = std::env::var_os("TMS_LIB").filter(|p| !p.is_empty()) {
            candidates.push((PathBuf::from(p), false));
        }
        if let Some(dir) = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf))
        {
            candidates.extend(lib_candidates(&dir).into_iter().map(|c| (c, true)));
        }
    }
    let mut tried = Vec::new();
    for (c, pattern) in candidates {
        let found = if pattern {
            expand(&c).into_iter().next()
        } else {
            c.is_file().then(|| c.clone())
        };
        if let Some(found) = found {
            return Ok(std::fs::canonicalize(&found).unwrap_or(found));
        }
        tried.push(printable(&c.display().to_string()).into_owned());
    }
    Err(Failure::new(
        Code::Failed,
        format!(
            "cannot find libtms.so (tried {}): pass --lib PATH or set TMS_LIB",
            tried.join(", ")
        ),
    )
    .into())
}

struct Row {
    step: &'static str,
    status: Status,
    done: Option<OpDone>,
}

/// The demo's table, a row at a time: fixed widths, so that each row can be printed as soon
/// as its step is done and the columns still line up.
struct Table<'a> {
    tag: &'a str,
    /// Device memory free at the previous row.
    prev: Option<u64>,
}

impl<'a> Table<'a> {
    fn header() -> String {
        format!(
            "{:<10} {:>13} {:>13} {:>12} {:>12} {:>12}  time",
            "step", "device free", "change", "active", "paused", "host backup"
        )
    }

    fn new(tag: &'a str) -> Self {
        Table { tag, prev: None }
    }

    fn row(&mut self, r: &Row) -> String {
        let t = tag_of(&r.status, self.tag);
        let free = free_of(&r.status);
        let change = match (self.prev, free) {
            (Some(p), Some(f)) => human_delta(p, f),
            _ => "-".into(),
        };
        self.prev = free;
        let time = match &r.done {
            Some(d) => {
                let moved = if d.copied_bytes > 0 {
                    d.copied_bytes
                } else {
                    d.bytes
                };
                let rate = if d.seconds > 0.0 {
                    moved as f64 / d.seconds / (1u64 << 30) as f64
                } else {
                    0.0
                };
                format!("{:.3} s, {rate:.1} GiB/s", d.seconds)
            }
            None => "-".into(),
        };
        format!(
            "{:<10} {:>13} {:>13} {:>12} {:>12} {:>12}  {time}",
            r.step,
            free.map_or("?".into(), human),
            change,
            human(t.map_or(0, |t| t.bytes_active)),
            human(t.map_or(0, |t| t.bytes_paused)),
            human(t.map_or(0, |t| t.host_backup_bytes)),
        )
    }
}

/// Print `text` on stdout now (a pipe would hold it back until the end otherwise).
fn say_now(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
}

fn free_of(s: &Status) -> Option<u64> {
    s.devices
        .iter()
        .find(|d| d.device == 0 && d.error.is_none())
        .map(|d| d.free_bytes)
}

fn tag_of<'a>(s: &'a Status, tag: &str) -> Option<&'a tms_proto::TagStatus> {
    s.tags.iter().find(|t| t.tag == tag)
}

fn status(c: &mut Client) -> client::Result<Status> {
    c.ask_for(&Request::Status, |r| match r {
        Reply::Status(s) => Some(*s),
        _ => None,
    })
}

/// A pause or resume, its progress shown as `tmsctl pause` shows it (on a terminal), and its
/// wait bounded by the time without progress where the library reports it.
fn op(
    c: &mut Client,
    req: Request,
    timeout: Duration,
    show: crate::progress::Show,
) -> client::Result<OpDone> {
    let watch = match &req {
        Request::Pause { tag, .. } | Request::Resume { tag, .. }
            if c.hello.has(tms_proto::FEATURE_PROGRESS) =>
        {
            Some(crate::progress::Watch::start(
                c.socket(),
                timeout,
                crate::progress::Asked {
                    pid: c.pid(),
                    with_pid: false,
                    op: if matches!(req, Request::Pause { .. }) {
                        tms_proto::Op::Pause
                    } else {
                        tms_proto::Op::Resume
                    },
                    tag: tag.clone(),
                    chunks: None,
                },
                show,
            ))
        }
        _ => None,
    };
    let moved = watch.as_ref().map(|w| move || w.last_moved());
    let r = c.ask_while(&req, moved.as_ref().map(|m| m as &dyn Fn() -> Instant));
    drop(watch);
    match r? {
        Reply::Done(d) => Ok(d),
        other => Err(Failure::new(
            Code::Failed,
            format!(
                "process {}: unexpected reply {}",
                c.pid(),
                printable(&format!("{other:?}"))
            ),
        )),
    }
}

/// The device the demo asks for and why, in words: `--backend`, else `$TMS_BACKEND` as the
/// library reads it (`auto` is CUDA only there), else the demo's default, cuda-or-sim.
fn backend_choice(flag: Option<DemoBackend>) -> anyhow::Result<(DemoBackend, String)> {
    if let Some(b) = flag {
        return Ok((b, format!("--backend {}", b.name())));
    }
    let env = std::env::var("TMS_BACKEND").unwrap_or_default();
    Ok(match env.trim() {
        "" => (
            DemoBackend::CudaOrSim,
            "--backend cuda-or-sim, the default".to_string(),
        ),
        "auto" => (
            DemoBackend::Cuda,
            "TMS_BACKEND=auto, which is CUDA only in the library".to_string(),
        ),
        "cuda" => (DemoBackend::Cuda, "TMS_BACKEND=cuda".to_string()),
        "sim" => (DemoBackend::Sim, "TMS_BACKEND=sim".to_string()),
        other => {
            return Err(Failure::new(
                Code::Usage,
                format!(
                    "TMS_BACKEND={}: expected auto, cuda or sim",
                    crate::output::quoted(other)
                ),
            )
            .into())
        }
    })
}

/// `tmsctl demo`.
pub fn run(ctx: &Ctx, a: &DemoArgs) -> anyhow::Result<()> {
    let lib = find_lib(a.lib.as_deref())?;
    let (choice, because) = backend_choice(a.backend)?;
    let mut fallback: Option<String> = None;
    let first = if choice == DemoBackend::Sim {
        "sim"
    } else {
        "cuda"
    };
    let mut child = DemoChild::spawn(&lib, first, a.size, &a.tag, &ctx.dir)?;
    // The child says which device it runs on once its library has started, then writes its
    // pattern (seconds, for gigabytes) and says READY: the first lines are printed at once.
    let started = match child.expect("STARTED", ctx.timeout) {
        Ok(r) => r,
        Err((stage, msg)) if stage == "init" && choice == DemoBackend::Cuda => {
            return Err(Failure::new(
                Code::Failed,
                format!(
                    "demo child (init): {}; the demo was to use CUDA only ({because}): \
                     --backend cuda-or-sim falls back to the simulated device, --backend sim \
                     uses it",
                    printable(&msg)
                ),
            )
            .into())
        }
        Err((stage, msg)) if stage == "init" && choice == DemoBackend::CudaOrSim => {
            drop(child);
            fallback = Some(msg);
            child = DemoChild::spawn(&lib, "sim", a.size, &a.tag, &ctx.dir)?;
            child
                .expect("STARTED", ctx.timeout)
                .map_err(|(s, m)| Failure::new(Code::Failed, format!("demo child ({s}): {m}")))?
        }
        Err((stage, msg)) => {
            return Err(Failure::new(Code::Failed, format!("demo child ({stage}): {msg}")).into())
        }
    };
    let pid = child.pid();
    let driver_note = match (&fallback, started.as_str()) {
        (Some(why), _) => format!(
            "sim (the simulated device: {because}, and CUDA could not start: {})",
            printable(why)
        ),
        (None, "sim") => format!("sim (the simulated device: {because})"),
        (None, b) => format!("{} ({because})", printable(b)),
    };
    if !ctx.json {
        say_now(&format!(
            "tmsctl demo: child {pid} with LD_PRELOAD={}\ndriver {driver_note}",
            printable(&lib.display().to_string()),
        ));
    }
    let ready = child
        .expect("READY", ctx.timeout)
        .map_err(|(s, m)| Failure::new(Code::Failed, format!("demo child ({s}): {m}")))?;
    let ready: Value = serde_json::from_str(&ready).unwrap_or(Value::Null);
    let backend = ready["backend"].as_str().unwrap_or("?").to_string();
    let socket = ready["socket"].as_str().map(str::to_string);
    if socket.is_none() {
        return Err(Failure::new(
            Code::Failed,
            format!(
                "the demo child has no control socket: {}",
                ready["socket_error"].as_str().unwrap_or("?")
            ),
        )
        .into());
    }

    let sock = Folder::open(&ctx.dir)?.find(pid)?;
    let mut c = Client::connect(&sock, ctx.timeout)?;
    let tag = Some(a.tag.clone());
    // Each row is printed as soon as its step is done (the widths are fixed, so the columns
    // line up without knowing the later rows).
    let mut table = Table::new(&a.tag);
    if !ctx.json {
        say_now(&format!(
            "{} pauseable with CPU backup (pinned), tag {}, control socket {}\n\n{}",
            human(a.size),
            crate::output::quoted(&a.tag),
            printable(socket.as_deref().unwrap_or("?")),
            Table::header()
        ));
    }
    let show = crate::progress::Show::pick(false, false);
    let mut rows = Vec::new();
    let mut step = |c: &mut Client, step: &'static str, done: Option<OpDone>| {
        let r = Row {
            step,
            status: status(c)?,
            done,
        };
        if !ctx.json {
            say_now(&table.row(&r));
        }
        rows.push(r);
        client::Result::Ok(())
    };
    step(&mut c, "allocated", None)?;
    let d = op(
        &mut c,
        Request::Pause {
            tag: tag.clone(),
            chunks: None,
            chunk_state: false,
            job_record: false,
        },
        ctx.timeout,
        show,
    )?;
    step(&mut c, "paused", Some(d))?;
    let d = op(
        &mut c,
        Request::Resume {
            tag: tag.clone(),
            chunks: None,
            chunk_state: false,
            job_record: false,
            no_wait: false,
        },
        ctx.timeout,
        show,
    )?;
    step(&mut c, "resumed", Some(d))?;
    drop(c);
    child.send("verify")?;
    let verdict = match child.expect("VERIFY", ctx.timeout) {
        Ok(v) => v,
        Err((s, m)) => format!("error ({s}): {m}"),
    };
    child.finish();

    // Checks.
    let mapped = tag_of(&rows[0].status, &a.tag).map_or(0, |t| t.bytes_active);
    let paused = tag_of(&rows[1].status, &a.tag).map_or(0, |t| t.bytes_paused);
    let active_after = tag_of(&rows[2].status, &a.tag).map_or(0, |t| t.bytes_active);
    let given_back = match (free_of(&rows[0].status), free_of(&rows[1].status)) {
        (Some(f0), Some(f1)) => f1.saturating_sub(f0),
        _ => 0,
    };
    let mut problems = Vec::new();
    if mapped < a.size {
        problems.push(format!(
            "{} active before the pause, expected {}",
            human(mapped),
            human(a.size)
        ));
    }
    if paused != mapped {
        problems.push(format!(
            "{} paused, expected {}",
            human(paused),
            human(mapped)
        ));
    }
    if active_after != mapped {
        problems.push(format!(
            "{} active after resume, expected {}",
            human(active_after),
            human(mapped)
        ));
    }
    if verdict != "ok" {
        problems.push(format!("pattern after resume: {verdict}"));
    }
    let ok = problems.is_empty();

    if ctx.json {
        let steps: Vec<Value> = rows
            .iter()
            .map(|r| {
                let t = tag_of(&r.status, &a.tag);
                json!({
                    "step": r.step,
                    "device_free_bytes": free_of(&r.status),
                    "bytes_active": t.map_or(0, |t| t.bytes_active),
                    "bytes_paused": t.map_or(0, |t| t.bytes_paused),
                    "host_backup_bytes": t.map_or(0, |t| t.host_backup_bytes),
                    "seconds": r.done.as_ref().map(|d| d.seconds),
                    "copied_bytes": r.done.as_ref().map(|d| d.copied_bytes),
                })
            })
            .collect();
        let mut report = json!({
            "ok": ok,
            "backend": backend,
            "backend_choice": choice.name(),
            "backend_because": because,
            "fallback_reason": fallback,
            "child_pid": pid,
            "lib": lib,
            "socket": socket,
            "tag": a.tag,
            "size": a.size,
            "mapped": mapped,
            "given_back_bytes": given_back,
            "steps": steps,
            "pattern": verdict,
            "problems": problems,
        });
        // The failure returned below is told here, in the one document of the command.
        if !ok {
            report["error"] = crate::error_json(Code::Failed, &failure_message(&problems));
        }
        crate::output::print_json(report);
    } else {
        println!();
        println!(
            "memory given back on pause : {} of {} mapped",
            human(given_back),
            human(mapped)
        );
        for (r, when) in rows.iter().skip(1).zip(["pause", "resume"]) {
            if let Some(d) = r.done.as_ref().filter(|d| d.copied_bytes > 0) {
                println!(
                    "{:<27}: {}",
                    format!("contents on {when}"),
                    crate::output::copies(d).trim_start_matches(", ")
                );
            }
        }
        println!(
            "pattern after resume       : {}",
            if verdict == "ok" {
                "identical".into()
            } else {
                printable(&verdict)
            }
        );
        println!();
        if ok {
            println!("demo OK");
        } else {
            println!("demo FAILED");
        }
    }
    if ok {
        Ok(())
    } else {
        Err(Failure::new(Code::Failed, failure_message(&problems)).into())
    }
}

fn failure_message(problems: &[String]) -> String {
    format!("demo failed: {}", problems.join("; "))
}
