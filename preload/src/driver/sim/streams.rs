//! Streams and events of the simulated device. A copy is queued on its stream and runs when the
//! stream, an event recorded after it, or its device is synchronized, as a GPU runs queued work
//! later: an engine that reuses a buffer before waiting sees wrong data. A queued copy that meets
//! a range unmapped meanwhile fails with an illegal address, and every wait covering the work
//! dropped with it fails too.

use std::collections::{HashMap, HashSet, VecDeque};

use super::faults::{driver_err, invalid, Prim};
use super::host::Host;
use super::memory::Memory;
use super::SimDriver;
use crate::driver::{DevPtr, Event, Stream};
use crate::error::Result;

/// A copy queued on a stream.
pub(super) struct Queued {
    pub(super) to_host: bool,
    pub(super) host: usize,
    pub(super) dev: DevPtr,
    pub(super) len: u64,
}

impl Queued {
    fn prim(&self) -> Prim {
        if self.to_host {
            Prim::CopyD2H
        } else {
            Prim::CopyH2D
        }
    }
}

/// What a stream's queue holds: copies, and the marks events put between them.
enum Entry {
    Copy(Queued),
    Mark(u64),
}

/// Part of the driver's state: the queues, the events, and copy statistics.
#[derive(Default)]
pub(super) struct Streams {
    queued: HashMap<u64, VecDeque<Entry>>,
    /// Live events: id -> the stream of their last record.
    events: HashMap<u64, Option<u64>>,
    /// Events whose mark was dropped (with work queued ahead of it) when a queued copy hit an
    /// unmapped range: a wait for one fails (as on a GPU, where that error is sticky) until it
    /// is recorded again, so nobody takes work that never ran for done.
    lost: HashSet<u64>,
    next_event: u64,
    pageable_copies: u64,
    /// Host-to-device copies still to corrupt (one bit of their first byte flipped), as a
    /// faulty link or memory would: what a verified resume must catch.
    corrupt_h2d: u64,
}

/// The stream of `device` (one per device).
pub(super) fn device_stream(device: i32) -> Stream {
    Stream(device as u64 + 1)
}

/// The device of a stream from [`device_stream`].
pub(super) fn stream_device(stream: Stream) -> i32 {
    stream.0 as i32 - 1
}

impl Streams {
    /// Queue `q` on `stream` (whose device was checked) if its device range is accessible.
    pub(super) fn queue(
        &mut self,
        mem: &Memory,
        host: &Host,
        stream: Stream,
        q: Queued,
    ) -> Result<()> {
        if !mem.covered(q.dev, q.len) {
            return Err(invalid(
                q.prim(),
                format!(
                    "device range {:#x}+{} is not mapped and accessible",
                    q.dev, q.len
                ),
            ));
        }
        if !host.is_registered(q.host, q.len) {
            self.pageable_copies += 1;
        }
        self.queued
            .entry(stream.0)
            .or_default()
            .push_back(Entry::Copy(q));
        Ok(())
    }

    /// Run everything queued on the streams of `device`.
    pub(super) fn run_device(&mut self, mem: &Memory, device: i32) -> Result<()> {
        let mine: Vec<u64> = self
            .queued
            .keys()
            .copied()
            .filter(|s| stream_device(Stream(*s)) == device)
            .collect();
        for s in mine {
            self.run_queue(mem, s, usize::MAX)?;
        }
        Ok(())
    }

    /// Run everything queued on `stream`.
    pub(super) fn run_stream(&mut self, mem: &Memory, stream: Stream) -> Result<()> {
        self.run_queue(mem, stream.0, usize::MAX)
    }

    /// A queued copy of `stream` failed: it and the entries after it in its batch (`rest`) never
    /// run, and every event marked among them or still marked on the stream is lost (the work
    /// queued before it did not all happen).
    fn drop_after_failure(&mut self, stream: u64, rest: impl IntoIterator<Item = Entry>) {
        let queued = self.queued.get(&stream).into_iter().flatten();
        let marks: Vec<u64> = rest
            .into_iter()
            .filter_map(|e| match e {
                Entry::Mark(ev) => Some(ev),
                Entry::Copy(_) => None,
            })
            .chain(queued.filter_map(|e| match e {
                Entry::Mark(ev) => Some(*ev),
                Entry::Copy(_) => None,
            }))
            .collect();
        self.lost.extend(marks);
    }

    /// Run the first `n` entries queued on `stream` (all: `usize::MAX`); a device range
    /// unmapped meanwhile is an illegal address, as on a GPU, and the rest of those is dropped.
    fn run_queue(&mut self, mem: &Memory, stream: u64, n: usize) -> Result<()> {
        let Some(q) = self.queued.get_mut(&stream) else {
            return Ok(());
        };
        let mut batch: VecDeque<Entry> = q.drain(..n.min(q.len())).collect();
        while let Some(e) = batch.pop_front() {
            let Entry::Copy(q) = e else { continue };
            if !mem.covered(q.dev, q.len) {
                self.drop_after_failure(stream, batch);
                return Err(driver_err(
                    Prim::StreamSync,
                    700,
                    format!(
                        "a queued copy touches {:#x}+{}, which is no longer mapped",
                        q.dev, q.len
                    ),
                ));
            }
            let (src, dst) = if q.to_host {
                (q.dev as *const u8, q.host as *mut u8)
            } else {
                (q.host as *const u8, q.dev as *mut u8)
            };
            // SAFETY: the device range is an accessible mapping (checked just now); the engine
            // keeps the host range alive and untouched until this synchronization (the copy
            // contract of Driver::copy_d2h / copy_h2d).
            unsafe { std::ptr::copy_nonoverlapping(src, dst, q.len as usize) };
            if !q.to_host && q.len > 0 && self.corrupt_h2d > 0 {
                self.corrupt_h2d -= 1;
                // SAFETY: the first byte of the device range just written (accessible, checked
                // above).
                unsafe { *dst ^= 1 };
            }
        }
        Ok(())
    }

    /// How many entries of `stream`'s queue come up to and including the last mark of `event`
    /// (0 if it has none).
    fn upto_mark(&self, stream: u64, event: u64) -> usize {
        self.queued.get(&stream).map_or(0, |q| {
            q.iter()
                .rposition(|e| matches!(e, Entry::Mark(m) if *m == event))
                .map_or(0, |i| i + 1)
        })
    }

    pub(super) fn event_create(&mut self) -> Event {
        self.next_event += 1;
        let id = self.next_event;
        self.events.insert(id, None);
        Event(id)
    }

    /// Put `event`'s mark at the end of `stream`'s queue.
    pub(super) fn event_record(&mut self, event: Event, stream: Stream) -> Result<()> {
        self.lost.remove(&event.0);
        match self.events.get_mut(&event.0) {
            Some(at) => *at = Some(stream.0),
            None => {
                return Err(driver_err(
                    Prim::EventRecord,
                    400,
                    format!("event {} is not live", event.0),
                ))
            }
        }
        self.queued
            .entry(stream.0)
            .or_default()
            .push_back(Entry::Mark(event.0));
        Ok(())
    }

    /// The stream of `event`'s last record (`None`: never recorded); an error if it is not live.
    pub(super) fn event_stream(&self, event: Event) -> Result<Option<u64>> {
        match self.events.get(&event.0) {
            Some(s) => Ok(*s),
            None => Err(driver_err(
                Prim::EventSync,
                400,
                format!("event {} is not live", event.0),
            )),
        }
    }

    /// Run the work queued before `event`'s last mark on `stream` (entered already).
    pub(super) fn event_sync(
        &mut self,
        mem: &Memory,
        event: Event,
        stream: Option<u64>,
    ) -> Result<()> {
        if self.lost.contains(&event.0) {
            return Err(driver_err(
                Prim::EventSync,
                999,
                format!(
                    "event {}: the work queued before it was lost to an earlier failure",
                    event.0
                ),
            ));
        }
        match stream {
            Some(s) => {
                let n = self.upto_mark(s, event.0);
                self.run_queue(mem, s, n)
            }
            None => Ok(()),
        }
    }

    pub(super) fn event_destroy(&mut self, event: Event) {
        self.events.remove(&event.0);
        self.lost.remove(&event.0);
    }
}

impl SimDriver {
    /// Copies queued whose host side was not registered memory (on a GPU such a copy goes
    /// through the driver's slow pageable path).
    pub fn pageable_copies(&self) -> u64 {
        self.inner.lock().streams.pageable_copies
    }

    /// Corrupt the next `n` host-to-device copies (one bit of each one's first byte).
    pub fn corrupt_next_h2d(&self, n: u64) {
        self.inner.lock().streams.corrupt_h2d = n;
    }

    /// Copies queued and not yet run by a synchronization.
    pub fn queued_copies(&self) -> usize {
        self.inner
            .lock()
            .streams
            .queued
            .values()
            .flat_map(|q| q.iter())
            .filter(|e| matches!(e, Entry::Copy(_)))
            .count()
    }
}
