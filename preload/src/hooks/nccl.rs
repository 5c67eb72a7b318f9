//! NCCL interposers (preload mode): the calls that make and end communicators and register
//! buffers, each handed to NCCL's own and then noted in the process's registry (Note [NCCL
//! communicators as a tag] in `nccl/mod.rs`).
//!
//! Each finds NCCL's definition when first called (`nccl/library.rs`); where there is none it
//! returns `ncclSystemError` and says so once on stderr. The noting runs after NCCL's call,
//! inside `catch`: a bug of ours is logged and the program gets NCCL's answer all the same.
//! While NCCL makes a communicator or runs `ncclMemAlloc`, the thread counts as inside the
//! library, so NCCL's own `cudaMalloc` calls pass through to the CUDA runtime.

use std::ffi::{c_char, c_int, c_void};

use super::interpose::Reentry;
use crate::nccl::library::{symbol, NCCL_IN_PROGRESS, NCCL_SUCCESS, NCCL_SYSTEM_ERROR};
use crate::nccl::{communicators, Communicators};
use crate::process::boundary::catch;
use crate::process::runtime;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NcclUniqueId {
    /// NCCL's bytes.
    pub internal: [c_char; 128],
}

type InitRankFn = unsafe extern "C" fn(*mut *mut c_void, c_int, NcclUniqueId, c_int) -> c_int;
type InitRankConfigFn =
    unsafe extern "C" fn(*mut *mut c_void, c_int, NcclUniqueId, c_int, *mut c_void) -> c_int;
type InitAllFn = unsafe extern "C" fn(*mut *mut c_void, c_int, *const c_int) -> c_int;
type InitScalableFn = unsafe extern "C" fn(
    *mut *mut c_void,
    c_int,
    c_int,
    c_int,
    *mut NcclUniqueId,
    *mut c_void,
) -> c_int;
type SplitFn =
    unsafe extern "C" fn(*mut c_void, c_int, c_int, *mut *mut c_void, *mut c_void) -> c_int;
type ShrinkFn = unsafe extern "C" fn(
    *mut c_void,
    *mut c_int,
    c_int,
    *mut *mut c_void,
    *mut c_void,
    c_int,
) -> c_int;
type GrowFn = unsafe extern "C" fn(
    *mut c_void,
    c_int,
    *const NcclUniqueId,
    c_int,
    *mut *mut c_void,
    *mut c_void,
) -> c_int;
type CommFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type RegisterFn = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *mut *mut c_void) -> c_int;
type DeregisterFn = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
type WindowRegisterFn =
    unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *mut *mut c_void, c_int) -> c_int;
type MemAllocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;

/// Declares `fn $f() -> Option<$ty>`: NCCL's entry point `$name`, found once. `$ty` must be
/// its signature in nccl.h.
macro_rules! entry_point {
    ($f:ident, $name:literal, $ty:ty) => {
        fn $f() -> Option<$ty> {
            static SLOT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
            match symbol($name, &SLOT) {
                0 => None,
                // SAFETY: NCCL's entry point of this name has this signature (nccl.h).
                p => Some(unsafe { std::mem::transmute::<usize, $ty>(p) }),
            }
        }
    };
}

entry_point!(real_init_rank, c"ncclCommInitRank", InitRankFn);
entry_point!(
    real_init_rank_config,
    c"ncclCommInitRankConfig",
    InitRankConfigFn
);
entry_point!(real_init_all, c"ncclCommInitAll", InitAllFn);
entry_point!(
    real_init_scalable,
    c"ncclCommInitRankScalable",
    InitScalableFn
);
entry_point!(real_split, c"ncclCommSplit", SplitFn);
entry_point!(real_shrink, c"ncclCommShrink", ShrinkFn);
entry_point!(real_grow, c"ncclCommGrow", GrowFn);
entry_point!(real_finalize, c"ncclCommFinalize", CommFn);
entry_point!(real_destroy, c"ncclCommDestroy", CommFn);
entry_point!(real_abort, c"ncclCommAbort", CommFn);
entry_point!(real_register, c"ncclCommRegister", RegisterFn);
entry_point!(real_deregister, c"ncclCommDeregister", DeregisterFn);
entry_point!(
    real_window_register,
    c"ncclCommWindowRegister",
    WindowRegisterFn
);
entry_point!(
    real_window_deregister,
    c"ncclCommWindowDeregister",
    DeregisterFn
);
entry_point!(real_mem_alloc, c"ncclMemAlloc", MemAllocFn);

/// What an interposer returns where no NCCL below it has `name`: said once for each name.
fn absent(name: &'static str) -> c_int {
    static SAID: parking_lot::Mutex<Vec<&'static str>> = parking_lot::Mutex::new(Vec::new());
    let first = {
        let mut said = SAID.lock();
        let first = !said.contains(&name);
        if first {
            said.push(name);
        }
        first
    };
    if first {
        crate::process::logging::say(&format!(
            "torch-memory-saver: no NCCL library below it provides {name}"
        ));
    }
    NCCL_SYSTEM_ERROR
}

/// Note something in the registry: never in a fork child (its handles are the parent's), and
/// never a panic across the boundary.
fn note(f: impl FnOnce(&Communicators)) {
    if !runtime::forked() {
        catch((), || f(communicators()));
    }
}

/// The `n` communicators NCCL wrote at `out`, where the call made them.
fn made(rc: c_int, out: *mut *mut c_void, n: c_int) {
    if (rc != NCCL_SUCCESS && rc != NCCL_IN_PROGRESS) || out.is_null() {
        return;
    }
    note(|c| {
        for i in 0..n.max(0) as usize {
            // SAFETY: NCCL wrote `n` handles at `out` (its contract for this call).
            c.created(unsafe { *out.add(i) } as usize);
        }
    });
}

/// Run `call`, which makes `n` communicators at `out`, with NCCL's own allocations passing
/// through; then note them.
fn making(out: *mut *mut c_void, n: c_int, call: impl FnOnce() -> c_int) -> c_int {
    let own = Reentry::enter();
    let rc = call();
    drop(own);
    made(rc, out, n);
    rc
}

/// `comm` ends through `f`: it leaves the registry (once no call of ours on it runs) before
/// NCCL ends it.
fn ending(comm: *mut c_void, f: CommFn) -> c_int {
    note(|c| c.gone(comm as usize));
    // SAFETY: `f` is NCCL's call of this interposer's name, given the caller's argument.
    unsafe { f(comm) }
}

/// Interposed `ncclCommInitRank`.
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut c_void,
    nranks: c_int,
    comm_id: NcclUniqueId,
    rank: c_int,
) -> c_int {
    let Some(f) = real_init_rank() else {
        return absent("ncclCommInitRank");
    };
    // SAFETY: the caller's arguments, handed on as they came.
    making(comm, 1, || unsafe { f(comm, nranks, comm_id, rank) })
}

/// Interposed `ncclCommInitRankConfig`.
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut *mut c_void,
    nranks: c_int,
    comm_id: NcclUniqueId,
    rank: c_int,
    config: *mut c_void,
) -> c_int {
    let Some(f) = real_init_rank_config() else {
        return absent("ncclCommInitRankConfig");
    };
    // SAFETY: the caller's arguments, handed on as they came.
    making(comm, 1, || unsafe {
        f(comm, nranks, comm_id, rank, config)
    })
}

/// Interposed `ncclCommInitAll`.
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitAll(
    comm: *mut *mut c_void,
    ndev: c_int,
    devlist: *const c_int,
) -> c_int {
    let Some(f) = real_init_all() else {
        return absent("ncclCommInitAll");
    };
    // SAFETY: the caller's arguments, handed on as they came.
    making(comm, ndev, || unsafe { f(comm, ndev, devlist) })
}

/// Interposed `ncclCommInitRankScalable`.
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    newcomm: *mut *mut c_void,
    nranks: c_int,
    myrank: c_int,
    n_id: c_int,
    comm_ids: *mut NcclUniqueId,
    config: *mut c_void,
) -> c_int {
    let Some(f) = real_init_scalable() else {
        return absent("ncclCommInitRankScalable");
    };
    // SAFETY: the caller's arguments, handed on as they came.
    making(newcomm, 1, || unsafe {
        f(newcomm, nranks, myrank, n_id, comm_ids, config)
    })
}

/// Interposed `ncclCommSplit`.
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    comm: *mut c_void,
    color: c_int,
    key: c_int,
    newcomm: *mut *mut c_void,
    config: *mut c_void,
) -> c_int {
    let Some(f) = real_split() else {
        return absent("ncclCommSplit");
    };
    // SAFETY: the caller's arguments, handed on as they came.
    making(newcomm, 1, || unsafe {
        f(comm, color, key, newcomm, config)
    })
}

/// Interposed `ncclCommShrink`.
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommShrink(
    comm: *mut c_void,
    exclude_ranks_list: *mut c_int,
    exclude_ranks_count: c_int,
    newcomm: *mut *mut c_void,
    config: *mut c_void,
    shrink_flags: c_int,
) -> c_int {
    let Some(f) = real_shrink() else {
        return absent("ncclCommShrink");
    };
    // SAFETY: the caller's arguments, handed on as they came.
    making(newcomm, 1, || unsafe {
        f(
            comm,
            exclude_ranks_list,
            exclude_ranks_count,
            newcomm,
            config,
            shrink_flags,
        )
    })
}

/// Interposed `ncclCommGrow`.
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommGrow(
    comm: *mut c_void,
    n_ranks: c_int,
    unique_id: *const NcclUniqueId,
    rank: c_int,
    newcomm: *mut *mut c_void,
    config: *mut c_void,
) -> c_int {
    let Some(f) = real_grow() else {
        return absent("ncclCommGrow");
    };
    // SAFETY: the caller's arguments, handed on as they came.
    making(newcomm, 1, || unsafe {
        f(comm, n_ranks, unique_id, rank, newcomm, config)
    })
}

/// Interposed `ncclCommFinalize`: the communicator leaves the registry (only its destruction
/// may follow).
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommFinalize(comm: *mut c_void) -> c_int {
    let Some(f) = real_finalize() else {
        return absent("ncclCommFinalize");
    };
    ending(comm, f)
}

/// Interposed `ncclCommDestroy`.
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut c_void) -> c_int {
    let Some(f) = real_destroy() else {
        return absent("ncclCommDestroy");
    };
    ending(comm, f)
}

/// Interposed `ncclCommAbort`: the communicator leaves the registry at once, without waiting
/// for a call of ours on it (the abort may be what ends that call).
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut c_void) -> c_int {
    let Some(f) = real_abort() else {
        return absent("ncclCommAbort");
    };
    note(|c| c.aborted(comm as usize));
    // SAFETY: `f` is NCCL's ncclCommAbort, given the caller's argument.
    unsafe { f(comm) }
}

/// Run `register`, NCCL's `call` registering `[buff, buff+size)` for `comm` with its handle at
/// `out`; then note the registration.
fn registering(
    call: &'static str,
    comm: *mut c_void,
    (buff, size): (*mut c_void, usize),
    out: *mut *mut c_void,
    register: impl FnOnce() -> c_int,
) -> c_int {
    let rc = register();
    if (rc == NCCL_SUCCESS || rc == NCCL_IN_PROGRESS) && !out.is_null() {
        // SAFETY: NCCL wrote the handle at `out` (non-null, checked).
        let handle = unsafe { *out } as usize;
        if handle != 0 {
            note(|c| c.registered(call, comm as usize, handle, buff as u64, size as u64));
        }
    }
    rc
}

/// Undo the registration `handle` of `comm` through `f` (NCCL's deregistration of its kind);
/// once NCCL has, it is forgotten (where it goes on in the background, once it has ended well).
fn deregistering(comm: *mut c_void, handle: *mut c_void, f: DeregisterFn) -> c_int {
    // SAFETY: `f` is NCCL's call of this interposer's name, given the caller's arguments.
    let rc = unsafe { f(comm, handle) };
    match rc {
        NCCL_SUCCESS => note(|c| c.deregistered(handle as usize)),
        NCCL_IN_PROGRESS => note(|c| c.deregistering(handle as usize)),
        _ => {}
    }
    rc
}

/// Interposed `ncclCommRegister`: the buffer is noted until deregistered, so that pauses keep
/// (or refuse to pause) the allocation holding it.
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommRegister(
    comm: *mut c_void,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> c_int {
    let Some(f) = real_register() else {
        return absent("ncclCommRegister");
    };
    // SAFETY: the caller's arguments, handed on as they came.
    registering("ncclCommRegister", comm, (buff, size), handle, || unsafe {
        f(comm, buff, size, handle)
    })
}

/// Interposed `ncclCommDeregister`.
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommDeregister(comm: *mut c_void, handle: *mut c_void) -> c_int {
    let Some(f) = real_deregister() else {
        return absent("ncclCommDeregister");
    };
    deregistering(comm, handle, f)
}

/// Interposed `ncclCommWindowRegister`: noted as `ncclCommRegister`'s buffers are.
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowRegister(
    comm: *mut c_void,
    buff: *mut c_void,
    size: usize,
    win: *mut *mut c_void,
    win_flags: c_int,
) -> c_int {
    let Some(f) = real_window_register() else {
        return absent("ncclCommWindowRegister");
    };
    // SAFETY: the caller's arguments, handed on as they came.
    registering(
        "ncclCommWindowRegister",
        comm,
        (buff, size),
        win,
        || unsafe { f(comm, buff, size, win, win_flags) },
    )
}

/// Interposed `ncclCommWindowDeregister`.
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowDeregister(comm: *mut c_void, win: *mut c_void) -> c_int {
    let Some(f) = real_window_deregister() else {
        return absent("ncclCommWindowDeregister");
    };
    deregistering(comm, win, f)
}

/// Interposed `ncclMemAlloc`: memory meant for registration is never pauseable (where NCCL
/// falls back to `cudaMalloc`, that call passes through).
///
/// # Safety
/// As NCCL's.
#[no_mangle]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    let Some(f) = real_mem_alloc() else {
        return absent("ncclMemAlloc");
    };
    let _own = Reentry::enter();
    // SAFETY: the caller's arguments, handed on as they came.
    unsafe { f(ptr, size) }
}
