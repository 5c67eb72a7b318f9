//! Many threads allocating, writing, verifying and freeing while another thread pauses and
//! resumes their tags.
//!
//! Soundness of the content assertions: each worker `i` owns two tags, `w{i}` (every allocation
//! with a CPU backup) and `n{i}` (no backup), and a gate (a reader-writer lock). The worker
//! touches its memory and pauses/resumes its own tags only while holding its gate for reading;
//! the pauser thread pauses and resumes `w{i}` only while holding gate `i` for writing, and never
//! touches `n{i}`. So no write races with a pause of its allocation, contents written before any
//! pause must be intact after the resume (backups), and `n{i}` contents are lost only by the
//! worker's own pause. Besides its random rounds the pauser serves explicit requests that
//! workers make in the middle of an iteration (gate released, allocations live), so a known
//! number of cross-thread pause/resume rounds over non-empty tags is guaranteed.
//!
//! A watchdog aborts the process if the whole test takes more than 60 s (10 minutes on a GPU:
//! a deadlock). Runs on the simulated device or a GPU (`common::harness`).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use common::{engine_test, Harness, Setup};
use parking_lot::RwLock;
use tms::backup::BackupKind;
use tms::engine::{AllocRequest, Checks, State};
use tms::Backup;

/// The sim's granularity (a GPU has its own).
const G: u64 = 64 << 10;
const WORKERS: usize = 8;
const ITERS: usize = 24;
/// Seconds after which the watchdog declares a deadlock and aborts (on the sim, on a GPU).
const HANG_CHECK: (u64, u64) = (60, 600);
/// Every REQUEST_EVERY-th iteration a worker asks the pauser for a round on its tag.
const REQUEST_EVERY: usize = 3;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut v = vec![0u8; len];
    for c in v.chunks_mut(8) {
        c.copy_from_slice(&r.next().to_le_bytes()[..c.len()]);
    }
    v
}

/// The gate of the allocation keeps it active while the harness writes or reads it.
fn assert_contents(h: &Harness, addr: u64, want: &[u8], what: &str) {
    h.assert_accessible(
        addr,
        want.len() as u64,
        true,
        &format!("{what}: {addr:#x} not accessible"),
    );
    let got = h.read(addr, want.len());
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: {addr:#x} differs from byte {i} on");
    }
}

struct Shared {
    h: Harness,
    g: u64,
    gates: Vec<RwLock<()>>,
    workers_done: AtomicUsize,
    /// Pauser rounds that paused at least one allocation.
    rounds_nonempty: AtomicUsize,
    requests_served: AtomicUsize,
}

struct Mine {
    addr: u64,
    tag: String,
    data: Vec<u8>,
    backed: bool,
}

impl Shared {
    fn tag_allocs(&self, tag: &str) -> Vec<(u64, u64, State, bool)> {
        self.h
            .e
            .allocations()
            .into_iter()
            .filter(|i| i.tag == tag)
            .map(|i| (i.addr, i.mapped, i.state, i.host_valid))
            .collect()
    }

    /// Pause and resume `w{i}`; the caller holds gate `i` for writing. Returns allocations paused.
    fn pauser_round(&self, i: usize) -> usize {
        let tag = format!("w{i}");
        let before = self.tag_allocs(&tag);
        assert!(
            before.iter().all(|a| a.2 == State::Active),
            "{tag}: a worker leaves its tag active when it releases its gate"
        );
        let r = self.h.e.pause(Some(&tag)).unwrap();
        assert_eq!(r.allocations, before.len(), "{tag}: pause report");
        for (addr, mapped, state, host_valid) in self.tag_allocs(&tag) {
            assert_eq!(state, State::Paused, "{tag}: {addr:#x}");
            assert!(host_valid, "{tag}: {addr:#x} paused with its backup");
            self.h.assert_accessible(addr, mapped, false, &tag);
        }
        let r2 = self.h.e.resume(Some(&tag)).unwrap();
        assert_eq!(r2.allocations, before.len(), "{tag}: resume report");
        for (addr, mapped, state, _) in self.tag_allocs(&tag) {
            assert_eq!(state, State::Active, "{tag}: {addr:#x}");
            self.h.assert_accessible(addr, mapped, true, &tag);
        }
        if r.allocations > 0 {
            self.rounds_nonempty.fetch_add(1, Ordering::Relaxed);
        }
        r.allocations
    }

    fn verify(&self, mine: &[Mine], what: &str) {
        for m in mine {
            assert_contents(&self.h, m.addr, &m.data, &format!("{what} ({})", m.tag));
        }
    }

    fn worker(&self, i: usize, requests: mpsc::Sender<(usize, mpsc::Sender<()>)>) {
        let mut rng = Rng(0xC0FFEE + i as u64 * 7919);
        let (w, n) = (format!("w{i}"), format!("n{i}"));
        for it in 0..ITERS {
            let gate = self.gates[i].read();
            let mut mine = Vec::new();
            let k = 1 + rng.below(3) as usize;
            for j in 0..=k {
                // j == k: the one without backup, in tag n{i}.
                let (tag, backup): (&str, Backup) = if j == k {
                    (&n, None)
                } else if j % 2 == 0 {
                    (&w, Some(BackupKind::Pinned))
                } else {
                    (&w, Some(BackupKind::Mmap))
                };
                let size = 1 + rng.below(3 * self.g);
                let addr = self
                    .h
                    .e
                    .alloc(&AllocRequest {
                        size,
                        device: self.h.device(rng.below(2) as i32),
                        tag: tag.to_string(),
                        backup,
                        chunk: 0,
                    })
                    .unwrap();
                let data = pattern(size as usize, rng.next());
                self.h.write(addr, &data);
                mine.push(Mine {
                    addr,
                    tag: tag.to_string(),
                    data,
                    backed: backup.is_some(),
                });
            }
            self.verify(&mine, "just written");
            drop(gate);

            // Let the pauser in: on request (guaranteed) or by chance (its random rounds).
            if it % REQUEST_EVERY == 0 {
                let (tx, rx) = mpsc::channel();
                requests.send((i, tx)).unwrap();
                rx.recv().unwrap();
            }

            let gate = self.gates[i].read();
            self.verify(&mine, "after the pauser's rounds");

            if it % 2 == 1 {
                // Pause and resume our own tags.
                let r = self.h.e.pause(Some(&w)).unwrap();
                assert_eq!(r.allocations, k, "{w}: own pause");
                self.h.e.pause(Some(&n)).unwrap();
                for m in &mine {
                    self.h
                        .assert_accessible(m.addr, 1, false, &format!("{}: paused", m.tag));
                }
                self.h.e.resume(Some(&n)).unwrap();
                let r = self.h.e.resume(Some(&w)).unwrap();
                assert_eq!(r.allocations, k, "{w}: own resume");
                for m in mine.iter_mut().filter(|m| !m.backed) {
                    // No backup: contents are undefined now; write them again.
                    m.data = pattern(m.data.len(), rng.next());
                    self.h.write(m.addr, &m.data);
                }
                self.verify(&mine, "after own pause/resume");
            }

            for m in &mine {
                // (Not `!owns(addr)` afterwards: another worker may get the address at once.)
                assert!(self.h.e.free(m.addr).unwrap(), "{}: free", m.tag);
            }
            drop(gate);
        }
        self.workers_done.fetch_add(1, Ordering::Release);
    }

    fn pauser(&self, requests: mpsc::Receiver<(usize, mpsc::Sender<()>)>) {
        let mut rng = Rng(0xBADC0DE);
        loop {
            while let Ok((i, ack)) = requests.try_recv() {
                let _g = self.gates[i].write();
                let paused = self.pauser_round(i);
                assert!(paused > 0, "w{i}: a requested round finds the allocations");
                self.requests_served.fetch_add(1, Ordering::Relaxed);
                ack.send(()).unwrap();
            }
            if self.workers_done.load(Ordering::Acquire) == WORKERS {
                break;
            }
            // A random round over 1 to 3 workers, gates taken in ascending order.
            let mut pick: Vec<usize> = (0..1 + rng.below(3))
                .map(|_| rng.below(WORKERS as u64) as usize)
                .collect();
            pick.sort_unstable();
            pick.dedup();
            let guards: Vec<_> = pick.iter().map(|&i| self.gates[i].write()).collect();
            for &i in &pick {
                self.pauser_round(i);
            }
            drop(guards);
            std::thread::yield_now();
        }
    }
}

engine_test! {
    fn workers_and_a_pauser_keep_contents_and_accounting(h)
        [Setup::default().devices(2).capacity(1 << 30).granularity(G)]
    {
        workers_and_a_pauser(h);
    }
}

engine_test! {
    /// The same with retained backups, pauses skipping unchanged memory and resumes checking
    /// what came back (Note [Skipping unchanged memory]): rounds that change nothing skip.
    fn workers_and_a_pauser_skipping_and_verifying(h)
        [Setup::default().devices(2).capacity(1 << 30).granularity(G)]
    {
        h.e.set_retain_cpu_backup(true);
        h.e.set_checks(None, Checks { skip_unchanged: true, verify: true });
        workers_and_a_pauser(h);
    }
}

fn workers_and_a_pauser(h: Harness) {
    let hang_check = h.pick(HANG_CHECK.0, HANG_CHECK.1);
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        // Disconnected: the test failed (panicked) on its own; only a timeout is a hang.
        if let Err(mpsc::RecvTimeoutError::Timeout) =
            done_rx.recv_timeout(Duration::from_secs(hang_check))
        {
            eprintln!("concurrency test: not done after {hang_check} s (deadlock?), aborting");
            std::process::abort();
        }
    });

    let shared = Shared {
        g: h.g(),
        h,
        gates: (0..WORKERS).map(|_| RwLock::new(())).collect(),
        workers_done: AtomicUsize::new(0),
        rounds_nonempty: AtomicUsize::new(0),
        requests_served: AtomicUsize::new(0),
    };
    let (req_tx, req_rx) = mpsc::channel();
    std::thread::scope(|s| {
        let sh = &shared;
        let pauser = s.spawn(move || sh.pauser(req_rx));
        let workers: Vec<_> = (0..WORKERS)
            .map(|i| {
                let tx = req_tx.clone();
                s.spawn(move || sh.worker(i, tx))
            })
            .collect();
        drop(req_tx);
        for w in workers {
            if let Err(p) = w.join() {
                // A worker failed: let the pauser finish, then report the worker's panic.
                sh.workers_done.store(WORKERS, Ordering::Release);
                let _ = pauser.join();
                std::panic::resume_unwind(p);
            }
        }
        pauser.join().expect("pauser thread");
    });

    let requested = WORKERS * ITERS.div_ceil(REQUEST_EVERY);
    assert_eq!(
        shared.requests_served.load(Ordering::Relaxed),
        requested,
        "every requested cross-thread round was served"
    );
    assert!(shared.rounds_nonempty.load(Ordering::Relaxed) >= requested);
    assert!(shared.h.e.allocations().is_empty(), "everything freed");
    shared.h.assert_nothing_held("final accounting");
    let stats = shared.h.e.stats();
    assert!(stats
        .tags
        .iter()
        .all(|t| t.bytes_active == 0 && t.bytes_paused == 0));
    done_tx.send(()).unwrap();
    watchdog.join().unwrap();
}
