//! What the model-based tests (`model.rs`, one thread; `concurrent_model.rs`, several) share:
//! the faults they arm, and the model of one allocation's units (chunks, or the whole
//! allocation) that each test's own model of an allocation builds on.

use std::collections::BTreeMap;
use std::ops::DerefMut;

use tms::driver::sim::Prim;
use tms::engine::State;
use tms::Backup;

/// A fault armed for one operation: a driver primitive, or a disk operation in the backup
/// folder, firing at its `nth` call.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    Prim(Prim, u64),
    Disk(tms::backup::disk::DiskOp, u64),
}

/// Driver primitives whose failure a pause or resume reports without leaking anything (a
/// failed release or unregistration leaks by design, and would throw the counts off).
pub const FAULT_PRIMS: [Prim; 10] = [
    Prim::Create,
    Prim::Map,
    Prim::SetAccess,
    Prim::Unmap,
    Prim::Synchronize,
    Prim::EventRecord,
    Prim::EventSync,
    Prim::CopyD2H,
    Prim::CopyH2D,
    Prim::HostRegister,
];

/// One allocation's units as a model sees them: which are mapped, which contents are known,
/// which the backup holds.
#[derive(Clone, Debug)]
pub struct Units {
    pub size: u64,
    pub mapped: u64,
    pub backup: Backup,
    /// Chunk size (0: not chunked; the allocation is then one unit).
    pub chunk: u64,
    /// Per unit (chunk, or the whole allocation): mapped.
    pub active: Vec<bool>,
    /// Per unit: its contents are known (written, and kept across every pause since).
    pub defined: Vec<bool>,
    pub contents: Vec<u8>,
    /// Per unit: the backup holds its contents of the last pause.
    pub saved: Vec<bool>,
}

impl Units {
    /// A new allocation of `units` units, all mapped, contents unknown.
    pub fn new(size: u64, mapped: u64, backup: Backup, chunk: u64, units: usize) -> Units {
        Units {
            size,
            mapped,
            backup,
            chunk,
            active: vec![true; units],
            defined: vec![false; units],
            contents: vec![0; size as usize],
            saved: vec![false; units],
        }
    }

    pub fn unit(&self) -> u64 {
        if self.chunk > 0 {
            self.chunk
        } else {
            self.mapped
        }
    }

    /// Offset and length (within the asked size) of unit `u`.
    pub fn span(&self, u: usize) -> (u64, u64) {
        let off = u as u64 * self.unit();
        (off, self.unit().min(self.size - off))
    }

    /// The state the units' mappings make.
    pub fn state(&self) -> State {
        match self.active.iter().filter(|a| **a).count() {
            0 => State::Paused,
            n if n == self.active.len() => State::Active,
            _ => State::Partial,
        }
    }

    /// Device bytes mapped.
    pub fn live(&self) -> u64 {
        self.active.iter().filter(|a| **a).count() as u64 * self.unit()
    }

    /// Pause units `us` (active ones); returns (device bytes, copied bytes).
    pub fn pause(&mut self, us: &[usize]) -> (u64, u64) {
        let (mut bytes, mut copied) = (0, 0);
        for &u in us {
            self.active[u] = false;
            bytes += self.unit();
            if self.backup.is_some() {
                self.saved[u] = true;
                copied += self.span(u).1;
            } else {
                self.defined[u] = false;
            }
        }
        (bytes, copied)
    }

    /// Resume units `us` (paused ones); returns (device bytes, copied bytes). What the backup
    /// keeps once every unit is back is each model's own rule.
    pub fn resume(&mut self, us: &[usize], retain: bool) -> (u64, u64) {
        let (mut bytes, mut copied) = (0, 0);
        for &u in us {
            self.active[u] = true;
            bytes += self.unit();
            if self.backup.is_some() && self.saved[u] {
                copied += self.span(u).1;
            } else {
                self.defined[u] = false;
            }
            if !retain {
                self.saved[u] = false;
            }
        }
        (bytes, copied)
    }
}

/// A poke: among `allocs`, the `pick`-th active unit with known contents, and 1 to 16 bytes in
/// it from `at` and `seed`. Records them in the model and returns where they go (allocation,
/// offset) with the bytes, for the test to write through the device.
pub fn poke<A: DerefMut<Target = Units>>(
    allocs: &mut BTreeMap<u64, A>,
    pick: usize,
    at: u64,
    seed: u64,
) -> Option<(u64, u64, Vec<u8>)> {
    let some: Vec<(u64, usize)> = allocs
        .iter()
        .flat_map(|(p, a)| {
            (0..a.active.len())
                .filter(|&u| a.active[u] && a.defined[u])
                .map(move |u| (*p, u))
        })
        .collect();
    let &(p, u) = some.get(pick % some.len().max(1))?;
    let a = allocs.get_mut(&p).unwrap();
    let (off, len) = a.span(u);
    let n = (1 + seed % 16).min(len);
    let o = off + at % (len - n + 1);
    let data = crate::common::pattern(n as usize, seed);
    a.contents[o as usize..(o + n) as usize].copy_from_slice(&data);
    Some((p, o, data))
}

/// `Deref`/`DerefMut` to [`Units`] for a model's allocation type holding them in field `u`, so
/// that each test's model reads its units as its own fields.
#[macro_export]
macro_rules! units_deref {
    ($t:ty) => {
        impl std::ops::Deref for $t {
            type Target = $crate::common::model::Units;
            fn deref(&self) -> &Self::Target {
                &self.u
            }
        }

        impl std::ops::DerefMut for $t {
            fn deref_mut(&mut self) -> &mut Self::Target {
                &mut self.u
            }
        }
    };
}
