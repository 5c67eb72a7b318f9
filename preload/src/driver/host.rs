//! Host memory that holds CPU backups: page-locked (through the driver, so copies run at link
//! speed) or pageable anonymous memory (so the kernel can take the pages back once it is freed).

use std::sync::Arc;

use super::Driver;
use crate::error::{Error, Result};

/// Which kind of host memory backs a CPU backup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HostBackend {
    /// Page-locked host memory from the driver.
    Pinned,
    /// Pageable anonymous memory (`mmap`).
    Mmap,
}

impl HostBackend {
    /// Parse `"pinned"` or `"mmap"`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "pinned" => Ok(HostBackend::Pinned),
            "mmap" => Ok(HostBackend::Mmap),
            other => Err(Error::InvalidArgument(format!(
                "unknown CPU backup backend {other:?}: expected \"pinned\" or \"mmap\""
            ))),
        }
    }

    /// The name `parse` accepts.
    pub fn as_str(self) -> &'static str {
        match self {
            HostBackend::Pinned => "pinned",
            HostBackend::Mmap => "mmap",
        }
    }
}

/// An owned block of host memory. Freed on drop; a failure to free is logged, never panicked.
pub struct HostBuffer {
    ptr: *mut u8,
    len: u64,
    backend: HostBackend,
    driver: Arc<dyn Driver>,
}

// SAFETY: the buffer exclusively owns its memory; access goes through &self / &mut self.
unsafe impl Send for HostBuffer {}
// SAFETY: shared references only read.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocate `len` bytes (> 0) of the given kind. Contents are unspecified.
    pub fn new(driver: Arc<dyn Driver>, backend: HostBackend, len: u64) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("host buffer of 0 bytes".into()));
        }
        let ptr = match backend {
            HostBackend::Pinned => driver.host_alloc_pinned(len)?,
            HostBackend::Mmap => mmap_anonymous(len)?,
        };
        Ok(HostBuffer {
            ptr,
            len,
            backend,
            driver,
        })
    }

    /// Start of the buffer.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Start of the buffer, for writing.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
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

    /// Kind of memory.
    pub fn backend(&self) -> HostBackend {
        self.backend
    }

    /// The contents, for writing.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len as usize) }
    }

    /// The contents.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is owned, initialised-or-zero mapped memory for our lifetime
        // (anonymous and pinned memory both read as bytes).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len as usize) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let res = match self.backend {
            // SAFETY: ptr/len came from host_alloc_pinned of this driver and are not used again.
            HostBackend::Pinned => unsafe { self.driver.host_free_pinned(self.ptr, self.len) },
            HostBackend::Mmap => munmap(self.ptr, self.len),
        };
        if let Err(e) = res {
            tracing::error!(
                "freeing a {} host buffer of {} bytes: {e}",
                self.backend.as_str(),
                self.len
            );
        }
    }
}

/// Fresh pageable anonymous memory, not reserved against swap.
pub(crate) fn mmap_anonymous(len: u64) -> Result<*mut u8> {
    // SAFETY: a new private anonymous mapping; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENOMEM) {
            return Err(Error::OutOfMemory(format!(
                "mmap of {len} bytes of host memory: {err}"
            )));
        }
        return Err(Error::Io {
            context: format!("mmap of {len} bytes of host memory"),
            source: err,
        });
    }
    Ok(p.cast())
}

/// Unmap memory from [`mmap_anonymous`].
pub(crate) fn munmap(ptr: *mut u8, len: u64) -> Result<()> {
    // SAFETY: callers pass a mapping they own and no longer use.
    if unsafe { libc::munmap(ptr.cast(), len as usize) } != 0 {
        return Err(Error::last_os(format!("munmap of {len} bytes at {ptr:p}")));
    }
    Ok(())
}
