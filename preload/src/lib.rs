//! Torch Memory Saver: GPU allocations that can hand their physical memory back and get it
//! again later at the same virtual address, optionally keeping their contents in host memory.
//!
//! Layers (dependencies point down only):
//! - [`hooks`] and [`ffi`]: the `cudaMalloc`/`cudaFree` interposers, PyTorch's pluggable-allocator
//!   entry points and the C ABI of the Python shim; they own the one process-wide [`Runtime`].
//! - [`engine`]: registry of allocations, tags, pause/resume, host backups, statistics.
//! - [`control`]: the control socket server (started lazily) that `tmsctl` talks to.
//! - [`driver`]: the device primitives as a trait, with the CUDA and simulated implementations.

pub mod backup;
pub mod control;
pub mod driver;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod hooks;
pub mod os;
pub mod threads;
pub mod units;

pub use engine::{AllocRequest, Backup, Engine};
pub use error::{Error, Result};
pub use hooks::runtime::Runtime;
