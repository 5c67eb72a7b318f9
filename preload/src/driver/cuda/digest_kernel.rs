//! [`Driver::digest`](crate::driver::Driver::digest) on CUDA: a kernel the library carries as
//! PTX text, JIT-compiled by the driver on first use in each device's primary context, so no
//! compiler or CUDA runtime is needed where the library runs and any GPU the driver knows can
//! run it. It computes the partial sums of `driver/digest.rs` bit for bit; the host combines
//! them per piece.
//!
//! One CUDA block per block of a piece ([`BLOCK_BYTES`]): global block `g` is block
//! `g % per_piece` of piece `g / per_piece`, so the last piece's blocks simply end the grid.
//! Launches cover at most [`LAUNCH_BLOCKS`] blocks each, so one small scratch buffer per device,
//! allocated once and never freed (a free could wait for the whole device), holds the partial
//! sums of every launch; each launch's sums are copied back on the same stream before the
//! next launch overwrites them.

use std::ffi::{c_char, c_void, CStr, CString};

use cudarc::driver::sys;

use super::{cu, CudaDriver};
use crate::driver::digest::{self, Digest, BLOCK_BYTES, THREADS};
use crate::driver::{DevPtr, Stream};
use crate::error::{Error, Result};

// The PTX spells these out: 262144-byte blocks (a shift by 18), 256 threads in 8 warps.
const _: () = assert!(BLOCK_BYTES == 1 << 18 && THREADS == 256);

/// The kernel (`tms_digest`). Its parameters, all `.u64`: the range's address and length, the
/// piece length, blocks per piece, the global index of the launch's first block, the seed, and
/// where the launch's block `i` writes its two sums (`out + 16·i`).
///
/// Thread `t` folds words `t`, `t + 256`, ... of its block, eight loads in flight before they
/// are folded in order; a thread past the end of a short block folds nothing and still adds
/// its term, as `digest::block_partial` does. PTX 7.0 for sm_52 and up, so every driver since
/// CUDA 11 JIT-compiles it for its GPU. ptxas (12.9 and 13.5) gives it 32 registers on sm_90
/// (a full 2048 threads per SM), 34 on sm_80, and no spills; `TMS_PTXAS=path/to/ptxas cargo
/// test ptxas` checks it (CI has no ptxas).
pub(super) const PTX: &str = r#".version 7.0
.target sm_52
.address_size 64

.visible .entry tms_digest(
	.param .u64 src,
	.param .u64 len,
	.param .u64 piece,
	.param .u64 per_piece,
	.param .u64 first,
	.param .u64 seed,
	.param .u64 out
)
.maxntid 256, 1, 1
{
	.reg .pred %done;
	.reg .b32 %th, %lane, %lo, %hi, %lo2, %hi2, %off;
	.reg .b64 %src, %len, %piece, %bpp, %g, %p, %q, %start, %end, %pend;
	.reg .b64 %t, %a, %stop, %h0, %h1, %m1, %m2, %x, %y, %out;
	.reg .b64 %w<8>;
	.shared .align 16 .b64 warps[16];

	ld.param.u64 %src, [src];
	ld.param.u64 %len, [len];
	ld.param.u64 %piece, [piece];
	ld.param.u64 %bpp, [per_piece];
	ld.param.u64 %g, [first];
	ld.param.u64 %x, [seed];
	cvta.to.global.u64 %src, %src;

	// This is block q of piece p: bytes [start, end) of the range.
	mov.u32 %lo, %ctaid.x;
	cvt.u64.u32 %y, %lo;
	add.u64 %g, %g, %y;
	div.u64 %p, %g, %bpp;
	mul.lo.u64 %y, %p, %bpp;
	sub.u64 %q, %g, %y;
	mul.lo.u64 %pend, %p, %piece;
	shl.b64 %start, %q, 18;
	add.u64 %start, %start, %pend;
	add.u64 %pend, %pend, %piece;
	min.u64 %pend, %pend, %len;
	add.u64 %end, %start, 262144;
	min.u64 %end, %end, %pend;
	max.u64 %end, %end, %start;

	// Thread t's words: at a, then every 2048 bytes while below stop.
	mov.u32 %th, %tid.x;
	cvt.u64.u32 %t, %th;
	shl.b64 %y, %t, 3;
	add.u64 %a, %src, %start;
	add.u64 %a, %a, %y;
	add.u64 %stop, %src, %end;

	// lanes_init(seed); fold: h0 = (h0 ^ w) * P1, h1 = (h1 ^ rotl(w, 32)) * P2.
	mov.b64 %m1, 0x9E3779B97F4A7C15;
	mov.b64 %m2, 0xC2B2AE3D27D4EB4F;
	xor.b64 %h0, %x, %m1;
	not.b64 %h1, %x;

EIGHT:
	add.u64 %y, %a, 14336;
	setp.ge.u64 %done, %y, %stop;
	@%done bra ONE;
	ld.global.nc.u64 %w0, [%a];
	ld.global.nc.u64 %w1, [%a+2048];
	ld.global.nc.u64 %w2, [%a+4096];
	ld.global.nc.u64 %w3, [%a+6144];
	ld.global.nc.u64 %w4, [%a+8192];
	ld.global.nc.u64 %w5, [%a+10240];
	ld.global.nc.u64 %w6, [%a+12288];
	ld.global.nc.u64 %w7, [%a+14336];
	xor.b64 %h0, %h0, %w0; mul.lo.u64 %h0, %h0, %m1;
	mov.b64 {%lo, %hi}, %w0; mov.b64 %y, {%hi, %lo}; xor.b64 %h1, %h1, %y; mul.lo.u64 %h1, %h1, %m2;
	xor.b64 %h0, %h0, %w1; mul.lo.u64 %h0, %h0, %m1;
	mov.b64 {%lo, %hi}, %w1; mov.b64 %y, {%hi, %lo}; xor.b64 %h1, %h1, %y; mul.lo.u64 %h1, %h1, %m2;
	xor.b64 %h0, %h0, %w2; mul.lo.u64 %h0, %h0, %m1;
	mov.b64 {%lo, %hi}, %w2; mov.b64 %y, {%hi, %lo}; xor.b64 %h1, %h1, %y; mul.lo.u64 %h1, %h1, %m2;
	xor.b64 %h0, %h0, %w3; mul.lo.u64 %h0, %h0, %m1;
	mov.b64 {%lo, %hi}, %w3; mov.b64 %y, {%hi, %lo}; xor.b64 %h1, %h1, %y; mul.lo.u64 %h1, %h1, %m2;
	xor.b64 %h0, %h0, %w4; mul.lo.u64 %h0, %h0, %m1;
	mov.b64 {%lo, %hi}, %w4; mov.b64 %y, {%hi, %lo}; xor.b64 %h1, %h1, %y; mul.lo.u64 %h1, %h1, %m2;
	xor.b64 %h0, %h0, %w5; mul.lo.u64 %h0, %h0, %m1;
	mov.b64 {%lo, %hi}, %w5; mov.b64 %y, {%hi, %lo}; xor.b64 %h1, %h1, %y; mul.lo.u64 %h1, %h1, %m2;
	xor.b64 %h0, %h0, %w6; mul.lo.u64 %h0, %h0, %m1;
	mov.b64 {%lo, %hi}, %w6; mov.b64 %y, {%hi, %lo}; xor.b64 %h1, %h1, %y; mul.lo.u64 %h1, %h1, %m2;
	xor.b64 %h0, %h0, %w7; mul.lo.u64 %h0, %h0, %m1;
	mov.b64 {%lo, %hi}, %w7; mov.b64 %y, {%hi, %lo}; xor.b64 %h1, %h1, %y; mul.lo.u64 %h1, %h1, %m2;
	add.u64 %a, %a, 16384;
	bra EIGHT;

ONE:
	setp.ge.u64 %done, %a, %stop;
	@%done bra TERM;
	ld.global.nc.u64 %w0, [%a];
	xor.b64 %h0, %h0, %w0; mul.lo.u64 %h0, %h0, %m1;
	mov.b64 {%lo, %hi}, %w0; mov.b64 %y, {%hi, %lo}; xor.b64 %h1, %h1, %y; mul.lo.u64 %h1, %h1, %m2;
	add.u64 %a, %a, 2048;
	bra ONE;

	// thread_term: fmix64(h0 + t * P2), fmix64(h1 ^ t * P1).
TERM:
	mul.lo.u64 %y, %t, %m2;
	add.u64 %h0, %h0, %y;
	mul.lo.u64 %y, %t, %m1;
	xor.b64 %h1, %h1, %y;
	shr.b64 %y, %h0, 33; xor.b64 %h0, %h0, %y; mul.lo.u64 %h0, %h0, 0xFF51AFD7ED558CCD;
	shr.b64 %y, %h0, 33; xor.b64 %h0, %h0, %y; mul.lo.u64 %h0, %h0, 0xC4CEB9FE1A85EC53;
	shr.b64 %y, %h0, 33; xor.b64 %h0, %h0, %y;
	shr.b64 %y, %h1, 33; xor.b64 %h1, %h1, %y; mul.lo.u64 %h1, %h1, 0xFF51AFD7ED558CCD;
	shr.b64 %y, %h1, 33; xor.b64 %h1, %h1, %y; mul.lo.u64 %h1, %h1, 0xC4CEB9FE1A85EC53;
	shr.b64 %y, %h1, 33; xor.b64 %h1, %h1, %y;

	// Sum over the warp (lane 0 ends with it), then over the block's eight warps.
	mov.u32 %off, 16;
SHUFFLE:
	mov.b64 {%lo, %hi}, %h0;
	shfl.sync.down.b32 %lo2, %lo, %off, 31, -1;
	shfl.sync.down.b32 %hi2, %hi, %off, 31, -1;
	mov.b64 %y, {%lo2, %hi2};
	add.u64 %h0, %h0, %y;
	mov.b64 {%lo, %hi}, %h1;
	shfl.sync.down.b32 %lo2, %lo, %off, 31, -1;
	shfl.sync.down.b32 %hi2, %hi, %off, 31, -1;
	mov.b64 %y, {%lo2, %hi2};
	add.u64 %h1, %h1, %y;
	shr.u32 %off, %off, 1;
	setp.ne.u32 %done, %off, 0;
	@%done bra SHUFFLE;
	and.b32 %lane, %th, 31;
	setp.ne.u32 %done, %lane, 0;
	@%done bra STORED;
	shr.u32 %lo, %th, 5;
	mul.wide.u32 %y, %lo, 16;
	mov.u64 %x, warps;
	add.u64 %x, %x, %y;
	st.shared.u64 [%x], %h0;
	st.shared.u64 [%x+8], %h1;
STORED:
	bar.sync 0;
	setp.ne.u32 %done, %th, 0;
	@%done bra END;
	mov.u64 %x, warps;
	add.u64 %stop, %x, 128;
	mov.u64 %h0, 0;
	mov.u64 %h1, 0;
WARPS:
	ld.shared.u64 %y, [%x];
	add.u64 %h0, %h0, %y;
	ld.shared.u64 %y, [%x+8];
	add.u64 %h1, %h1, %y;
	add.u64 %x, %x, 16;
	setp.lt.u64 %done, %x, %stop;
	@%done bra WARPS;
	ld.param.u64 %out, [out];
	cvta.to.global.u64 %out, %out;
	mov.u32 %lo, %ctaid.x;
	mul.wide.u32 %y, %lo, 16;
	add.u64 %out, %out, %y;
	st.global.u64 [%out], %h0;
	st.global.u64 [%out+8], %h1;
END:
	ret;
}
"#;

/// The kernel's entry point in [`PTX`].
pub(super) const ENTRY: &CStr = c"tms_digest";

/// The kernel's parameters, in order (each a `.u64`).
pub(super) const PARAMS: [&str; 7] = ["src", "len", "piece", "per_piece", "first", "seed", "out"];

/// Blocks one launch digests at most: its partial sums fill [`SCRATCH_BYTES`].
pub(super) const LAUNCH_BLOCKS: u64 = 1 << 16;

/// The device buffer the partial sums of one launch land in.
const SCRATCH_BYTES: u64 = LAUNCH_BLOCKS * 16;

/// How a range is cut: pieces, blocks per (full) piece, and blocks in all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    pub len: u64,
    pub piece: u64,
    pub pieces: u64,
    pub per_piece: u64,
    pub blocks: u64,
}

impl Plan {
    /// The cut of `len` bytes at `ptr` into pieces of `piece` bytes, or why the arguments
    /// cannot be right.
    pub fn new(ptr: DevPtr, len: u64, piece: u64) -> Result<Plan> {
        if piece == 0
            || !piece.is_multiple_of(8)
            || !len.is_multiple_of(8)
            || !ptr.is_multiple_of(8)
        {
            return Err(Error::invalid_argument(format!(
                "digest of {len} bytes at {ptr:#x} in pieces of {piece} bytes: the address, \
                 the length and the piece length must be multiples of 8, the piece length \
                 not 0"
            )));
        }
        if ptr.checked_add(len).is_none() {
            return Err(Error::invalid_argument(format!(
                "digest of {len} bytes at {ptr:#x}: the range passes the end of the address space"
            )));
        }
        let pieces = len.div_ceil(piece);
        let per_piece = digest::blocks(piece);
        let blocks = match pieces {
            0 => 0,
            n => (n - 1) * per_piece + digest::blocks(len - (n - 1) * piece),
        };
        Ok(Plan {
            len,
            piece,
            pieces,
            per_piece,
            blocks,
        })
    }

    /// The pieces' digests from the blocks' partial sums (two words per block, in order).
    pub fn combine(&self, sums: &[u64]) -> Vec<Digest> {
        let blocks: Vec<Digest> = sums.chunks_exact(2).map(|s| [s[0], s[1]]).collect();
        (0..self.pieces)
            .map(|p| {
                let first = (p * self.per_piece) as usize;
                let last = (first + self.per_piece as usize).min(blocks.len());
                let len = self.piece.min(self.len - p * self.piece);
                digest::combine(&blocks[first..last], len)
            })
            .collect()
    }
}

/// The kernel loaded in one device's primary context, and its scratch buffer.
#[derive(Clone, Copy)]
struct Loaded {
    function: usize,
    scratch: sys::CUdeviceptr,
}

/// Per device, what was made on first use: the kernel (or the failure that keeps it from
/// loading, kept: a JIT error does not go away) and the scratch buffer. Neither is ever given
/// back; the context keeps them for the process's life.
#[derive(Default)]
pub(super) struct Slot {
    function: Option<usize>,
    failed: Option<Error>,
    scratch: Option<sys::CUdeviceptr>,
}

impl CudaDriver {
    /// [`Driver::digest`](crate::driver::Driver::digest).
    pub(super) fn digest_pieces(
        &self,
        device: i32,
        ptr: DevPtr,
        len: u64,
        piece: u64,
        seed: u64,
        stream: Stream,
    ) -> Result<Vec<Digest>> {
        let plan = Plan::new(ptr, len, piece)?;
        let i = self.check_device(device)?;
        if plan.blocks == 0 {
            return Ok(Vec::new());
        }
        let words = (plan.blocks * 2) as usize;
        let mut sums: Vec<u64> = Vec::new();
        sums.try_reserve_exact(words).map_err(|_| {
            Error::out_of_memory(format!(
                "host memory for the partial sums of {} blocks",
                plan.blocks
            ))
        })?;
        sums.resize(words, 0);
        let _scope = crate::driver::DeviceScope::enter(self, device)?;
        // Held until the copies are done: the device has one scratch buffer.
        let mut slot = self.digests[i].lock();
        let k = self.loaded(&mut slot, device)?;
        let queued = self.queue_launches(k, &plan, ptr, seed, stream, &mut sums);
        let synced = cu(
            "cuStreamSynchronize",
            // SAFETY: the caller's stream, of this device (the trait's contract); the call only
            // waits.
            unsafe { sys::cuStreamSynchronize(stream.0 as sys::CUstream) },
            || {
                format!(
                    "stream {:#x} after digesting {len} bytes at {ptr:#x}",
                    stream.0
                )
            },
        );
        let synced_ok = synced.is_ok();
        match queued.and(synced) {
            Ok(()) => Ok(plan.combine(&sums)),
            Err(e) => {
                if !synced_ok {
                    // A copy into `sums` may still be queued: leak it rather than free it
                    // under one.
                    std::mem::forget(sums);
                }
                Err(e)
            }
        }
    }

    /// Queue every launch and the copy of its sums into `sums` (two words per block).
    fn queue_launches(
        &self,
        k: Loaded,
        plan: &Plan,
        ptr: DevPtr,
        seed: u64,
        stream: Stream,
        sums: &mut [u64],
    ) -> Result<()> {
        let mut first = 0;
        while first < plan.blocks {
            let n = (plan.blocks - first).min(LAUNCH_BLOCKS);
            let mut args: [u64; PARAMS.len()] = [
                ptr,
                plan.len,
                plan.piece,
                plan.per_piece,
                first,
                seed,
                k.scratch,
            ];
            let mut params = args.each_mut().map(|a| (a as *mut u64).cast::<c_void>());
            cu(
                "cuLaunchKernel",
                // SAFETY: the function was loaded in this device's context, current now; params
                // points to one pointer per kernel parameter (`PARAMS`, all .u64), each to a u64
                // alive across the call (the driver copies them). The kernel reads
                // [ptr, ptr+len), mapped and accessible by the trait's contract, and writes
                // n·16 bytes of the scratch buffer, which holds LAUNCH_BLOCKS·16 (n is at most
                // that); n fits a grid dimension (at most 2^16).
                unsafe {
                    sys::cuLaunchKernel(
                        k.function as sys::CUfunction,
                        n as u32,
                        1,
                        1,
                        THREADS as u32,
                        1,
                        1,
                        0,
                        stream.0 as sys::CUstream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                },
                || {
                    format!(
                        "digest kernel, blocks {first}..{} of {len} bytes at {ptr:#x} in pieces \
                         of {piece} bytes",
                        first + n,
                        len = plan.len,
                        piece = plan.piece
                    )
                },
            )?;
            let dst = &mut sums[(first * 2) as usize..((first + n) * 2) as usize];
            cu(
                "cuMemcpyDtoHAsync",
                // SAFETY: the scratch buffer holds the n·16 bytes the launch just queued writes;
                // dst is exactly n·16 bytes of host memory that the caller keeps alive and
                // untouched until the stream is synchronized (or leaks, when that fails).
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(
                        dst.as_mut_ptr().cast(),
                        k.scratch,
                        (n * 16) as usize,
                        stream.0 as sys::CUstream,
                    )
                },
                || format!("{} bytes of digest sums", n * 16),
            )?;
            first += n;
        }
        Ok(())
    }

    /// [`Driver::prepare_digest`](crate::driver::Driver::prepare_digest): the kernel and
    /// scratch buffer made now, if they are not yet.
    pub(super) fn prepare_digest_kernel(&self, device: i32) -> Result<()> {
        let i = self.check_device(device)?;
        let _scope = crate::driver::DeviceScope::enter(self, device)?;
        let mut slot = self.digests[i].lock();
        self.loaded(&mut slot, device).map(|_| ())
    }

    /// The kernel and scratch buffer in `device`'s context (current), made on first use.
    fn loaded(&self, slot: &mut Slot, device: i32) -> Result<Loaded> {
        if let Some(e) = &slot.failed {
            return Err(e.duplicate());
        }
        let function = match slot.function {
            Some(f) => f,
            None => match load(device) {
                Ok(f) => *slot.function.insert(f),
                Err(e) => {
                    // Out of memory may pass; anything else will fail again the same way.
                    if !e.is_oom() {
                        slot.failed = Some(e.duplicate());
                    }
                    return Err(e);
                }
            },
        };
        let scratch = match slot.scratch {
            Some(s) => s,
            None => {
                let mut s: sys::CUdeviceptr = 0;
                cu(
                    "cuMemAlloc",
                    // SAFETY: a context is current (the caller's scope); &mut s is valid to
                    // write.
                    unsafe { sys::cuMemAlloc_v2(&mut s, SCRATCH_BYTES as usize) },
                    || format!("{SCRATCH_BYTES} bytes for digest sums on device {device}"),
                )?;
                *slot.scratch.insert(s)
            }
        };
        Ok(Loaded { function, scratch })
    }
}

/// JIT-compile the kernel in the current context: its function handle.
fn load(device: i32) -> Result<usize> {
    let image =
        CString::new(PTX).map_err(|_| Error::internal("the digest kernel's PTX holds a NUL"))?;
    let mut log = [0u8; 4096];
    let mut options = [
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    // The size travels in the pointer-sized value itself, as the driver API asks.
    let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
    let mut module: sys::CUmodule = std::ptr::null_mut();
    let r = cu(
        "cuModuleLoadDataEx",
        // SAFETY: a context is current (the caller's scope); image is NUL-terminated PTX text
        // alive across the call; options and values hold two entries each, the log buffer
        // being log.len() bytes that outlive the call; &mut module is valid to write.
        unsafe {
            sys::cuModuleLoadDataEx(
                &mut module,
                image.as_ptr().cast(),
                options.len() as u32,
                options.as_mut_ptr(),
                values.as_mut_ptr(),
            )
        },
        || format!("JIT-compiling the digest kernel for device {device}"),
    );
    if let Err(e) = r {
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        let text = String::from_utf8_lossy(&log[..end]);
        let text = text.trim();
        return Err(if text.is_empty() {
            e
        } else {
            e.note(format!("JIT log: {text}"))
        });
    }
    let mut function: sys::CUfunction = std::ptr::null_mut();
    cu(
        "cuModuleGetFunction",
        // SAFETY: module was just loaded and is never unloaded; ENTRY is a NUL-terminated name;
        // &mut function is valid to write.
        unsafe { sys::cuModuleGetFunction(&mut function, module, ENTRY.as_ptr() as *const c_char) },
        || format!("the digest kernel on device {device}"),
    )?;
    Ok(function as usize)
}

#[cfg(test)]
mod tests;
