//! Where paused contents wait: backup policy and the host memory that holds CPU backups and
//! staging slots. (Memory the device driver owns is in `driver`; this module only asks it to
//! page-lock host memory.)

pub mod host;

pub use host::{release_parallel, HostBackend, HostBuffer, HostLayout};
