//! How backups are copied: the copy pipeline's settings (Note [The copy pipeline] in
//! `pipeline.rs`).

use crate::backup::{DiskFile, HostLayout};
use crate::error::{Error, Result};

/// When pinned backups are page-locked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinMode {
    /// After a pause or resume that retains them, on a background thread: the pause itself runs
    /// at the speed of fresh memory, through the staging slots; later cycles find the memory
    /// page-locked (chunks not yet done go through the slots meanwhile). Without retention
    /// nothing is page-locked: the buffer would be released at the next resume anyway.
    Background,
    /// By the copy worker, right before the first copy into a chunk, during the first pause
    /// (page-locking is then on that pause's critical path).
    Inline,
    /// Never: pinned backups behave as mmap ones and always go through the staging slots.
    Never,
}

impl PinMode {
    /// Parse `background`, `inline` or `never`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "background" => Ok(PinMode::Background),
            "inline" => Ok(PinMode::Inline),
            "never" => Ok(PinMode::Never),
            other => Err(Error::invalid_argument(format!(
                "unknown pin mode {other:?}: expected background, inline or never"
            ))),
        }
    }
}

/// How backups are copied (Note [The copy pipeline]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyConfig {
    /// Copy workers per device (1 to [`MAX_WORKERS`]).
    pub threads: usize,
    /// Host buffer layout: the chunk is the unit of work and of page-locking.
    pub layout: HostLayout,
    /// Bytes of one staging slot (two per worker).
    pub slot: u64,
    /// Bytes of each slot a pause into fresh host memory uses (at most `slot`): small enough
    /// that every worker's slots fit in the CPU's last-level cache, which the link writes
    /// into, so the CPU copies out of cache while the kernel hands out the pages (measured on
    /// an H200 host: a first pause of 16 GiB took 0.47–0.49 s with 1 MiB, 0.60–0.69 s with
    /// 4 MiB). Pauses into memory written before (retained mmap backups: 83–84% of the link
    /// with 1 MiB, 92–95% with 4 MiB), restores and disk backups use all of `slot`.
    pub save_slot: u64,
    /// When pinned backups are page-locked.
    pub pin: PinMode,
    /// Unit of work and of checksums of disk backups, in bytes (0: `layout.chunk`).
    pub disk_chunk: u64,
    /// Keep the staging slots (page-locked: 2 × `threads` × `slot` per device) after a resume
    /// without retention, so that the next pause need not page-lock them again. Off: such a
    /// resume gives them back with the backups (a resume with retention keeps them anyway).
    pub keep_staging: bool,
    /// An experiment, off: the workers of a pause queue their copies on their own threads'
    /// default streams (where the driver has them: CUDA's per-thread default stream, which
    /// waits for the legacy default stream's work) instead of the device's one engine stream,
    /// to measure whether queueing many small copies on one stream from every worker is what a
    /// pause into fresh host memory loses per piece. Resumes always use the engine stream (a
    /// non-blocking resume orders the caller's work after it).
    pub save_streams: bool,
}

/// Most workers per device.
pub const MAX_WORKERS: usize = 64;

impl Default for CopyConfig {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        CopyConfig {
            threads: cores.clamp(1, 16),
            layout: HostLayout::default(),
            slot: 4 << 20,
            save_slot: 1 << 20,
            pin: PinMode::Background,
            disk_chunk: 0,
            keep_staging: false,
            save_streams: false,
        }
    }
}

impl CopyConfig {
    /// The disk chunk this setting asks for: `disk_chunk`, or the host chunk where that is 0
    /// (a file's chunks are then cut down to divide the allocation's segments or chunks).
    pub fn disk_chunk_bytes(&self) -> u64 {
        match self.disk_chunk {
            0 => self.layout.chunk,
            d => d,
        }
    }

    /// The chunk of a new file for an allocation paused in runs of whole `unit`s (its chunks,
    /// or its segments): the disk chunk asked for, cut down to divide `unit`, so that a file's
    /// chunks (its unit of checksums) never straddle two runs.
    pub fn file_chunk(&self, unit: u64) -> u64 {
        gcd(self.disk_chunk_bytes(), unit)
    }

    /// Refuse settings the pipeline cannot work with.
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_WORKERS).contains(&self.threads) {
            return Err(Error::invalid_argument(format!(
                "{} copy threads: expected 1 to {MAX_WORKERS}",
                self.threads
            )));
        }
        let page = crate::os::page_size();
        if self.layout.chunk == 0 || !self.layout.chunk.is_multiple_of(page) {
            return Err(Error::invalid_argument(format!(
                "copy chunk of {} bytes: expected a positive multiple of the page size {page}",
                self.layout.chunk
            )));
        }
        // The file format's rule (its alignment), which the disk backing owns.
        DiskFile::check_chunk_setting(self.disk_chunk)?;
        for (what, b) in [
            ("staging slot", self.slot),
            ("staging slot for saving", self.save_slot),
        ] {
            if b == 0 || b % page != 0 {
                return Err(Error::invalid_argument(format!(
                    "{what} of {b} bytes: expected a positive multiple of the page size {page}"
                )));
            }
        }
        Ok(())
    }
}

/// Greatest common divisor.
fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::os::test_page;

    #[test]
    fn sizes_are_checked_against_the_page_size() {
        // A kernel with 64 KiB pages, pretended on this thread: 4 KiB multiples are refused.
        test_page::with(64 << 10, || {
            let ok = CopyConfig {
                layout: HostLayout {
                    chunk: 3 << 16,
                    ..HostLayout::default()
                },
                slot: 64 << 10,
                save_slot: 64 << 10,
                ..CopyConfig::default()
            };
            ok.validate().unwrap();
            for bad in [
                CopyConfig {
                    layout: HostLayout {
                        chunk: 16 << 10,
                        ..HostLayout::default()
                    },
                    ..ok
                },
                CopyConfig {
                    slot: 4 << 10,
                    ..ok
                },
                CopyConfig {
                    save_slot: 68 << 10,
                    ..ok
                },
            ] {
                let e = bad.validate().unwrap_err().to_string();
                assert!(e.contains("page size 65536"), "{e}");
            }
        })
    }
}
