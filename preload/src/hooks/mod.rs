//! The interposed CUDA runtime entry points and PyTorch's pluggable-allocator entry points.

mod interpose;

pub use interpose::{cudaFree, cudaMalloc, tms_torch_free, tms_torch_malloc};
