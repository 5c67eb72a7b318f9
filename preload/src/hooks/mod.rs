//! The process-facing layer: environment settings, per-thread region settings, the one
//! process-wide [`runtime::Runtime`], and the interposed CUDA runtime entry points.

mod interpose;
pub mod runtime;
pub mod settings;

pub use interpose::{cudaFree, cudaMalloc, tms_torch_free, tms_torch_malloc};
