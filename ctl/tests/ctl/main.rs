//! tmsctl against real preloaded processes on the simulated device.
//!
//! The preloaded process is `tmsctl __demo-child` (the demo's child) run with
//! `LD_PRELOAD=target/<profile>/libtms.so TMS_BACKEND=sim`: it allocates pauseable memory with
//! a CPU backup through the library's C ABI (a chunked one with `--chunk SIZE`), writes a
//! pattern, prints `READY {json}` and then takes commands on stdin (`verify [OFFSET LENGTH]`,
//! `malloc SIZE`, `fork`, `exit`). Its SIGPIPE disposition
//! is the default, like a C program's, so a server that let SIGPIPE through would kill it.
//! Every test has its own socket folder (`TMS_SOCKET_DIR`).
//!
//! `libtms.so` must have been built with the same profile first (`scripts/test` runs
//! `cargo build --workspace` before `cargo test --workspace`).
//!
//! A file per concern: the command line (`cli`), the operations (`ops`), whom tmsctl trusts
//! (`trust`), a process's control socket (`socket`), disk backups and `tmsctl clean` (`disk`),
//! the demo (`demo`), `--json` (`json`), progress (`progress`), `--atomic` (`atomic`; against
//! fake servers that are slow, `atomic_slow`, or whose call fails, `atomic_changed`), finding
//! the process (`find`); what they share is in `common`.

mod atomic;
mod atomic_changed;
mod atomic_slow;
mod cli;
mod common;
mod demo;
mod disk;
mod find;
mod json;
mod ops;
mod progress;
mod socket;
mod trust;
