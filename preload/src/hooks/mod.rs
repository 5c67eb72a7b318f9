//! The interposed CUDA and HIP runtime entry points and PyTorch's pluggable-allocator entry
//! points.

mod interpose;

pub use interpose::{cudaFree, cudaMalloc, hipFree, hipMalloc, tms_torch_free, tms_torch_malloc};
