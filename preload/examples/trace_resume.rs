//! The disk resume that `scripts/paths/run` traces (issue 37's path count): one disk-backed
//! allocation on one simulated device is paused, then resumed in `traced_resume`.

use std::sync::Arc;

use tms::backup::BackupKind;
use tms::driver::sim::{SimConfig, SimDriver};
use tms::engine::{AllocRequest, CopyConfig, Engine};

fn main() {
    let config = SimConfig {
        devices: 1,
        capacity: 1 << 30,
        granularity: 2 << 20,
    };
    let sim = Arc::new(SimDriver::new(config).expect("a simulated device"));
    let e = Engine::new(sim);
    let mut cfg = CopyConfig {
        threads: 1,
        ..CopyConfig::default()
    };
    cfg.slot = 256 << 10;
    cfg.disk_chunk = 1 << 20;
    e.set_copy_config(cfg).expect("copy settings");
    let dir = tempfile::tempdir().expect("a temporary folder");
    e.set_disk_backup_dir(Some(dir.path().join("backups")))
        .expect("the disk folder");
    let p = e
        .alloc(&AllocRequest::new(4 << 20, "kv", Some(BackupKind::Disk)))
        .expect("an allocation");
    e.write_bytes(p, &vec![7u8; 4 << 20]).expect("its contents");
    e.pause(Some("kv")).expect("the pause");
    traced_resume(&e);
    e.free(p).expect("the free");
}

/// The traced call: the path counted starts here.
#[inline(never)]
fn traced_resume(e: &Engine) {
    e.resume(Some("kv")).expect("the resume");
}
