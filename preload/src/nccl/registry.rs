//! The communicators the process has, the buffers they registered, and suspending or resuming
//! them all or none (Note [NCCL communicators as a tag] in `mod.rs`).

use parking_lot::{Condvar, Mutex};

use super::library::{version_words, Library, MemStat, SUSPEND_SINCE};
use crate::driver::{DeviceScope, Driver};
use crate::engine::{CommStats, Comms, CommsDone, Registration};
use crate::error::{Changed, Error, Result};

/// One live communicator.
struct Comm {
    handle: usize,
    /// Handed over by the program (`tms_nccl_adopt`), not seen being made.
    adopted: bool,
    suspended: bool,
    /// A call of ours on it runs: its destruction waits for that call.
    busy: bool,
    /// Its numbers as last read (`stats` shows these for one that is busy).
    last: Option<Numbers>,
}

#[derive(Clone, Copy, Default)]
struct Numbers {
    suspendable: u64,
    persistent: u64,
    total: u64,
}

/// One registered buffer.
struct Buffer {
    /// NCCL's handle of the registration (or its window).
    handle: usize,
    comm: usize,
    addr: u64,
    len: u64,
    /// The call that registered it.
    call: &'static str,
    /// Its deregistration answered `ncclInProgress`: it goes once its communicator's queued
    /// calls have ended well, and stays registered if one of them failed.
    leaving: bool,
}

#[derive(Default)]
struct State {
    /// In the order the process made them: the order every rank suspends and resumes them in
    /// (NCCL's calls wait for the communicator's other ranks).
    comms: Vec<Comm>,
    buffers: Vec<Buffer>,
    seen: bool,
}

impl State {
    /// Drop `comm` and its registrations.
    fn forget(&mut self, comm: usize) {
        self.comms.retain(|c| c.handle != comm);
        self.buffers.retain(|b| b.comm != comm);
    }
}

/// The process's communicators over `lib`.
pub struct Communicators {
    lib: Box<dyn Library>,
    state: Mutex<State>,
    /// Signalled when a call of ours on a communicator ends.
    idle: Condvar,
}

impl Communicators {
    /// None known yet.
    pub fn new(lib: Box<dyn Library>) -> Self {
        Communicators {
            lib,
            state: Mutex::new(State::default()),
            idle: Condvar::new(),
        }
    }

    /// NCCL made `comm`.
    pub fn created(&self, comm: usize) {
        if comm == 0 {
            return;
        }
        let mut st = self.state.lock();
        st.seen = true;
        match st.comms.iter_mut().find(|c| c.handle == comm) {
            // Handed over before we saw it made (or made again at the same address).
            Some(c) => c.adopted = false,
            None => st.comms.push(Comm {
                handle: comm,
                adopted: false,
                suspended: false,
                busy: false,
                last: None,
            }),
        }
    }

    /// `comm` is being destroyed or finalized: it leaves, with its registrations, once no call
    /// of ours on it runs.
    pub fn gone(&self, comm: usize) {
        let mut st = self.state.lock();
        while st.comms.iter().any(|c| c.handle == comm && c.busy) {
            self.idle.wait(&mut st);
        }
        st.forget(comm);
    }

    /// `comm` is being aborted: it leaves at once, with its registrations, and no call of ours
    /// starts on it from now on; a call of ours already on it is not waited for, since ending
    /// such a call (a suspend waiting for peers that are gone) is what an abort is for.
    pub fn aborted(&self, comm: usize) {
        self.state.lock().forget(comm);
    }

    /// Whether `comm` is still known (not aborted since it was claimed).
    fn live(&self, comm: usize) -> bool {
        self.state.lock().comms.iter().any(|c| c.handle == comm)
    }

    /// The program hands over the communicators it made where the library could not see them
    /// (PyTorch's process groups in torch mode, NCCL opened by the program itself): they
    /// replace those it handed over before; those seen being made stay as they are.
    pub fn adopt(&self, comms: &[usize]) {
        let mut st = self.state.lock();
        while st.comms.iter().any(|c| c.adopted && c.busy) {
            self.idle.wait(&mut st);
        }
        let dropped: Vec<usize> = st
            .comms
            .iter()
            .filter(|c| c.adopted && !comms.contains(&c.handle))
            .map(|c| c.handle)
            .collect();
        st.comms.retain(|c| !dropped.contains(&c.handle));
        st.buffers.retain(|b| !dropped.contains(&b.comm));
        for &h in comms.iter().filter(|&&h| h != 0) {
            if !st.comms.iter().any(|c| c.handle == h) {
                st.comms.push(Comm {
                    handle: h,
                    adopted: true,
                    suspended: false,
                    busy: false,
                    last: None,
                });
            }
        }
        st.seen |= !comms.is_empty();
    }

    /// `comm` registered `[addr, addr+len)` with `call`, as `handle`.
    pub fn registered(&self, call: &'static str, comm: usize, handle: usize, addr: u64, len: u64) {
        let mut st = self.state.lock();
        st.seen = true;
        st.buffers.retain(|b| b.handle != handle);
        st.buffers.push(Buffer {
            handle,
            comm,
            addr,
            len,
            call,
            leaving: false,
        });
    }

    /// The registration `handle` is no more.
    pub fn deregistered(&self, handle: usize) {
        self.state.lock().buffers.retain(|b| b.handle != handle);
    }

    /// The deregistration of `handle` goes on in the background (a non-blocking communicator
    /// answered `ncclInProgress`): until it is seen to end well the buffer counts as
    /// registered, since unmapping it under a deregistration that then fails would leave NCCL
    /// a registration of memory that is gone.
    pub fn deregistering(&self, handle: usize) {
        let mut st = self.state.lock();
        if let Some(b) = st.buffers.iter_mut().find(|b| b.handle == handle) {
            b.leaving = true;
        }
    }

    /// Mark busy the communicators whose `suspended` is `state`, in order, once no call of
    /// ours runs on any.
    fn claim(&self, suspended: bool) -> Vec<usize> {
        let mut st = self.state.lock();
        while st.comms.iter().any(|c| c.busy) {
            self.idle.wait(&mut st);
        }
        st.comms
            .iter_mut()
            .filter(|c| c.suspended == suspended)
            .map(|c| {
                c.busy = true;
                c.handle
            })
            .collect()
    }

    /// Let go of `claimed`, each suspended where `suspended` says so (unchanged where `None`).
    fn settle(&self, claimed: &[usize], suspended: impl Fn(usize) -> Option<bool>) {
        let mut st = self.state.lock();
        for c in st.comms.iter_mut().filter(|c| claimed.contains(&c.handle)) {
            c.busy = false;
            if let Some(s) = suspended(c.handle) {
                c.suspended = s;
            }
        }
        drop(st);
        self.idle.notify_all();
    }

    /// `f` with `comm`'s device current (where NCCL says which), so that NCCL, which sets
    /// the device it needs and then the one it found, leaves this thread where it was.
    fn on_device<T>(&self, driver: &dyn Driver, comm: usize, f: impl FnOnce() -> T) -> T {
        let _scope = self
            .lib
            .device(comm)
            .and_then(|d| DeviceScope::enter(driver, d).ok());
        f()
    }

    /// Suspend (`pause`) or resume the claimed communicators one by one; on a failure, undo
    /// what this call did and say so.
    fn step(&self, driver: &dyn Driver, pause: bool) -> Result<CommsDone> {
        let todo = self.claim(!pause);
        if todo.is_empty() {
            self.settle(&todo, |_| None);
            return Ok(CommsDone::default());
        }
        if let Some(why) = self.unsupported() {
            self.settle(&todo, |_| None);
            return Err(Error::unsupported(why).unchanged());
        }
        let (call, undo): (Call, Call) = if pause {
            (|l, c| l.suspend(c), |l, c| l.resume(c))
        } else {
            (|l, c| l.resume(c), |l, c| l.suspend(c))
        };
        // Each communicator this call changed, with its bytes.
        let mut done: Vec<(usize, u64)> = Vec::new();
        let mut bytes = 0;
        for (i, &c) in todo.iter().enumerate() {
            if !self.live(c) {
                continue;
            }
            let r = self.on_device(driver, c, || {
                let b = self.lib.mem_stat(c, MemStat::Suspendable).unwrap_or(0);
                call(&*self.lib, c).map(|()| b)
            });
            match r {
                Ok(b) => {
                    done.push((c, b));
                    bytes += b;
                }
                Err(e) => {
                    let failed: Vec<(usize, Error)> = done
                        .iter()
                        .filter(|&&(d, _)| self.live(d))
                        .filter_map(|&(d, _)| {
                            self.on_device(driver, d, || undo(&*self.lib, d))
                                .err()
                                .map(|e| (d, e))
                        })
                        .collect();
                    // Those whose undo failed are left changed.
                    let left = Changed {
                        allocations: 0,
                        bytes: done
                            .iter()
                            .filter(|(d, _)| failed.iter().any(|f| f.0 == *d))
                            .map(|(_, b)| b)
                            .sum(),
                        communicators: failed.len(),
                    };
                    // Those whose undo failed stay as this call left them.
                    self.settle(&todo, |h| failed.iter().any(|f| f.0 == h).then_some(pause));
                    let what = if pause { "suspending" } else { "resuming" };
                    return Err(e
                        .context(format!(
                            "{what} communicator {c:#x} ({} of {})",
                            i + 1,
                            todo.len()
                        ))
                        .note(undone(pause, done.len(), &failed))
                        .with_changed(left));
                }
            }
        }
        self.settle(&todo, |_| Some(pause));
        Ok(CommsDone {
            communicators: done.len(),
            bytes,
        })
    }
}

/// A suspend or a resume of one communicator.
type Call = fn(&dyn Library, usize) -> Result<()>;

/// What the undo of a failed step did, in words.
fn undone(pause: bool, n: usize, failed: &[(usize, Error)]) -> String {
    let (did, undo, left) = if pause {
        (
            "suspended",
            "resumed",
            "suspended (resume the tag to try again)",
        )
    } else {
        ("resumed", "suspended again", "resumed")
    };
    if n == 0 {
        return format!("no communicator was {did} by this call");
    }
    if failed.is_empty() {
        return match n {
            1 => format!("the communicator it had {did} was {undo}"),
            _ => format!("the {n} communicators it had {did} were {undo}"),
        };
    }
    let each: Vec<String> = failed
        .iter()
        .map(|(c, e)| format!("communicator {c:#x}: {e}"))
        .collect();
    format!(
        "of the {n} communicators it had {did}, {} could not be {undo} and stay {left}: {}",
        failed.len(),
        each.join("; ")
    )
}

impl Comms for Communicators {
    fn seen(&self) -> bool {
        self.state.lock().seen
    }

    fn unsupported(&self) -> Option<String> {
        if self.lib.can_suspend() {
            return None;
        }
        Some(match self.lib.version() {
            Some(v) => format!(
                "NCCL {} has no ncclCommSuspend (needs \u{2265} {SUSPEND_SINCE})",
                version_words(v)
            ),
            None => format!(
                "no NCCL library with ncclCommSuspend is loaded (needs \u{2265} {SUSPEND_SINCE})"
            ),
        })
    }

    fn registrations(&self) -> Vec<Registration> {
        let mut st = self.state.lock();
        // Deregistrations in the background are asked about under the lock, so that the
        // communicator cannot end meanwhile (its end waits for the lock before NCCL's call).
        let mut asked: Vec<(usize, Option<bool>)> = Vec::new();
        for b in st.buffers.iter_mut().filter(|b| b.leaving) {
            let now = match asked.iter().find(|(c, _)| *c == b.comm) {
                Some(&(_, now)) => now,
                None => {
                    let now = self.lib.settled(b.comm);
                    asked.push((b.comm, now));
                    now
                }
            };
            // A failed call: the deregistration may be what failed, so the buffer stays.
            b.leaving = now.is_some();
        }
        st.buffers
            .retain(|b| !(b.leaving && asked.contains(&(b.comm, Some(true)))));
        st.buffers
            .iter()
            .map(|b| Registration {
                addr: b.addr,
                len: b.len,
                how: format!("{} on communicator {:#x}", b.call, b.comm),
            })
            .collect()
    }

    fn suspend(&self, driver: &dyn Driver) -> Result<CommsDone> {
        self.step(driver, true)
    }

    fn resume(&self, driver: &dyn Driver) -> Result<CommsDone> {
        self.step(driver, false)
    }

    fn stats(&self, driver: &dyn Driver) -> Option<CommStats> {
        let unsupported = self.unsupported();
        // Those a call of ours is on show their last numbers: a status never waits for one.
        let free: Vec<usize> = {
            let mut st = self.state.lock();
            if !st.seen {
                return None;
            }
            st.comms
                .iter_mut()
                .filter(|c| !c.busy)
                .map(|c| {
                    c.busy = unsupported.is_none();
                    c.handle
                })
                .collect()
        };
        let mut error = None;
        let mut read = Vec::new();
        if unsupported.is_none() {
            for &c in free.iter().filter(|&&c| self.live(c)) {
                let n = self.on_device(driver, c, || -> Result<Numbers> {
                    Ok(Numbers {
                        suspendable: self.lib.mem_stat(c, MemStat::Suspendable)?,
                        persistent: self.lib.mem_stat(c, MemStat::Persistent)?,
                        total: self.lib.mem_stat(c, MemStat::Total)?,
                    })
                });
                match n {
                    Ok(n) => read.push((c, n)),
                    Err(e) => {
                        error.get_or_insert_with(|| e.to_string());
                    }
                }
            }
            self.settle(&free, |_| None);
        }
        let version = self.lib.version().map(version_words);
        let mut st = self.state.lock();
        for (h, n) in read {
            if let Some(c) = st.comms.iter_mut().find(|c| c.handle == h) {
                c.last = Some(n);
            }
        }
        let mut s = CommStats {
            version,
            unsupported,
            communicators: st.comms.len(),
            error,
            registered_buffers: st.buffers.len(),
            registered_bytes: st.buffers.iter().map(|b| b.len).sum(),
            ..Default::default()
        };
        for c in &st.comms {
            let n = c.last.unwrap_or_default();
            s.suspendable_bytes += n.suspendable;
            s.persistent_bytes += n.persistent;
            s.total_bytes += n.total;
            if c.suspended {
                s.suspended += 1;
                s.suspended_bytes += n.suspendable;
            }
        }
        drop(st);
        Some(s)
    }
}

/// The registry under a test library whose calls fail where told.
#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::driver::sim::{SimConfig, SimDriver};

    #[derive(Default)]
    struct Fake {
        /// The n-th suspend (from 1) fails; 0: none.
        fail_suspend: usize,
        fail_resume: usize,
        absent: bool,
        suspends: AtomicUsize,
        resumes: AtomicUsize,
        log: Mutex<Vec<String>>,
        /// What `settled` answers.
        settled: Mutex<Option<bool>>,
    }

    impl Library for Arc<Fake> {
        fn version(&self) -> Option<i32> {
            Some(if self.absent { 22105 } else { 22907 })
        }
        fn can_suspend(&self) -> bool {
            !self.absent
        }
        fn suspend(&self, comm: usize) -> Result<()> {
            let n = self.suspends.fetch_add(1, Ordering::SeqCst) + 1;
            self.log.lock().push(format!("suspend {comm}"));
            if n == self.fail_suspend {
                return Err(Error::driver("ncclCommSuspend", 5, "ncclInvalidUsage", "x"));
            }
            Ok(())
        }
        fn resume(&self, comm: usize) -> Result<()> {
            let n = self.resumes.fetch_add(1, Ordering::SeqCst) + 1;
            self.log.lock().push(format!("resume {comm}"));
            if n == self.fail_resume {
                return Err(Error::driver("ncclCommResume", 3, "ncclInternalError", "x"));
            }
            Ok(())
        }
        fn mem_stat(&self, _: usize, stat: MemStat) -> Result<u64> {
            Ok(match stat {
                MemStat::Suspendable => 100,
                MemStat::Persistent => 10,
                MemStat::Total => 110,
            })
        }
        fn device(&self, _: usize) -> Option<i32> {
            Some(0)
        }
        fn settled(&self, comm: usize) -> Option<bool> {
            self.log.lock().push(format!("settled {comm}"));
            *self.settled.lock()
        }
    }

    fn setup(f: Fake) -> (Arc<Fake>, Communicators, SimDriver) {
        let f = Arc::new(f);
        let c = Communicators::new(Box::new(f.clone()));
        let sim = SimDriver::new(SimConfig {
            devices: 1,
            capacity: 64 << 20,
            granularity: 2 << 20,
        })
        .unwrap();
        (f, c, sim)
    }

    #[test]
    fn a_failure_on_the_second_communicator_resumes_the_first() {
        let (f, c, d) = setup(Fake {
            fail_suspend: 2,
            ..Default::default()
        });
        for h in [30, 10, 20] {
            c.created(h);
        }
        let e = c.suspend(&d).unwrap_err();
        assert_eq!(e.changed(), Some(Changed::NOTHING), "all undone");
        let e = e.to_string();
        assert!(e.contains("suspending communicator 0xa (2 of 3)"), "{e}");
        assert!(
            e.contains("the communicator it had suspended was resumed"),
            "{e}"
        );
        // In the order they were made, and the first undone.
        assert_eq!(*f.log.lock(), ["suspend 30", "suspend 10", "resume 30"]);
        let s = c.stats(&d).unwrap();
        assert_eq!((s.communicators, s.suspended), (3, 0));
        // Nothing is left busy: the next attempt runs, and succeeds.
        let done = c.suspend(&d).unwrap();
        assert_eq!((done.communicators, done.bytes), (3, 300));
        assert_eq!(c.stats(&d).unwrap().suspended_bytes, 300);
        assert_eq!(
            c.suspend(&d).unwrap(),
            CommsDone::default(),
            "all suspended already"
        );
        assert_eq!(c.resume(&d).unwrap().communicators, 3);
    }

    #[test]
    fn a_failed_undo_leaves_that_one_suspended_and_says_so() {
        let (_, c, d) = setup(Fake {
            fail_suspend: 3,
            fail_resume: 1,
            ..Default::default()
        });
        for h in [1, 2, 3] {
            c.created(h);
        }
        let e = c.suspend(&d).unwrap_err();
        let left = Changed {
            allocations: 0,
            bytes: 100,
            communicators: 1,
        };
        assert_eq!(e.changed(), Some(left), "the one left suspended");
        let e = e.to_string();
        assert!(
            e.contains("1 could not be resumed and stay suspended"),
            "{e}"
        );
        assert_eq!(c.stats(&d).unwrap().suspended, 1);
        // A resume brings it back.
        assert_eq!(c.resume(&d).unwrap().communicators, 1);
    }

    #[test]
    fn a_failed_resume_suspends_again_those_it_resumed() {
        let (_, c, d) = setup(Fake {
            fail_resume: 2,
            ..Default::default()
        });
        c.created(1);
        c.created(2);
        c.suspend(&d).unwrap();
        let e = c.resume(&d).unwrap_err().to_string();
        assert!(e.contains("resuming communicator 0x2 (2 of 2)"), "{e}");
        assert!(e.contains("was suspended again"), "{e}");
        assert_eq!(c.stats(&d).unwrap().suspended, 2);
    }

    #[test]
    fn without_suspend_the_tag_names_the_version_and_changes_nothing() {
        let (f, c, d) = setup(Fake {
            absent: true,
            ..Default::default()
        });
        assert!(!c.seen());
        assert_eq!(c.stats(&d), None, "no entry before a communicator");
        c.created(5);
        let why = c.unsupported().unwrap();
        assert_eq!(
            why,
            "NCCL 2.21.5 has no ncclCommSuspend (needs \u{2265} 2.29.7)"
        );
        let e = c.suspend(&d).unwrap_err();
        assert_eq!(e.changed(), Some(Changed::NOTHING));
        let e = e.to_string();
        assert!(e.contains(&why), "{e}");
        assert!(f.log.lock().is_empty());
        let s = c.stats(&d).unwrap();
        assert_eq!(s.unsupported.as_deref(), Some(why.as_str()));
        assert_eq!(s.communicators, 1);
    }

    #[test]
    fn destroyed_and_replaced_communicators_leave_with_their_buffers() {
        let (_, c, d) = setup(Fake::default());
        c.created(1);
        c.adopt(&[2, 3]);
        c.registered("ncclCommRegister", 1, 100, 0x1000, 64);
        c.registered("ncclCommWindowRegister", 3, 101, 0x2000, 32);
        assert_eq!(c.registrations().len(), 2);
        c.gone(1);
        assert_eq!(c.registrations().len(), 1);
        c.adopt(&[2]);
        assert!(c.registrations().is_empty(), "3 was not handed over again");
        assert_eq!(c.stats(&d).unwrap().communicators, 1);
        c.registered("ncclCommRegister", 2, 102, 0x3000, 8);
        c.deregistered(102);
        assert!(c.registrations().is_empty());
        // Handed over and then seen made: it stays when the program hands over none.
        c.adopt(&[4]);
        c.created(4);
        c.adopt(&[]);
        assert_eq!(c.stats(&d).unwrap().communicators, 1);
    }

    /// A deregistration answered `ncclInProgress` keeps its buffer registered while its
    /// communicator's calls run, drops it once they ended well, and keeps it for good (as
    /// registered) when one failed; communicators are asked once each, and only about those.
    #[test]
    fn a_deregistration_in_the_background_counts_once_it_ended_well() {
        let (f, c, _) = setup(Fake::default());
        c.created(1);
        c.created(2);
        c.registered("ncclCommRegister", 1, 100, 0x1000, 64);
        c.registered("ncclCommRegister", 1, 101, 0x2000, 64);
        c.registered("ncclCommRegister", 2, 102, 0x3000, 64);
        c.deregistering(100);
        c.deregistering(101);
        *f.settled.lock() = Some(false);
        assert_eq!(
            c.registrations().len(),
            3,
            "still running: still registered"
        );
        assert_eq!(
            *f.log.lock(),
            ["settled 1"],
            "one question per communicator"
        );
        *f.settled.lock() = Some(true);
        let left: Vec<u64> = c.registrations().iter().map(|r| r.addr).collect();
        assert_eq!(left, [0x3000], "ended well: gone");
        f.log.lock().clear();
        c.registrations();
        assert!(f.log.lock().is_empty(), "nothing left to ask about");

        c.registered("ncclCommRegister", 2, 103, 0x4000, 64);
        c.deregistering(103);
        *f.settled.lock() = None;
        assert_eq!(c.registrations().len(), 2, "a failure: it stays registered");
        *f.settled.lock() = Some(true);
        assert_eq!(
            c.registrations().len(),
            2,
            "and is not taken for gone later"
        );
        c.deregistered(103);
        assert_eq!(c.registrations().len(), 1);
    }
}
