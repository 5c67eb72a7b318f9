//! NCCL's communicators as the engine sees them: the reserved tag [`NCCL_TAG`], the [`Comms`]
//! it suspends and resumes, the buffers NCCL registered, and their numbers. What the engine
//! does with them is in `nccl_tag.rs`; how the library learns of them, Note [NCCL
//! communicators as a tag] in `nccl/mod.rs`.
//!
//! The engine knows the communicators only through [`Comms`]: a pause or resume of the tag
//! suspends or resumes every live communicator, all or none, as one transaction (it takes the
//! operations lock like any other, so it never overlaps a pause or resume of memory, and its
//! numbers go into the tag's history); a pause or resume of every tag includes it only where
//! `Engine::set_nccl_in_all` asked, since the program must not use a suspended communicator.
//! Before a pause of memory marks anything, it asks which allocations hold a buffer NCCL
//! registered: with [`Registered::Keep`] (the default) they stay mapped, as `keep_resident`
//! ones do, until deregistered; with [`Registered::Refuse`] the pause fails, naming the buffer
//! and both remedies, before anything changed.

use crate::driver::{DevPtr, Driver};
use crate::error::{Error, Result};

/// The tag of NCCL's communicators, reserved: no allocation may have it.
pub const NCCL_TAG: &str = "nccl";

/// Why an allocation cannot have [`NCCL_TAG`].
pub fn reserved_tag() -> String {
    format!(
        "tag {NCCL_TAG:?} is reserved for NCCL's communicators (pause(\"{NCCL_TAG}\") suspends \
         them): give the region another tag"
    )
}

/// What a pause does with an allocation holding a buffer NCCL registered
/// (`ncclCommRegister`, `ncclCommWindowRegister`): NCCL holds its physical memory, so new
/// memory mapped at the same address would leave NCCL (and its peers) on the old one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Registered {
    /// Leave it mapped until it is deregistered (the pause goes on with the rest).
    #[default]
    Keep,
    /// Fail the pause before it changes anything, naming the buffer.
    Refuse,
}

impl Registered {
    /// `"keep"` or `"refuse"`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "keep" => Ok(Registered::Keep),
            "refuse" => Ok(Registered::Refuse),
            other => Err(Error::invalid_argument(format!(
                "what to do with buffers NCCL registered: {other:?}; expected keep or refuse"
            ))),
        }
    }

    /// Its name.
    pub fn as_str(self) -> &'static str {
        match self {
            Registered::Keep => "keep",
            Registered::Refuse => "refuse",
        }
    }
}

/// A buffer a communicator registered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// Its address.
    pub addr: DevPtr,
    /// Its length in bytes.
    pub len: u64,
    /// How it was registered, for messages: `ncclCommRegister on communicator 0x...`.
    pub how: String,
}

/// What a suspend or resume of the communicators changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommsDone {
    /// Communicators suspended or resumed.
    pub communicators: usize,
    /// Device memory they gave back or took again, as NCCL counts it (its suspendable bytes).
    pub bytes: u64,
}

/// The communicators' numbers, as `stats` shows them in the tag's entry.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct CommStats {
    /// The NCCL loaded, `2.29.7`; `None` where none was found.
    pub version: Option<String>,
    /// Why the tag cannot be paused (this NCCL has no `ncclCommSuspend`); `None` where it can.
    pub unsupported: Option<String>,
    /// Live communicators known.
    pub communicators: usize,
    /// Of those, suspended.
    pub suspended: usize,
    /// Device memory NCCL can give back (`ncclStatGpuMemSuspend`), all communicators.
    pub suspendable_bytes: u64,
    /// Of that, the suspended communicators' (given back now).
    pub suspended_bytes: u64,
    /// Device memory NCCL keeps while suspended (`ncclStatGpuMemPersist`).
    pub persistent_bytes: u64,
    /// Device memory NCCL tracks (`ncclStatGpuMemTotal`).
    pub total_bytes: u64,
    /// The first failure to read those numbers, where one failed.
    pub error: Option<String>,
    /// Buffers registered with NCCL (`ncclCommRegister`, `ncclCommWindowRegister`).
    pub registered_buffers: usize,
    /// Their bytes.
    pub registered_bytes: u64,
    /// Whether a pause or resume of every tag includes the communicators (the engine's
    /// setting).
    pub in_all_tags: bool,
    /// What a pause does with an allocation holding a registered buffer: `keep` or `refuse`
    /// (the engine's setting).
    pub registered_policy: &'static str,
}

/// The communicators the engine suspends and resumes, and the buffers they registered.
pub trait Comms: Send + Sync {
    /// Whether the process ever had a communicator known here: until then the tag is unknown
    /// and `stats` has no entry for it.
    fn seen(&self) -> bool;
    /// Why the communicators cannot be suspended (this NCCL lacks the calls), where they
    /// cannot.
    fn unsupported(&self) -> Option<String>;
    /// The buffers registered now.
    fn registrations(&self) -> Vec<Registration>;
    /// Suspend every live communicator not suspended, all or none: a failure resumes those
    /// this call suspended, and says which it could not (`Error::changed`). `driver` makes
    /// each communicator's device current around NCCL's calls (so no thread opens a context on
    /// another device).
    fn suspend(&self, driver: &dyn Driver) -> Result<CommsDone>;
    /// Resume every suspended communicator, all or none likewise.
    fn resume(&self, driver: &dyn Driver) -> Result<CommsDone>;
    /// The numbers (`None` until [`Comms::seen`]). The two settings are filled by the engine.
    fn stats(&self, driver: &dyn Driver) -> Option<CommStats>;
}

/// No communicators: engines of tests and tools, and the one of a process before NCCL.
pub struct NoComms;

impl Comms for NoComms {
    fn seen(&self) -> bool {
        false
    }
    fn unsupported(&self) -> Option<String> {
        None
    }
    fn registrations(&self) -> Vec<Registration> {
        Vec::new()
    }
    fn suspend(&self, _: &dyn Driver) -> Result<CommsDone> {
        Ok(CommsDone::default())
    }
    fn resume(&self, _: &dyn Driver) -> Result<CommsDone> {
        Ok(CommsDone::default())
    }
    fn stats(&self, _: &dyn Driver) -> Option<CommStats> {
        None
    }
}
