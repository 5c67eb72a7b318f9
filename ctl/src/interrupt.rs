//! Ctrl-C during `--atomic`: the first SIGINT is taken as the failure of the operation under way
//! (so that what was done is undone, and said so), not as the end of tmsctl, which would leave
//! the processes done so far changed with nothing said; a second one ends tmsctl.

use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Take the next SIGINT (its default action comes back with it, for a second one).
pub fn catch() {
    let act = SigAction::new(
        SigHandler::Handler(on_sigint),
        SaFlags::SA_RESETHAND | SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    if let Err(e) = unsafe { sigaction(Signal::SIGINT, &act) } {
        tell!("tmsctl: Ctrl-C will end tmsctl at once (catching it failed: {e})");
    }
}

/// Whether a SIGINT came since the last call (taken: the next call says false until another).
pub fn taken() -> bool {
    INTERRUPTED.swap(false, Ordering::SeqCst)
}
