//! Host memory that holds CPU backups and staging slots: anonymous memory, page-locked through
//! the driver chunk by chunk where copies should run straight at link speed (the pinned backend,
//! staging slots), or left pageable (the mmap backend, so the kernel can take the pages back).

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use super::backing::{Backing, Dir, UnitIo};
use super::BackupKind;
use crate::driver::Driver;
use crate::error::{Error, Result};
use crate::os::{mmap_anonymous, mmap_huge, munmap, page_size, HUGE_PAGE};

/// How host buffers are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostLayout {
    /// Unit of page-locking and of direct copies, in bytes (a multiple of the page size).
    pub chunk: u64,
    /// Ask the kernel for transparent huge pages (fewer page faults and a cheaper release).
    pub hugepages: bool,
    /// CPU copies between the buffer and staging slots use stores that go around the caches
    /// (`os::copy_streaming`): the bytes are read next by a device or a later resume.
    pub streaming: bool,
}

impl Default for HostLayout {
    fn default() -> Self {
        HostLayout {
            chunk: 64 << 20,
            hugepages: true,
            streaming: false,
        }
    }
}

/// Chunk states: page-locking is a transition another thread may be in the middle of (the
/// engine's background pinner), so release waits for it instead of racing it.
const UNPINNED: u8 = 0;
const PINNING: u8 = 1;
const PINNED: u8 = 2;
const GONE: u8 = 3;

/// An owned block of anonymous host memory, page-locked chunk by chunk on demand
/// ([`HostBuffer::pin`]), from any thread. Freed on drop: registered chunks are unregistered
/// first; a chunk whose unregistration fails keeps the whole mapping alive (leaked, logged),
/// because the driver may still consider that address range its own.
pub struct HostBuffer {
    ptr: *mut u8,
    len: u64,
    map_len: u64,
    backend: BackupKind,
    chunk: u64,
    /// [`HostLayout::streaming`].
    streaming: bool,
    state: Box<[AtomicU8]>,
    /// Page-locking chunk `i` in the background is still wanted: set when it is queued, cleared
    /// when its pages are given back, so a queued page-locking never brings them back.
    wanted: Box<[AtomicBool]>,
    /// Chunk `i` was saved into since its pages were last handed out ([`Backing::fresh`]).
    written: Box<[AtomicBool]>,
    retired: AtomicBool,
    /// The digests of the pieces it holds (`digests.rs`).
    digests: super::Digests,
    driver: Arc<dyn Driver>,
    /// The device whose context page-locks the memory: the device of the allocation backed up
    /// (or of the staging ring), so a helper thread without a context of its own never creates
    /// one on device 0.
    device: i32,
}

// SAFETY: the buffer exclusively owns its mapping (unmapped in Drop, by whichever thread drops
// it) and nothing in it is tied to a thread: `ptr` is the only field that is not Send, and the
// driver page-locks and unlocks from any thread, in `device`'s context.
unsafe impl Send for HostBuffer {}
// SAFETY: what `&self` methods change is atomics (chunk states, wanted, retired) and the digests
// (behind their own lock), and each chunk's page-locking is claimed by a compare-exchange of its
// state, so two threads never register or unregister the same pages. The bytes are written
// through `&self` only by the pipeline's copy workers of one transaction, each in a unit of its
// own (disjoint bytes; a pause skipping unchanged pieces may give one chunk several units; see
// HostBuffer::base), and by
// copy_from into a buffer nobody else holds yet. A reader holds an Arc of its own, and a pause
// writes into a retained buffer only while the registry's Arc is the only one.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocate `len` bytes (> 0) of pageable memory; nothing is page-locked yet and no page is
    /// touched, so this is cheap at any size. Contents read as zero until written.
    pub fn new(
        driver: Arc<dyn Driver>,
        device: i32,
        backend: BackupKind,
        len: u64,
        layout: HostLayout,
    ) -> Result<Self> {
        let page = page_size();
        if len == 0 {
            return Err(Error::invalid_argument("host buffer of 0 bytes"));
        }
        if layout.chunk == 0 || !layout.chunk.is_multiple_of(page) {
            return Err(Error::invalid_argument(format!(
                "host chunk size {} is not a positive multiple of the page size {page}",
                layout.chunk
            )));
        }
        let map_len = len.checked_next_multiple_of(page).ok_or_else(|| {
            Error::invalid_argument(format!("host buffer of {len} bytes overflows"))
        })?;
        let ptr = if layout.hugepages && map_len >= HUGE_PAGE {
            mmap_huge(map_len)?
        } else {
            mmap_anonymous(map_len)?
        };
        let chunks = len.div_ceil(layout.chunk) as usize;
        Ok(HostBuffer {
            ptr,
            len,
            map_len,
            backend,
            chunk: layout.chunk,
            streaming: layout.streaming,
            state: (0..chunks).map(|_| AtomicU8::new(UNPINNED)).collect(),
            wanted: (0..chunks).map(|_| AtomicBool::new(false)).collect(),
            written: (0..chunks).map(|_| AtomicBool::new(false)).collect(),
            retired: AtomicBool::new(false),
            digests: super::Digests::default(),
            driver,
            device,
        })
    }

    /// Start of the buffer.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Start of the buffer for writing through a shared reference: the copy pipeline's workers
    /// write disjoint ranges of it at once (each unit of work its own). Callers guarantee no other reference reads or writes
    /// those bytes meanwhile: the engine's operations lock is held for the whole pause or resume,
    /// so no other transaction uses or releases the buffer, and a pause writes only a buffer that
    /// no reader holds (a new one, or a retained one whose only holder is the registry). The
    /// registry lock is not held while copying.
    pub(crate) fn base(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never true: buffers have at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Kind of memory asked for.
    pub fn backend(&self) -> BackupKind {
        self.backend
    }

    /// What it knows of its pieces' contents.
    pub fn digests(&self) -> &super::Digests {
        &self.digests
    }

    /// Number of chunks.
    pub fn chunks(&self) -> usize {
        self.state.len()
    }

    /// True once the buffer is being released: page-locking it further is wasted work.
    pub fn retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Offset and length (within `len`) of chunk `i`.
    pub fn chunk_span(&self, i: usize) -> (u64, u64) {
        let off = i as u64 * self.chunk;
        (off, self.chunk.min(self.len - off))
    }

    /// Offset and length of chunk `i` in whole pages, as it is registered.
    fn chunk_pages(&self, i: usize) -> (u64, u64) {
        let off = i as u64 * self.chunk;
        (off, self.chunk.min(self.map_len - off))
    }

    /// Whether chunk `i` is page-locked.
    pub fn is_pinned(&self, i: usize) -> bool {
        self.state[i].load(Ordering::Acquire) == PINNED
    }

    /// Bytes page-locked.
    pub fn pinned_bytes(&self) -> u64 {
        (0..self.chunks())
            .filter(|i| self.is_pinned(*i))
            .map(|i| self.chunk_pages(i).1)
            .sum()
    }

    /// Page-lock chunk `i`. A no-op if it is page-locked already, or being page-locked by
    /// another thread, or released.
    pub fn pin(&self, i: usize) -> Result<()> {
        if self.state[i]
            .compare_exchange(UNPINNED, PINNING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Ok(());
        }
        let (off, n) = self.chunk_pages(i);
        // SAFETY: whole pages of our own live mapping, not registered (we moved the chunk from
        // UNPINNED to PINNING, so no one else registers it); the mapping outlives the
        // registration (release and Drop unregister before unmapping).
        let r = unsafe {
            self.driver
                .host_register(self.device, self.ptr.add(off as usize), n)
        };
        self.state[i].store(if r.is_ok() { PINNED } else { UNPINNED }, Ordering::Release);
        r
    }

    /// Fault chunk `i`'s pages in for writing without changing its bytes (the kernel hands out
    /// zeroed pages where none were): `MADV_POPULATE_WRITE`, Linux 5.14 and later.
    pub fn populate(&self, i: usize) -> Result<()> {
        let (off, n) = self.chunk_pages(i);
        // SAFETY: whole pages of our own live mapping; populating changes no byte of it.
        let r = unsafe {
            libc::madvise(
                self.ptr.add(off as usize).cast(),
                n as usize,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(Error::last_os(format!(
                "populating {n} bytes of host memory (MADV_POPULATE_WRITE)"
            )))
        }
    }

    /// Mark chunks for page-locking later ([`HostBuffer::pin_wanted`]).
    pub fn want(&self, chunks: &[usize]) {
        for &i in chunks {
            self.wanted[i].store(true, Ordering::Release);
        }
    }

    /// Page-lock chunk `i` if that is still wanted ([`HostBuffer::want`]).
    pub fn pin_wanted(&self, i: usize) -> Result<()> {
        if self.wanted[i].load(Ordering::Acquire) {
            self.pin(i)
        } else {
            Ok(())
        }
    }

    /// The chunks that lie wholly inside the byte ranges `(offset, length)` (sorted, disjoint).
    pub fn chunks_within(&self, ranges: &[(u64, u64)]) -> Vec<usize> {
        (0..self.chunks())
            .filter(|&i| {
                let (c, n) = self.chunk_span(i);
                ranges.iter().any(|&(o, l)| o <= c && c + n <= o + l)
            })
            .collect()
    }

    /// Unregister chunk `i`.
    ///
    /// # Safety
    /// Chunk `i` is registered (PINNED) and stays so meanwhile (no other thread unregisters
    /// it), and no copy uses its memory.
    unsafe fn unregister(&self, i: usize) -> Result<()> {
        let off = self.chunk_pages(i).0 as usize;
        // SAFETY: the offset lies inside our mapping; the chunk is registered there (the
        // caller's contract).
        unsafe { self.driver.host_unregister(self.device, self.ptr.add(off)) }
    }

    /// Page-lock every chunk.
    pub fn pin_all(&self) -> Result<()> {
        (0..self.chunks()).try_for_each(|i| self.pin(i))
    }

    /// [`HostBuffer::pin_all`] of fresh memory, its pages faulted in first: several times
    /// faster (tms-bench: "populate fresh memory" plus "page-lock populated memory" against
    /// "page-lock fresh memory"). Where the kernel cannot populate (before Linux 5.14),
    /// page-locking faults the pages in itself.
    pub fn pin_all_populated(&self) -> Result<()> {
        if let Some(e) = (0..self.chunks()).find_map(|i| self.populate(i).err()) {
            tracing::debug!("page-locking without populating first: {e}");
        }
        self.pin_all()
    }

    /// Give chunk `i`'s memory back to the system: unregister it, then drop its pages. Only for
    /// buffers on their way out ([`release_parallel`]); waits for a page-locking of the chunk in
    /// progress on another thread. A failed unregistration is logged; the chunk stays registered
    /// and the mapping will be leaked.
    fn discard(&self, i: usize) {
        let (off, n) = self.chunk_pages(i);
        // SAFETY: offset inside our mapping.
        let p = unsafe { self.ptr.add(off as usize) };
        loop {
            match self.state[i].compare_exchange(
                UNPINNED,
                GONE,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(PINNING) => std::thread::yield_now(),
                Err(PINNED) => {
                    // SAFETY: chunk i is PINNED and this thread alone moves it on from
                    // there; no copy uses it (the buffer is being released).
                    if let Err(e) = unsafe { self.unregister(i) } {
                        tracing::error!("releasing a host backup: {e}; its memory is leaked");
                        return;
                    }
                    self.state[i].store(GONE, Ordering::Release);
                    break;
                }
                Err(_) => return,
            }
        }
        // SAFETY: our own mapping; the buffer is being released, so nobody reads these pages.
        unsafe { libc::madvise(p.cast(), n as usize, libc::MADV_DONTNEED) };
    }

    /// Give the memory of bytes `off..off + len` back to the system (whole pages inside the
    /// range); they read as zero afterwards. A page-locked chunk the range touches is
    /// unregistered first (the rest of it stays, pageable). For parts of a buffer nobody reads
    /// any more (chunks of a chunked allocation resumed without retention), while the
    /// background pinner is held quiet (so no chunk is being page-locked).
    pub fn drop_pages(&self, off: u64, len: u64) {
        let page = crate::os::page_size();
        let end = (off + len).min(self.len);
        self.digests.forget(off, len);
        for i in 0..self.chunks() {
            let (c, n) = self.chunk_span(i);
            let a = off.max(c).next_multiple_of(page);
            let b = end.min(c + n) / page * page;
            if a >= b {
                continue;
            }
            self.wanted[i].store(false, Ordering::Release);
            self.written[i].store(false, Ordering::Relaxed);
            if self.is_pinned(i) {
                // SAFETY: chunk i is PINNED and the pinner is quiet, so no one else changes
                // that; no copy uses it: the caller holds the only other reference.
                if let Err(e) = unsafe { self.unregister(i) } {
                    tracing::warn!("giving back part of a host backup: {e}; it stays page-locked");
                    continue;
                }
                self.state[i].store(UNPINNED, Ordering::Release);
            }
            if self.state[i].load(Ordering::Acquire) != UNPINNED {
                continue;
            }
            // SAFETY: whole pages inside our own mapping, not page-locked (a registered page
            // would keep feeding DMA while the mapping gets a fresh one), and unused: the caller
            // holds the only other reference and no copy targets these bytes.
            unsafe {
                libc::madvise(
                    self.ptr.add(a as usize).cast(),
                    (b - a) as usize,
                    libc::MADV_DONTNEED,
                )
            };
        }
    }

    /// The contents, for writing (what the digests knew of them is forgotten).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.digests.clear();
        // SAFETY: as in as_slice, and &mut self makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len as usize) }
    }

    /// Copy bytes `off..off + len` of `src` into the same bytes of this buffer (clipped to
    /// both), for a buffer that nothing else uses yet.
    pub fn copy_from(&self, src: &HostBuffer, off: u64, len: u64) {
        let end = (off + len).min(self.len).min(src.len);
        if off >= end {
            return;
        }
        self.digests.forget(off, end - off);
        // SAFETY: off..end lies inside both live mappings; two buffers never overlap; nothing
        // else reads or writes this one yet (the caller made it), and `src` is only read.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.ptr.add(off as usize),
                self.ptr.add(off as usize),
                (end - off) as usize,
            )
        }
    }

    /// The contents.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is owned, mapped memory for our lifetime (anonymous memory reads
        // as bytes, zero where never written).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len as usize) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let mut intact = true;
        for i in 0..self.chunks() {
            // No other reference exists, so no chunk is PINNING.
            if self.is_pinned(i) {
                // SAFETY: chunk i is PINNED and nothing else uses the buffer now.
                if let Err(e) = unsafe { self.unregister(i) } {
                    tracing::error!("freeing a host buffer of {} bytes: {e}", self.len);
                    intact = false;
                }
            }
        }
        if !intact {
            tracing::error!(
                "leaking {} bytes of host memory at {:p}: part of it is still registered",
                self.map_len,
                self.ptr
            );
            return;
        }
        if let Err(e) = munmap(self.ptr, self.map_len) {
            tracing::error!("freeing a host buffer of {} bytes: {e}", self.len);
        }
    }
}

/// How long [`release_parallel`] waits for a reference held for a moment (the background pinner
/// page-locking one chunk) to go, before it leaves a buffer to whoever holds it.
const TRANSIENT_HOLD: std::time::Duration = std::time::Duration::from_millis(200);

/// Release many buffers with up to `threads` threads: unregistering and dropping the pages of
/// large buffers costs about as much as filling them, so it is spread out like the copies. The
/// memory of each buffer only this call holds is given back before it returns; buffers others
/// hold (a caller's lease) are left to them, their memory going with the last reference.
pub fn release_parallel(mut bufs: Vec<Arc<HostBuffer>>, threads: usize) {
    // Retired first, so that the background pinner takes no new reference; one it holds while
    // page-locking a chunk goes within moments, and the buffer is then this call's to free (else
    // its memory would go only when the pinner let go, after this call had returned).
    for b in &bufs {
        b.retired.store(true, Ordering::Release);
    }
    let until = std::time::Instant::now() + TRANSIENT_HOLD;
    while bufs.iter().any(|b| Arc::strong_count(b) > 1) && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_micros(500));
    }
    // A buffer someone else still holds (a zero-copy view of a backup) is theirs to free: its
    // memory goes with their last reference.
    bufs.retain(|b| Arc::strong_count(b) == 1);
    let units: Vec<(usize, usize)> = bufs
        .iter()
        .enumerate()
        .flat_map(|(b, h)| (0..h.chunks()).map(move |c| (b, c)))
        .collect();
    let next = AtomicUsize::new(0);
    let work = || {
        while let Some(&(b, c)) = units.get(next.fetch_add(1, Ordering::Relaxed)) {
            bufs[b].discard(c);
        }
    };
    let helpers = threads.min(units.len()).saturating_sub(1);
    std::thread::scope(|s| {
        for _ in 0..helpers {
            if crate::threads::spawn_scoped(s, "tms-release", work).is_none() {
                break;
            }
        }
        work();
    });
    drop(bufs);
}

impl Backing for HostBuffer {
    fn kind(&self) -> BackupKind {
        self.backend
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn chunks(&self) -> usize {
        HostBuffer::chunks(self)
    }

    fn chunk_span(&self, k: usize) -> (u64, u64) {
        HostBuffer::chunk_span(self, k)
    }

    /// Straight where the chunk is page-locked (in `pin_now`, a pinned backup's chunk is
    /// page-locked first, on the copy's critical path).
    fn direct(&self, k: usize, off: u64, pin_now: bool) -> Result<Option<*mut u8>> {
        if off >= self.len {
            return Err(Error::internal(format!(
                "a copy at byte {off} of a host buffer of {} bytes",
                self.len
            )));
        }
        if pin_now && self.backend == BackupKind::Pinned && !self.is_pinned(k) {
            self.pin(k)?;
        }
        // SAFETY: off < len, inside our mapping.
        Ok(self
            .is_pinned(k)
            .then(|| unsafe { self.ptr.add(off as usize) }))
    }

    fn fresh(&self, k: usize) -> bool {
        !self.written[k].load(Ordering::Relaxed)
    }

    unsafe fn staged(
        &self,
        dir: Dir,
        k: usize,
        off: u64,
        len: u64,
        pieces: &mut dyn FnMut(&mut dyn UnitIo) -> Result<()>,
    ) -> Result<()> {
        if off.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::internal(format!(
                "a copy of bytes {off}+{len} of a host buffer of {} bytes",
                self.len
            )));
        }
        // SAFETY: off + len <= len, inside our mapping.
        let start = unsafe { self.ptr.add(off as usize) };
        let r = pieces(&mut HostUnit {
            start,
            len,
            streaming: self.streaming,
        });
        if dir == Dir::Save {
            self.written[k].store(true, Ordering::Relaxed);
        }
        r
    }
}

/// Bytes `start..start + len` of a host buffer, which one copy worker has to itself for the
/// whole unit (the contract of [`Backing::staged`]).
struct HostUnit {
    start: *mut u8,
    len: u64,
    streaming: bool,
}

impl HostUnit {
    fn check(&self, at: u64, n: usize) -> Result<()> {
        match at.checked_add(n as u64) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::internal(format!(
                "a piece of {n} bytes at {at} of a unit of {} bytes",
                self.len
            ))),
        }
    }
}

impl UnitIo for HostUnit {
    fn load(&mut self, at: u64, slot: &mut [u8]) -> Result<()> {
        self.check(at, slot.len())?;
        // SAFETY: at..at + slot.len() lies inside the unit (checked), which this worker has to
        // itself (Backing::staged's contract); the slot is a buffer of the worker's own, so the
        // ranges do not overlap.
        unsafe {
            copy(
                self.streaming,
                self.start.add(at as usize),
                slot.as_mut_ptr(),
                slot.len(),
            )
        };
        Ok(())
    }

    fn store(&mut self, at: u64, slot: &[u8]) -> Result<()> {
        self.check(at, slot.len())?;
        // SAFETY: as in load.
        unsafe {
            copy(
                self.streaming,
                slot.as_ptr(),
                self.start.add(at as usize),
                slot.len(),
            )
        };
        Ok(())
    }
}

/// A CPU copy between a buffer and a staging slot.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`.
unsafe fn copy(streaming: bool, src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        if streaming {
            crate::os::copy_streaming(src, dst, n)
        } else {
            std::ptr::copy_nonoverlapping(src, dst, n)
        }
    }
}

#[cfg(test)]
mod tests {
    //! Host buffers on a kernel with 64 KiB pages (common on arm64 servers such as Grace),
    //! pretended on this thread whatever this machine's page size: whatever is handed to the
    //! kernel or the driver in whole pages follows the page size; nothing assumes 4 KiB.

    use super::*;
    use crate::driver::sim::{SimConfig, SimDriver};
    use crate::os::test_page;

    const PAGE: u64 = 64 << 10;

    fn layout(chunk: u64, hugepages: bool) -> HostLayout {
        HostLayout {
            chunk,
            hugepages,
            streaming: false,
        }
    }

    #[test]
    fn buffers_are_sized_locked_and_given_back_in_64_kib_pages() {
        test_page::with(PAGE, || {
            let d: Arc<dyn Driver> = Arc::new(SimDriver::new(SimConfig::default()).unwrap());
            let small = HostBuffer::new(
                d.clone(),
                0,
                BackupKind::Mmap,
                PAGE,
                layout(16 << 10, false),
            );
            let e = small.err().expect("a chunk of 16 KiB");
            assert!(e.to_string().contains("page size 65536"), "{e}");
            let g = SimConfig {
                granularity: 16 << 10,
                ..SimConfig::default()
            };
            assert!(SimDriver::new(g).is_err(), "the sim's granularity too");

            // Mapped, and its last chunk page-locked, in whole pages (huge-page aligned here, so
            // that the sim's check of page-locked ranges sees a real 64 KiB boundary).
            let len = (2 << 20) + 100;
            let h =
                HostBuffer::new(d.clone(), 0, BackupKind::Pinned, len, layout(PAGE, true)).unwrap();
            assert_eq!((h.map_len, h.chunks()), ((2 << 20) + PAGE, 33));
            assert_eq!(h.chunk_span(32), (2 << 20, 100));
            h.pin(32).unwrap();
            assert_eq!(h.pinned_bytes(), PAGE, "the last chunk's whole page");
            drop(h);

            // Part of a buffer given back: only the whole pages inside the range go.
            let mut h =
                HostBuffer::new(d, 0, BackupKind::Mmap, 4 * PAGE, layout(2 * PAGE, false)).unwrap();
            h.as_mut_slice().fill(7);
            h.drop_pages(PAGE / 2, 2 * PAGE);
            let (s, p) = (h.as_slice(), PAGE as usize);
            assert!(
                s[..p].iter().all(|&b| b == 7),
                "before the first whole page"
            );
            assert!(s[p..2 * p].iter().all(|&b| b == 0), "the one whole page");
            assert!(s[2 * p..].iter().all(|&b| b == 7), "a part of a page kept");
        })
    }
}
