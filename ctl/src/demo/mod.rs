//! `tmsctl demo`: a child process with libtms.so preloaded allocates pauseable memory and
//! writes a pattern; we pause and resume it through its control socket, exactly as one would
//! an unmodified program, and the child checks the pattern afterwards.
//!
//! The child is this executable again (`tmsctl __demo-child`). It reaches the library the way
//! any preloaded program's code would, by symbol: `tms_init`, `tms_region_enter`,
//! `tms_torch_malloc`, `tms_write_bytes`, ... It talks to the parent in lines on stdout
//! (`STARTED <backend>` once allocated, `READY {json}` once the pattern is written, `ERROR
//! <stage> <message>`, `VERIFY ok`, ...) and takes commands on stdin
//! (`verify [OFFSET LENGTH]`, `malloc SIZE`, `fork`, `exit`); the tests drive it the same way.
//! With `--chunk SIZE` its allocation is a chunked one (`tms_set_chunk_size`), whose chunks
//! pause and resume on their own.
//!
//! The parts: the parent ([`parent`]: the command, its checks and report) with the table it
//! prints ([`table`]), where it finds the library ([`library`]) and how it runs the child and
//! reads its lines ([`spawn`]); the child ([`child`]) and the library's entry points as it calls
//! them ([`api`]).

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use tms_units::parse_bytes;

mod api;
mod child;
mod library;
mod parent;
mod spawn;
mod table;

pub use child::child;
pub use parent::run;

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
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_size, allow_negative_numbers = true)]
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
    /// The pid of the `tmsctl demo` that started it: the child ends with it.
    #[arg(long)]
    parent: Option<i32>,
}
