//! The C ABI of NCCL's communicators as the tag `nccl` (Note [NCCL communicators as a tag]):
//! handing over communicators the library cannot see being made, and the two settings.

use std::ffi::{c_char, c_int};

use super::args::{arg_str, array_len};
use super::status::{entry, write_out};
use crate::control;
use crate::engine::Registered;
use crate::error::Error;
use crate::nccl::communicators;
use crate::process::runtime;

/// Hand over the NCCL communicators at `comms` (`n` of them, `ncclComm_t` values): those the
/// library cannot see being made (torch mode, where PyTorch loaded NCCL before the library; NCCL
/// opened by the program through a handle of its own). They replace those handed over before
/// (`n` = 0 hands over none); communicators seen being made (preload mode) stay. Each must stay
/// alive until handed over no more, or this is called again without it: the library suspends
/// and resumes them with the tag `"nccl"`.
///
/// # Safety
/// `comms` is readable for `n` entries (or `n` is 0).
#[no_mangle]
pub unsafe extern "C" fn tms_nccl_adopt(comms: *const u64, n: usize) -> c_int {
    entry(|| {
        if runtime::forked() {
            return Err(Error::invalid_state(
                "torch-memory-saver is disabled in this process: it was forked from one that used it",
            ));
        }
        let list: Vec<usize> = match array_len::<u64>(comms.is_null(), n as u64, "comms")? {
            None => Vec::new(),
            // SAFETY: the caller vouches for n readable entries; array_len checked the pointer
            // and that their bytes fit isize.
            Some(n) => unsafe { std::slice::from_raw_parts(comms, n) }
                .iter()
                .map(|&c| c as usize)
                .collect(),
        };
        // A value that points at no memory would end the process in NCCL's first call on it.
        if let Some(&bad) = list.iter().find(|&&c| c != 0 && !crate::os::readable(c, 8)) {
            return Err(Error::invalid_argument(format!(
                "{bad:#x} is not an NCCL communicator (no memory there): hand over ncclComm_t \
                 values of live communicators; nothing was handed over"
            )));
        }
        communicators().adopt(&list);
        Ok(())
    })
}

/// Whether pauses and resumes of every tag (`tms_pause(NULL)`, `tms_resume(NULL)`) include
/// NCCL's communicators (`on != 0`; off by default, or as `TMS_NCCL_IN_ALL` says): the program
/// must not use a suspended communicator.
#[no_mangle]
pub extern "C" fn tms_nccl_set_in_all(on: c_int) -> c_int {
    entry(|| {
        control::runtime()?.engine.set_nccl_in_all(on != 0);
        Ok(())
    })
}

/// Whether pauses and resumes of every tag include NCCL's communicators, into `*out` (0 or 1).
///
/// # Safety
/// `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn tms_nccl_get_in_all(out: *mut c_int) -> c_int {
    entry(|| {
        if out.is_null() {
            return Err(Error::invalid_argument("out is NULL"));
        }
        let v = control::runtime()?.engine.nccl_in_all();
        // SAFETY: non-null, caller vouches it is writable.
        unsafe { *out = c_int::from(v) };
        Ok(())
    })
}

/// What a pause does with an allocation holding a buffer NCCL registered
/// (`ncclCommRegister`, `ncclCommWindowRegister`): `"keep"` (the default, or as
/// `TMS_NCCL_REGISTERED` says) leaves it mapped until it is deregistered; `"refuse"` fails the
/// pause before it changes anything, naming the buffer.
///
/// # Safety
/// `policy` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tms_nccl_set_registered(policy: *const c_char) -> c_int {
    entry(|| {
        // SAFETY: `policy` is a NUL-terminated string valid for this call (our callers'
        // promise), as arg_str needs.
        let p = Registered::parse(unsafe { arg_str(policy, "policy") }?)?;
        control::runtime()?.engine.set_registered_policy(p);
        Ok(())
    })
}

/// What a pause does with an allocation holding a buffer NCCL registered (`"keep"` or
/// `"refuse"`), into `buf`.
///
/// # Safety
/// `buf` writable for `cap` bytes or NULL; `out_len` writable or NULL.
#[no_mangle]
pub unsafe extern "C" fn tms_nccl_get_registered(
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> c_int {
    entry(|| {
        let p = control::runtime()?.engine.registered_policy();
        // SAFETY: `buf` is NULL or writable for `cap` bytes and `out_len` NULL or writable (our
        // callers' promise), as write_out needs.
        unsafe { write_out(p.as_str(), buf, cap, out_len) }
    })
}
