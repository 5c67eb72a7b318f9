//! The server over a real socket: the accept loop, idle and slow clients, a full server,
//! concurrent clients, stale sockets, and a private folder and socket whatever the umask.

use super::*;

#[test]
fn the_accept_loop_serves_one_client_after_another() {
    let h = host();
    let base = std::env::temp_dir().join(format!("tms-serve-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    dir::prepare(&base, sys::euid()).unwrap();
    let (listener, path) = dir::bind(&base, 4_000_001).unwrap();
    std::thread::spawn(move || serve(&listener, h, limits(), me()));

    // A silent client holds the thread only until its timeout.
    let _silent = UnixStream::connect(&path).unwrap();
    let t = Instant::now();
    for _ in 0..3 {
        let s = UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut w = s;
        w.write_all(&encode(&Request::Hello(hello(PROTOCOL_VERSION))))
            .unwrap();
        w.write_all(&encode(&Request::Ping)).unwrap();
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        assert!(
            matches!(decode_reply(l.as_bytes()), Ok(Reply::Hello(_))),
            "{l}"
        );
        l.clear();
        r.read_line(&mut l).unwrap();
        assert!(
            matches!(decode_reply(l.as_bytes()), Ok(Reply::Pong { .. })),
            "{l}"
        );
    }
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn idle_connections_and_a_slow_client_never_delay_a_newcomer() {
    // The production limits: 2 s per request line, 64 connections at once.
    let h = host();
    let (base, path) = server_in(h, "flood", "4000100.1.sock", Limits::default());

    // A slow client: a ping every 1.5 s, each within the 2 s allowed (on a single server
    // thread it held every other client off for as long as it went on).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let slow = {
        let (path, stop) = (path.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut c = Client::greeted(&path);
            let mut pongs = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1500));
                match c.ask(&Request::Ping) {
                    Some(Reply::Pong { .. }) => pongs += 1,
                    _ => break,
                }
            }
            pongs
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    // 200 connections that say nothing (on a single thread: 2 s each, 400 s in all).
    let idle: Vec<UnixStream> = (0..200)
        .map(|_| UnixStream::connect(&path).unwrap())
        .collect();

    // Newcomers over the next 4 s (while the idle ones are open, as they time out, after):
    // each is answered at once.
    let mut worst = Duration::ZERO;
    for _ in 0..8 {
        worst = worst.max(fresh_ping(&path));
        std::thread::sleep(Duration::from_millis(500));
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let pongs = slow.join().unwrap();
    assert!(
        worst < Duration::from_secs(1),
        "a newcomer waited {worst:?}"
    );
    // The slow client itself was served all along: the idle ones (no hello) gave way first.
    assert!(pongs >= 2, "{pongs} pongs");
    drop(idle);
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_full_server_answers_busy_and_idle_connections_make_room() {
    let h = host();
    let l = Limits {
        max_connections: 2,
        request_timeout: Duration::from_secs(5),
        write_timeout: Duration::from_secs(5),
        ..limits()
    };
    let (base, path) = server_in(h, "cap", "4000101.1.sock", l);

    // Two connections serving requests that take long (get_region waits for the gate).
    let gate = h.gate.lock();
    let mut a = Client::greeted(&path);
    let mut b = Client::greeted(&path);
    a.w.write_all(&encode(&Request::GetRegion)).unwrap();
    b.w.write_all(&encode(&Request::GetRegion)).unwrap();
    let t = Instant::now();
    while h.at_gate.load(std::sync::atomic::Ordering::SeqCst) < 2 {
        assert!(t.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(5));
    }

    // A third is refused at once with `busy`, and closed.
    let t = Instant::now();
    let mut c = Client::connect(&path);
    let r = c.reply().expect("a busy reply");
    assert_eq!(error_kind(&r), ErrorKind::Busy);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(ErrorKind::Busy.closes_connection());
    c.assert_closed();

    // Both requests complete; a and b wait again, a longer (b has just had a ping served).
    drop(gate);
    assert!(matches!(a.reply(), Some(Reply::Region(_))));
    assert!(matches!(b.reply(), Some(Reply::Region(_))));
    std::thread::sleep(Duration::from_millis(50));
    assert!(matches!(b.ask(&Request::Ping), Some(Reply::Pong { .. })));

    // A newcomer that has not said hello yet (e) makes room by closing the idle connection
    // that waited longest (a), which gets `busy`; b is still served.
    let mut e = Client::connect(&path);
    let r = a.reply().expect("a busy reply");
    assert_eq!(error_kind(&r), ErrorKind::Busy, "{r:?}");
    let Reply::Error(m) = &r else { panic!() };
    assert!(m.message.contains("waited longest of the 2"), "{m:?}");
    a.assert_closed();

    // Now b (greeted) and e (not yet): the next newcomer closes e, the one without a hello,
    // although b has waited longer.
    let t = Instant::now();
    let took = fresh_ping(&path);
    assert!(took < Duration::from_secs(1), "{took:?}");
    let r = e.reply().expect("a busy reply");
    assert_eq!(error_kind(&r), ErrorKind::Busy);
    // Its notice says why it was chosen: not that it waited longest, which b did.
    let Reply::Error(m) = &r else { panic!() };
    assert!(
        m.message.contains("this connection, one of the 2 this process serves at once, had not sent its hello yet, and was closed")
            && !m.message.contains("longest"),
        "{m:?}"
    );
    e.assert_closed();
    assert!(matches!(b.ask(&Request::Ping), Some(Reply::Pong { .. })));
    assert!(t.elapsed() < Duration::from_secs(2));
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_drip_feeding_client_is_closed_after_its_waiting_time() {
    let h = host();
    let mut c = Conn::open(
        h,
        Limits {
            max_idle_total: Duration::from_millis(700),
            ..limits()
        },
    );
    assert!(matches!(
        c.ask(&Request::Hello(hello(PROTOCOL_VERSION))),
        Reply::Hello(_)
    ));
    // Each ping comes within the 300 ms per request, but they add up.
    let t = Instant::now();
    let mut pongs = 0;
    let last = loop {
        std::thread::sleep(Duration::from_millis(200));
        // The server may have given up already: its reply is there to read all the same.
        let _ = c.stream.write_all(&encode(&Request::Ping));
        match c.read_reply() {
            Reply::Pong { .. } => pongs += 1,
            other => break other,
        }
        assert!(pongs < 10, "still open after {pongs} pings");
    };
    assert_eq!(error_kind(&last), ErrorKind::Timeout);
    let Reply::Error(e) = last else { panic!() };
    assert!(e.message.contains("in all"), "{}", e.message);
    assert!((2..=4).contains(&pongs), "{pongs} pongs");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    c.assert_closed();
}

/// A reply must be taken within the write timeout in all: a client that takes a little of a
/// long reply before each send would time out (16 KiB every 200 ms, the timeout 300 ms) does not
/// keep the server sending, and holding its place, for as long as the reply lasts; the reply is
/// cut and the connection closed.
#[test]
fn a_slow_reader_cannot_stretch_a_reply_past_the_write_timeout() {
    let h = host();
    // A status of about 1 MiB: 800 tags of about 1 KiB.
    for i in 0..800 {
        h.alloc(4096, &format!("{i:04}{}", "t".repeat(1000)), None);
    }
    let mut c = Conn::greeted_with(h, limits());
    c.send_raw(&encode(&Request::Status));
    let t = Instant::now();
    let mut buf = vec![0u8; 16 << 10];
    let (mut got, mut whole) = (0usize, false);
    while t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(200));
        let n = c.stream.read(&mut buf).unwrap_or(0);
        got += n;
        whole = n > 0 && buf[..n].ends_with(b"\n");
        if n == 0 || whole {
            break;
        }
    }
    assert!(
        !whole,
        "the server sent the whole reply ({got} bytes) to a slow reader over {:?}",
        t.elapsed()
    );
    assert!(got > 0, "nothing of the reply came");
}

/// Replies must be taken within the write time in all: a client that sends its requests at once
/// and takes each reply well before the write timeout would run out (150 ms, the timeout 1 s) is
/// closed once the server has waited for it 1.5 s in all, not served all it asked for (20
/// statuses of about 1 MiB each: no socket buffer holds one whole; all 20 wait about 3 s).
#[test]
fn a_slow_reader_of_many_replies_is_closed_after_its_writing_time() {
    let h = host();
    for i in 0..800 {
        h.alloc(4096, &format!("{i:04}{}", "t".repeat(1000)), None);
    }
    let mut c = Conn::greeted_with(
        h,
        Limits {
            write_timeout: Duration::from_secs(1),
            max_write_total: Duration::from_millis(1500),
            ..limits()
        },
    );
    let asked = 20;
    for _ in 0..asked {
        c.send_raw(&encode(&Request::Status));
    }
    let t = Instant::now();
    let mut replies = 0;
    loop {
        std::thread::sleep(Duration::from_millis(150));
        let mut line = String::new();
        if c.reader.read_line(&mut line).unwrap_or(0) == 0 || !line.ends_with('\n') {
            break;
        }
        match decode_reply(line.as_bytes()) {
            Ok(Reply::Status(_)) => replies += 1,
            // Served every request, the server waits for the next: it replies that none came.
            _ => break,
        }
    }
    assert!(
        (1..asked).contains(&replies),
        "{replies} of {asked} replies taken over {:?}",
        t.elapsed()
    );
    c.assert_closed();
}

#[test]
fn concurrent_pauses_from_several_clients_are_safe() {
    let h = host();
    let mut ptrs = Vec::new();
    for i in 0..4u8 {
        let p = h.alloc(1 << 20, "kv", Some(BackupKind::Mmap));
        h.engine.write_bytes(p, &[i; 64]).unwrap();
        ptrs.push(p);
    }
    let (base, path) = server_in(h, "concurrent", "4000102.1.sock", limits());
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let path = path.clone();
            std::thread::spawn(move || {
                let mut c = Client::greeted(&path);
                for _ in 0..5 {
                    for r in [pause(Some("kv".into())), resume(None)] {
                        let reply = c.ask(&r);
                        assert!(matches!(reply, Some(Reply::Done(_))), "{reply:?}");
                    }
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    let s = h.engine.stats();
    assert_eq!(s.tags.len(), 1);
    assert_eq!(s.tags[0].active_allocations, 4);
    for (i, p) in ptrs.iter().enumerate() {
        let mut back = [0u8; 64];
        h.engine.read_bytes(*p, &mut back).unwrap();
        assert_eq!(back, [i as u8; 64]);
    }
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_starting_server_removes_only_sockets_nobody_listens_on() {
    let h = host();
    let base = std::env::temp_dir().join(format!("tms-srv-{}-stale", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    dir::prepare(&base, sys::euid()).unwrap();
    // A live server of another pid namespace sharing the folder: the pid in its name does not
    // exist in ours (kill(pid, 0) said "dead" and its socket was removed).
    let (_live, live) = dir::bind_as(&base, "2147483000.4026530000.sock").unwrap();
    // Nobody listens on this one, though its pid (1) exists here: it goes.
    let (l, dead) = dir::bind_as(&base, "1.4026530001.sock").unwrap();
    drop(l);
    let (_, path) = start_in(h, &base, "4000103.1.sock", limits());
    // Served once the cleaning is over (it runs first on the server thread).
    assert!(fresh_ping(&path) < Duration::from_secs(2));
    assert!(live.exists(), "a live listener's socket was removed");
    assert!(!dead.exists(), "a socket nobody listens on was kept");
    assert!(path.exists());
    std::fs::remove_dir_all(&base).unwrap();
}

#[test]
fn a_restrictive_umask_still_gives_a_usable_private_folder_and_socket() {
    in_child("control::tests::server::restrictive_umask_child");
}

/// The work of the test above; does nothing unless run as its child.
#[test]
fn restrictive_umask_child() {
    use nix::sys::stat::{umask, Mode};
    if std::env::var_os("TMS_TEST_CHILD").is_none() {
        return;
    }
    let h = host();
    for mask in [0o777, 0o077, 0o277, 0o577, 0o700] {
        let base = std::env::temp_dir().join(format!("tms-umask-{}-{mask:o}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let folder = base.join("a/b");
        let old = umask(Mode::from_bits_truncate(mask));
        let r = dir::prepare(&folder, sys::euid())
            .map(|()| start_in(h, &folder, "4000104.1.sock", limits()));
        umask(old);
        let (_, path) = r.unwrap_or_else(|e| panic!("umask {mask:04o}: {e}"));
        for d in [&base, &base.join("a"), &folder] {
            let m = std::fs::symlink_metadata(d).unwrap().permissions().mode() & 0o777;
            assert_eq!(m, 0o700, "umask {mask:04o}: {}", d.display());
        }
        let m = std::fs::symlink_metadata(&path)
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(m, 0o600, "umask {mask:04o}: the socket");
        assert!(fresh_ping(&path) < Duration::from_secs(2));
        std::fs::remove_dir_all(&base).unwrap();
    }
}

/// No server in a folder whose parent others can write to (0777, no sticky bit): they could
/// swap the folder for their own after the check, and our socket would be bound, and clients
/// would connect, in a folder they control. The refusal, as logged, names that parent; nothing
/// is made or bound there. With the sticky bit (like /tmp), the server starts and answers.
#[test]
fn no_server_in_a_folder_below_one_anyone_can_write_to() {
    let h = host();
    let tmp = tempfile::tempdir().unwrap();
    let shared = tmp.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let folder = shared.join("tms");
    let name = "4000105.1.sock";
    let e = match listen_in(&folder, sys::euid(), name) {
        Ok((_, path)) => panic!("a server listens in {}", path.display()),
        Err(e) => NoSocket::from(e),
    };
    assert_eq!(
        e.to_string(),
        format!(
            "refusing the socket folder {}: its ancestor {} has mode 0777: group and others can \
             write to it without the sticky bit, so they could move what is in it away and put \
             their own in its place",
            folder.display(),
            shared.display()
        )
    );
    assert!(std::fs::symlink_metadata(&folder).is_err(), "made anyway");

    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let (_, path) = start_in(h, &folder, name, limits());
    assert!(fresh_ping(&path) < Duration::from_secs(2));
}

/// Why there is no socket, in the words the log and `tms_control_socket` have always used.
#[test]
fn no_socket_reasons_keep_their_words() {
    let failed: NoSocket = Error::io(
        "cannot start the control thread",
        std::io::Error::from_raw_os_error(libc::EAGAIN),
    )
    .into();
    let cases = [
        (
            NoSocket::NotStarted,
            "the control server has not started (the library has not started)".to_string(),
        ),
        (NoSocket::Disabled, "disabled by TMS_CONTROL=0".to_string()),
        (
            NoSocket::Panicked,
            "starting the control server panicked (a bug)".to_string(),
        ),
        (
            failed,
            format!(
                "cannot start the control thread: {}",
                std::io::Error::from_raw_os_error(libc::EAGAIN)
            ),
        ),
    ];
    for (why, want) in cases {
        assert_eq!(why.to_string(), want);
    }
}

/// The inode of the file `fd` is open on.
fn inode_of(fd: i32) -> u64 {
    // SAFETY: a borrow of a descriptor the caller holds open for the call.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    nix::sys::stat::fstat(fd).unwrap().st_ino
}

/// Fork in a child that reports, by its exit status, whether `fd` is open there on the file
/// of inode `ino` (1) or not (0); that status. The child calls only async-signal-safe functions.
fn fork_and_look_for(fd: i32, ino: u64) -> i32 {
    // SAFETY: the child only calls fstat and _exit (async-signal-safe) before it ends.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
        // SAFETY: fstat writes into `st`, a place of the right type and size.
        let same = unsafe { libc::fstat(fd, st.as_mut_ptr()) } == 0
            // SAFETY: fstat succeeded and filled `st`.
            && unsafe { st.assume_init() }.st_ino == ino;
        // SAFETY: ends the child at once, running nothing of the parent's.
        unsafe { libc::_exit(i32::from(same)) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked; `status` is a valid place to write to.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status),
        "the child did not exit: {status:#x}"
    );
    libc::WEXITSTATUS(status)
}

/// Held by each test that sets the window hook (there is one for the process).
static WINDOW_TESTS: Mutex<()> = Mutex::new(());

/// Make the window hook fork, from another thread, while the server is in `window` with a
/// connection that `ours` picks: the hook gives the thread 300 ms to fork, then goes on. The
/// thread's result, [`fork_and_look_for`] of that connection, comes on the channel.
fn fork_in_window(
    window: sys::Window,
    ours: impl Fn(&UnixStream) -> bool + Send + Sync + 'static,
) -> std::sync::mpsc::Receiver<std::thread::JoinHandle<i32>> {
    sys::register_handlers();
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = parking_lot::Mutex::new(tx);
    *sys::WINDOW_HOOK.lock() = Some(Arc::new(move |s: &UnixStream, w: sys::Window| {
        if w != window || !ours(s) {
            return;
        }
        let fd = std::os::fd::AsRawFd::as_raw_fd(s);
        let ino = inode_of(fd);
        let forker = std::thread::spawn(move || fork_and_look_for(fd, ino));
        let t = Instant::now();
        while !forker.is_finished() && t.elapsed() < Duration::from_millis(300) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = tx.lock().send(forker);
    }));
    rx
}

/// Whether the fork [`fork_in_window`] made left its child the connection (it must not: a
/// child that keeps the server's end of a client's connection keeps it alive after the parent
/// closed it or died, and the client waits for a reply that never comes instead of seeing the
/// end).
fn child_kept_it(rx: std::sync::mpsc::Receiver<std::thread::JoinHandle<i32>>) -> bool {
    let forker = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the window");
    *sys::WINDOW_HOOK.lock() = None;
    forker.join().unwrap() == 1
}

/// Another thread of the host forks while the server has just accepted a connection and not yet
/// recorded it for fork children: the child has no copy of it (the fork waits for the record).
#[test]
fn a_fork_as_a_connection_is_accepted_leaves_the_child_no_copy_of_it() {
    let _one_at_a_time = WINDOW_TESTS.lock();
    let (base, path) = server_in(host(), "fork-accept", "fork.sock", limits());
    let folder = base.clone();
    // This test's server only (it was bound at a temporary name in its folder).
    let rx = fork_in_window(sys::Window::Accepted, move |s| {
        let here = s.local_addr().ok();
        here.as_ref().and_then(|a| a.as_pathname()?.parent()) == Some(folder.as_path())
    });
    let _client = UnixStream::connect(&path).unwrap();
    assert!(
        !child_kept_it(rx),
        "the child holds the connection accepted as it forked"
    );
    std::fs::remove_dir_all(&base).unwrap();
}

/// The same as a connection closes, between its record forgotten and its close: the child has
/// no copy of it (the fork waits for the close).
#[test]
fn a_fork_as_a_connection_closes_leaves_the_child_no_copy_of_it() {
    let _one_at_a_time = WINDOW_TESTS.lock();
    let (a, _peer) = UnixStream::pair().unwrap();
    let ino = inode_of(std::os::fd::AsRawFd::as_raw_fd(&a));
    let rx = fork_in_window(sys::Window::Closing, move |s| {
        inode_of(std::os::fd::AsRawFd::as_raw_fd(s)) == ino
    });
    let table = conns::Table::new(4);
    let ticket = table.admit(sys::Tracked::new(a)).ok().unwrap();
    drop(ticket);
    assert!(
        !child_kept_it(rx),
        "the child holds the connection closed as it forked"
    );
}

/// A listener shut down for reading (by any holder of a copy) is ready for ever to `poll`, and a
/// non-blocking accept on it says `EAGAIN`: the accept loop must back off as it does on any
/// accept failure, not spin on a core of the host.
#[test]
fn an_accept_loop_on_a_listener_shut_down_does_not_spin() {
    let h = host();
    let base = std::env::temp_dir().join(format!("tms-serve-shut-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    dir::prepare(&base, sys::euid()).unwrap();
    let (listener, _path) = dir::bind(&base, 4_000_002).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
    nix::sys::socket::shutdown(fd, nix::sys::socket::Shutdown::Read).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: pthread_self has no preconditions.
        tx.send(unsafe { libc::pthread_self() }).unwrap();
        serve(&listener, h, limits(), me())
    });
    let thread = rx.recv().unwrap();
    let mut clock: libc::clockid_t = 0;
    // SAFETY: `thread` never ends (`serve` loops for ever), so its id stays valid; `clock` is a
    // valid place to write to.
    let r = unsafe { libc::pthread_getcpuclockid(thread, &mut clock) };
    assert_eq!(r, 0);
    let cpu = || {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid place to write to; `clock` is the thread's CPU clock.
        assert_eq!(unsafe { libc::clock_gettime(clock, &mut ts) }, 0);
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    };
    std::thread::sleep(Duration::from_millis(200));
    let (used_before, t) = (cpu(), Instant::now());
    std::thread::sleep(Duration::from_secs(1));
    let (used, over) = (cpu() - used_before, t.elapsed());
    assert!(
        used < over / 10,
        "the accept loop used {used:?} of CPU in {over:?} on a listener shut down"
    );
    std::fs::remove_dir_all(&base).unwrap();
}
