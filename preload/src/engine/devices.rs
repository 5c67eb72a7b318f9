//! Fan-out over devices: a pause or resume runs each device's share on a thread of its own.

use std::collections::BTreeMap;

use parking_lot::Mutex;

use super::pipeline::Ring;
use crate::error::Result;

/// Run `f` on each device's job: on this thread for one device, else on a thread per device.
pub(super) fn per_device<J: Send, T: Send>(jobs: Vec<J>, f: impl Fn(J) -> T + Sync) -> Vec<T> {
    if jobs.len() <= 1 {
        return jobs.into_iter().map(f).collect();
    }
    // Each job waits in a slot until a thread takes it; a job whose thread could not be had
    // runs here, after the others were started.
    let slots: Vec<Mutex<Option<J>>> = jobs.into_iter().map(|j| Mutex::new(Some(j))).collect();
    let run = |i: usize| slots[i].lock().take().map(&f);
    let run = &run;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..slots.len())
            .map(|i| crate::threads::spawn_scoped(s, "tms-device", move || run(i)))
            .collect();
        handles
            .into_iter()
            .enumerate()
            .filter_map(|(i, h)| match h {
                Some(h) => match h.join() {
                    Ok(t) => t,
                    Err(p) => std::panic::resume_unwind(p),
                },
                None => run(i),
            })
            .collect()
    })
}

/// The indices of `devices` (one per job) grouped by device.
pub(super) fn by_device(devices: impl Iterator<Item = i32>) -> BTreeMap<i32, Vec<usize>> {
    let mut groups: BTreeMap<i32, Vec<usize>> = BTreeMap::new();
    for (i, d) in devices.enumerate() {
        groups.entry(d).or_default().push(i);
    }
    groups
}

/// Each device's jobs next to its staging ring (made if missing): what a pause or resume hands
/// to its per-device coordinators.
pub(super) fn device_work<'a>(
    groups: &'a BTreeMap<i32, Vec<usize>>,
    rings: &'a mut BTreeMap<i32, Ring>,
) -> Vec<(i32, &'a Vec<usize>, &'a mut Ring)> {
    for device in groups.keys() {
        rings.entry(*device).or_default();
    }
    rings
        .iter_mut()
        .filter_map(|(device, ring)| Some((*device, groups.get(device)?, ring)))
        .collect()
}

/// The first error (in device order); the others are logged.
pub(super) fn first_error(results: impl IntoIterator<Item = Result<()>>) -> Result<()> {
    let mut first = Ok(());
    for r in results {
        if let Err(e) = r {
            if first.is_ok() {
                first = Err(e);
            } else {
                tracing::error!("another device failed too: {e}");
            }
        }
    }
    first
}
