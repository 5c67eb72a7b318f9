//! NCCL's communicators and registered buffers: what the library knows of them, and the
//! process-wide [`Communicators`] the engine pauses as the reserved tag.
//!
//! # Note [NCCL communicators as a tag]
//!
//! *What it is for.* NCCL holds 0.5–1 GiB per GPU for a serving job's communicators and several
//! GiB per rank in training; NCCL ≥ 2.29.7 can give the bulk of it back
//! (`ncclCommSuspend(comm, NCCL_SUSPEND_MEM)`, `ncclCommResume`, numbers from
//! `ncclCommMemStats`). The engine offers every live communicator as the tag `nccl`
//! (`engine/comms.rs`): `pause("nccl")` suspends them, `resume("nccl")` brings them back, from the
//! C ABI, Python and tmsctl alike; a pause of every tag includes them only where the program
//! asked (`TMS_NCCL_IN_ALL=1`), since it must not use a suspended communicator.
//!
//! *How the library learns of them.* Preloaded, libtms.so interposes the calls that make and end
//! communicators (`hooks/nccl.rs`: `ncclCommInitRank`, `…Config`, `…All`, `…Scalable`,
//! `ncclCommSplit`, `ncclCommShrink`, `ncclCommGrow`; `ncclCommDestroy`, `ncclCommAbort`,
//! `ncclCommFinalize`), each handing the call to NCCL's own (found when first called:
//! `library.rs`) and then noting what it made or ended. The registry is weak: a communicator
//! ended leaves it (after any call of ours on it returns), with its registrations; nothing is
//! kept alive. Where the library cannot see them being made (torch mode, where PyTorch loads
//! libtms.so after NCCL; or NCCL opened by the program through a handle of its own, as pynccl
//! wrappers do), the program hands them over (`tms_nccl_adopt`; the Python package does so
//! from PyTorch's process groups before each pause, resume or `stats()` that involves them),
//! each handing-over replacing the last.
//!
//! *All or nothing.* A pause suspends the communicators one by one in the order the process
//! made them (NCCL's suspend and resume wait for the communicator's other ranks, so every rank
//! must go in the same order); when one fails, those this call suspended are resumed before the
//! error is raised, and one that cannot be is named and stays suspended (the next resume
//! retries it). A resume is the same, undone by suspending again. It runs as a transaction of
//! the engine (the operations lock), so it never overlaps a pause or resume of memory. Where
//! the NCCL loaded lacks the calls, the tag says so with the version found
//! (`NCCL 2.21.5 has no ncclCommSuspend (needs ≥ 2.29.7)`), a pause of the tag fails with
//! that, and nothing else changes. Every rank has to pause the tag
//! (`distributed.pause("nccl", group=gloo_group)` does); a failure on one rank only can leave
//! the others waiting inside NCCL, which the library cannot undo from one process.
//!
//! *Registered buffers.* NCCL's user-buffer registration (`ncclCommRegister`,
//! `ncclCommWindowRegister`) holds the buffer's physical memory (and shares it with peers, or
//! registers it with the network), so a pause that maps new memory at the same address leaves
//! NCCL on the old memory: wrong results, hangs, "Bad address". The interposers note each
//! registration's address range until it is deregistered (or its communicator ends); a pause of
//! memory leaves an allocation holding one mapped (`Registered::Keep`, the default: it never
//! breaks the program, and costs only that allocation's memory), or, with
//! `TMS_NCCL_REGISTERED=refuse`, fails before changing anything, naming the buffer, its
//! allocation and tag, and the two remedies. Graph registration (`NCCL_GRAPH_REGISTER`, on by
//! default) happens inside NCCL while a collective is captured into a CUDA graph, through no
//! entry point the library can interpose: those buffers are not known here. Run captures of
//! collectives over pauseable memory with `NCCL_GRAPH_REGISTER=0`, or keep those buffers
//! resident (`keep_resident`).
//!
//! *NCCL's own memory.* While NCCL makes a communicator, allocates with `ncclMemAlloc` (memory
//! meant for registration), or suspends or resumes one for the library, the thread's
//! `cudaMalloc` and `cudaFree` calls pass through to the CUDA runtime even inside a region: that
//! memory is NCCL's, given back by suspending its tag, and never pauseable (moving it would
//! break NCCL as a registered buffer does).
//!
//! *Harm.* An interposer never panics across the boundary and never waits, except that
//! destroying or finalizing a communicator waits for a call of ours on that very communicator
//! (an abort does not: it may be what ends that call); it looks nothing up until
//! NCCL is used, and a process that never uses NCCL pays nothing. Where no NCCL below the
//! library has an interposed call, the call returns `ncclSystemError` and says why once on
//! stderr.

pub mod library;
mod registry;

use std::sync::{Arc, OnceLock};

pub use registry::Communicators;

/// The process's communicators (the registry starts empty, and nothing is looked up until
/// NCCL is used).
pub fn communicators() -> &'static Arc<Communicators> {
    static ALL: OnceLock<Arc<Communicators>> = OnceLock::new();
    ALL.get_or_init(|| Arc::new(Communicators::new(Box::new(library::Loaded))))
}
