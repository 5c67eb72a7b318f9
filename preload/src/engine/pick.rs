//! What a pause or resume acts on: a tag, an allocation, chunks of it.

use super::registry::{Allocation, Registry};
use crate::driver::DevPtr;
use crate::error::{Error, Result};

/// What a pause or resume acts on.
#[derive(Clone, Copy, Debug, Default)]
pub struct Pick<'a> {
    /// Allocations of this tag (every tag if `None`).
    pub tag: Option<&'a str>,
    /// Only the allocation starting here.
    pub alloc: Option<DevPtr>,
    /// Only these chunks of it (a chunked allocation; sorted, each once).
    pub chunks: Option<&'a [usize]>,
    /// Pause: record which chunks of each allocation were active (a whole allocation: whether
    /// it was). Resume: bring back only what was so recorded (all, where nothing was recorded).
    pub chunk_state: bool,
    /// Which record `chunk_state` saves or restores.
    pub record: Record,
    /// A number the caller gives the operation, reported with its progress
    /// ([`Engine::progress`]) so that the caller can tell its own operation from another's
    /// (the control server's request number).
    pub label: Option<u64>,
}

/// Where a pause saving chunk states records them: the program's record
/// (`pause(save_chunk_state=True)`), or the one a job-wide operation keeps for its own undo
/// (`tmsctl pause --atomic`, `distributed.pause`), so that neither overwrites the other's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Record {
    /// The program's own.
    #[default]
    Program,
    /// A job-wide operation's, for its undo.
    Job,
}

impl Record {
    /// Its index in an allocation's records.
    pub(super) fn index(self) -> usize {
        match self {
            Record::Program => 0,
            Record::Job => 1,
        }
    }
}

impl<'a> Pick<'a> {
    /// Every allocation of `tag` (every tag if `None`), whole.
    pub fn tag(tag: Option<&'a str>) -> Self {
        Pick {
            tag,
            ..Default::default()
        }
    }

    /// These chunks of the chunked allocation at `alloc`.
    pub fn chunks(alloc: DevPtr, chunks: &'a [usize]) -> Self {
        Pick {
            alloc: Some(alloc),
            chunks: Some(chunks),
            ..Default::default()
        }
    }

    pub(super) fn selects(&self, ptr: DevPtr, a: &Allocation) -> bool {
        self.tag.is_none_or(|t| &*a.tag == t) && self.alloc.is_none_or(|p| p == ptr)
    }

    pub(super) fn wants(&self, seg: usize) -> bool {
        self.chunks.is_none_or(|c| c.binary_search(&seg).is_ok())
    }

    /// Refuse chunks of an allocation that is not chunked, or that it does not have.
    pub(super) fn check(&self, reg: &Registry) -> Result<()> {
        let Some(ptr) = self.alloc else {
            return Ok(());
        };
        let a = reg.allocs.get(&ptr).ok_or_else(|| {
            Error::not_found(format!(
                "{ptr:#x} is not the start of a pauseable allocation"
            ))
        })?;
        if a.resident {
            return Err(Error::invalid_state(format!(
                "allocation {ptr:#x} (tag {:?}) is kept resident (keep_resident): pause and \
                 resume leave it mapped until it is freed",
                a.tag
            )));
        }
        let Some(chunks) = self.chunks else {
            return Ok(());
        };
        if a.chunk == 0 {
            return Err(Error::invalid_argument(format!(
                "allocation {ptr:#x} (tag {:?}) is not chunked: it pauses and resumes whole \
                 (allocate it in a region with a chunk size)",
                a.tag
            )));
        }
        if !chunks.windows(2).all(|w| w[0] < w[1]) {
            return Err(Error::invalid_argument(
                "chunk indices must be sorted and each given once",
            ));
        }
        let n = a.handles.len();
        if let Some(bad) = chunks.iter().find(|&&c| c >= n) {
            return Err(Error::invalid_argument(format!(
                "chunk {bad} of allocation {ptr:#x} (tag {:?}): it has {n} chunks (0 to {})",
                a.tag,
                n - 1
            )));
        }
        Ok(())
    }

    pub(super) fn describe(&self) -> String {
        let mut d = describe(self.tag);
        if let Some(p) = self.alloc {
            d = format!("allocation {p:#x}");
        }
        if let Some(c) = self.chunks {
            d = format!("{} of {d}", crate::units::ranges(c));
        }
        d
    }
}

/// Refuse `Some("")`: no tag (`None`) is how every tag is named.
pub(super) fn check_tag(tag: Option<&str>) -> Result<()> {
    if tag == Some("") {
        return Err(Error::invalid_argument(
            "tag must not be empty (no tag means every tag)",
        ));
    }
    Ok(())
}

pub(super) fn describe(tag: Option<&str>) -> String {
    match tag {
        Some(t) => format!("tag {t:?}"),
        None => "all tags".to_string(),
    }
}
