//! The interposed CUDA and HIP runtime entry points, PyTorch's pluggable-allocator entry
//! points, and the interposed NCCL entry points (`nccl.rs`).

mod interpose;
mod nccl;

pub use interpose::{cudaFree, cudaMalloc, hipFree, hipMalloc, tms_torch_free, tms_torch_malloc};
pub use nccl::{
    ncclCommAbort, ncclCommDeregister, ncclCommDestroy, ncclCommFinalize, ncclCommGrow,
    ncclCommInitAll, ncclCommInitRank, ncclCommInitRankConfig, ncclCommInitRankScalable,
    ncclCommRegister, ncclCommShrink, ncclCommSplit, ncclCommWindowDeregister,
    ncclCommWindowRegister, ncclMemAlloc, NcclUniqueId,
};
