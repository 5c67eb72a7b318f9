//! Torch Memory Saver: GPU allocations that can hand their physical memory back and get it
//! again later at the same virtual address, optionally keeping their contents in host memory.
//!
//! Layers (dependencies point down only; `tests/layers.rs` checks it):
//! - [`hooks`] and [`ffi`]: the `cudaMalloc`/`cudaFree` interposers, PyTorch's pluggable-allocator
//!   entry points and the C ABI of the Python shim.
//! - [`control`]: the control socket server that `tmsctl` talks to. The entry points get the
//!   runtime from [`control::runtime`], which starts the server with it (lazily: never at load
//!   time, never in a process that does not use the library).
//! - [`process`]: the one process-wide [`Runtime`], the settings (the environment's, each
//!   thread's regions), and what every entry point needs at the FFI boundary (panics caught,
//!   the thread's last error).
//! - [`nccl`]: NCCL's communicators and the buffers they registered, which the engine pauses as
//!   the reserved tag `nccl`.
//! - [`engine`]: registry of allocations, tags, pause/resume transactions, statistics.
//! - [`backup`]: where paused contents wait (host buffers, page-locked or not).
//! - [`driver`]: the device primitives as a trait, with the CUDA and simulated implementations.
//! - [`os`]: host memory as the system gives it (mappings, what is available).
//! - [`error`], [`units`], [`threads`]: used by all of the above.

#![deny(clippy::undocumented_unsafe_blocks, unsafe_op_in_unsafe_fn)]

pub mod backup;
pub mod control;
pub mod driver;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod hooks;
pub mod nccl;
pub mod os;
pub mod process;
#[cfg(test)]
mod test_data;
pub mod threads;
pub mod units;

pub use engine::{AllocRequest, Backup, Engine};
pub use error::{Error, Result};
pub use process::runtime::Runtime;
