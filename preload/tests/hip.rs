//! The HIP driver over the HIP test double where HIP and ROCm differ from the engine's bodies'
//! ordinary run (`name::on_hip` of every `engine_test!`): ROCm 7.2's bugs as the double's
//! quirks, the granularity queries, the runtime's error codes as the driver reports them, the
//! device attributes that switch features off, and the caller's device left alone. No AMD GPU
//! is involved: these check what the driver asks of the runtime and does with its answers.

mod common;

use std::sync::Arc;

use common::hip::{
    HipDouble, ATTR_STREAM_WAIT, ATTR_VMM, QUIRK_IGNORE_ADDRESS, QUIRK_RELEASE_HOLDS,
    QUIRK_TAIL_ACCESS,
};
use common::{pattern, read_books, write_books, Setup};
use tms::backup::BackupKind;
use tms::driver::hip::HipDriver;
use tms::driver::Driver;
use tms::engine::{AllocRequest, Engine, Pick, State};
use tms::error::ErrorKind;

const MIB: u64 = 1 << 20;
const G: u64 = 2 * MIB;

/// An engine on the HIP driver over a fresh double of `setup` with `quirks`.
fn engine(setup: &Setup, quirks: u32, reserve_again: bool) -> (HipDouble, Arc<Engine>) {
    let mut d = HipDouble::new(setup, quirks);
    let driver = d.driver(reserve_again).unwrap();
    let e = setup.engine(driver);
    (d, e)
}

fn backed(size: u64, tag: &str) -> AllocRequest {
    AllocRequest::new(size, tag, Some(BackupKind::Pinned))
}

/// The driver error's call, code and name.
fn driver_error(e: &tms::Error) -> (&'static str, i32, String) {
    match e.kind() {
        ErrorKind::Driver { call, code, name } => (*call, *code, name.clone()),
        k => panic!("not a driver error but {k:?}: {e}"),
    }
}

#[test]
fn released_memory_comes_back_although_the_runtime_keeps_it_while_reserved() {
    let setup = Setup::default();
    let (d, e) = engine(&setup, QUIRK_RELEASE_HOLDS, true);
    let p = e.alloc(&backed(3 * G + 5, "w")).unwrap();
    let data = pattern((3 * G + 5) as usize, 1);
    write_books(&d, p, &data);
    let reserves = d.calls("hipMemAddressReserve");
    for round in 0..3 {
        e.pause(Some("w")).unwrap();
        assert_eq!(d.live(0), 0, "round {round}: paused, its memory is back");
        assert_eq!(d.counts().reservations, 1, "its range is reserved again");
        e.resume(Some("w")).unwrap();
        assert_eq!(e.allocations()[0].addr, p, "same address");
        assert_eq!(read_books(&d, p, data.len()), data, "round {round}");
    }
    assert_eq!(
        d.calls("hipMemAddressReserve") - reserves,
        3,
        "one reservation again per pause"
    );
    e.free(p).unwrap();
    let c = d.counts();
    assert_eq!(
        (d.live(0), c.handles, c.mappings, c.reservations),
        (0, 0, 0, 0)
    );
}

#[test]
fn without_reserving_again_the_runtime_keeps_released_memory() {
    let (d, e) = engine(&Setup::default(), QUIRK_RELEASE_HOLDS, false);
    let p = e.alloc(&backed(G, "w")).unwrap();
    e.pause(Some("w")).unwrap();
    assert_eq!(
        d.live(0),
        G,
        "the bug the driver works around, as the double has it"
    );
    e.free(p).unwrap();
    assert_eq!(d.live(0), 0, "freeing the range frees it");
}

#[test]
fn an_address_taken_meanwhile_leaves_the_allocation_paused_with_its_backup() {
    let (d, e) = engine(
        &Setup::default(),
        QUIRK_RELEASE_HOLDS | QUIRK_IGNORE_ADDRESS,
        true,
    );
    let p = e.alloc(&backed(2 * G, "w")).unwrap();
    let data = pattern((2 * G) as usize, 2);
    write_books(&d, p, &data);
    let err = e.pause(Some("w")).unwrap_err().to_string();
    assert!(
        err.contains(&format!("reserving again the address range {p:#x}"))
            && err.contains("stays paused with its backup"),
        "{err}"
    );
    let a = &e.allocations()[0];
    assert_eq!((a.state, a.host_valid), (State::Paused, true), "{a:?}");
    assert_eq!(d.live(0), 0, "the memory came back all the same");
    assert_eq!(d.counts().reservations, 0, "nothing left reserved");

    // While the runtime will not give the address, a resume fails plainly, losing nothing.
    let err = e.resume(Some("w")).unwrap_err().to_string();
    assert!(
        err.contains("something else holds that address now"),
        "{err}"
    );
    assert_eq!(e.allocations()[0].state, State::Paused);
    assert_eq!(
        d.counts().reservations,
        0,
        "the wrong address was given back"
    );

    // Once it does, the resume brings the contents back in place.
    d.set_quirks(QUIRK_RELEASE_HOLDS);
    e.resume(Some("w")).unwrap();
    assert_eq!(read_books(&d, p, data.len()), data);
    e.free(p).unwrap();
    assert_eq!((d.live(0), d.counts().reservations), (0, 0));

    // A paused allocation whose range is lost is freed without a range to free.
    d.set_quirks(QUIRK_RELEASE_HOLDS | QUIRK_IGNORE_ADDRESS);
    let q = e.alloc(&backed(G, "x")).unwrap();
    e.pause(Some("x")).unwrap_err();
    let frees = d.calls("hipMemAddressFree");
    assert!(e.free(q).unwrap());
    assert_eq!(
        d.calls("hipMemAddressFree"),
        frees,
        "nothing reserved to free"
    );
    assert_eq!(d.counts().reservations, 0);
}

#[test]
fn access_to_a_mapped_tail_is_set_through_the_whole_prefix_where_the_runtime_refuses_it() {
    let setup = Setup::default();
    let (d, e) = engine(&setup, QUIRK_TAIL_ACCESS, true);
    // Chunks are segments: each one after the first is a tail of the allocation's range.
    let req = AllocRequest {
        chunk: G,
        ..backed(4 * G, "c")
    };
    let p = e.alloc(&req).unwrap();
    let data = pattern((4 * G) as usize, 3);
    write_books(&d, p, &data);
    assert_eq!(
        d.calls("hipMemSetAccess"),
        1 + 2 * 3,
        "the first chunk once; each later one refused, then set with everything before it"
    );
    e.pause(Some("c")).unwrap();
    e.resume(Some("c")).unwrap();
    assert_eq!(read_books(&d, p, data.len()), data);
    // A chunk whose prefix has a hole cannot be helped: the runtime's error, plainly.
    e.pause_pick(&Pick::chunks(p, &[1, 2])).unwrap();
    let err = e.resume_pick(&Pick::chunks(p, &[2])).unwrap_err();
    assert!(
        err.to_string()
            .contains("hipMemSetAccess failed with hipErrorInvalidValue"),
        "{err}"
    );
    e.resume_pick(&Pick::chunks(p, &[1, 2])).unwrap();
    assert_eq!(read_books(&d, p, data.len()), data);
}

#[test]
fn the_granularity_is_the_larger_of_the_minimum_and_the_recommended() {
    let setup = Setup::default().granularity(4096);
    let mut d = HipDouble::with_granularity(&setup, G, 0);
    let driver = d.driver(true).unwrap();
    assert_eq!(
        driver.granularity(0).unwrap(),
        G,
        "a newer runtime recommends 2 MiB"
    );

    // ROCm 7.2 answers the minimum for both.
    let mut d = HipDouble::with_granularity(&setup, 4096, 0);
    let driver = d.driver(true).unwrap();
    assert_eq!(driver.granularity(0).unwrap(), 4096);

    // A runtime that refuses the recommended option: the minimum.
    let mut d = HipDouble::with_granularity(&setup, G, 0);
    d.fail("hipMemGetAllocationGranularity", 2, 1);
    let driver = d.driver(true).unwrap();
    assert_eq!(driver.granularity(0).unwrap(), 4096);

    // Sizes are multiples of it, or the runtime refuses them (ROCm's hipMemCreate does).
    let err = driver.create(0, 4096 + 512).unwrap_err();
    assert_eq!(
        driver_error(&err),
        ("hipMemCreate", 1, "hipErrorInvalidValue".to_string()),
        "{err}"
    );
    let e = setup.engine(driver);
    let p = e.alloc(&backed(4096 + 1, "g")).unwrap();
    assert_eq!(
        e.allocations()[0].mapped,
        2 * 4096,
        "rounded up by the engine"
    );
    e.free(p).unwrap();
}

#[test]
fn runtime_errors_name_the_call_the_code_and_its_name() {
    let (d, e) = engine(&Setup::default(), 0, true);
    d.fail("hipMemCreate", 1, 2);
    let err = e.alloc(&backed(G, "a")).unwrap_err();
    assert!(err.is_oom(), "{err}");
    assert!(
        err.to_string()
            .contains("hipMemCreate returned hipErrorOutOfMemory"),
        "{err}"
    );
    assert_eq!(
        d.counts().reservations,
        0,
        "the failed allocation left nothing"
    );

    d.fail("hipMemMap", 1, 999);
    let err = e.alloc(&backed(G, "a")).unwrap_err();
    assert_eq!(
        driver_error(&err),
        ("hipMemMap", 999, "hipErrorUnknown".to_string()),
        "{err}"
    );
    assert!(err
        .to_string()
        .contains("hipMemMap failed with hipErrorUnknown (999)"));

    let p = e.alloc(&backed(G, "a")).unwrap();
    d.fail("hipMemcpyDtoHAsync", 1, 700);
    let err = e.pause(Some("a")).unwrap_err();
    assert!(
        err.to_string()
            .contains("hipMemcpyDtoHAsync failed with hipErrorIllegalAddress (700)"),
        "{err}"
    );
    assert_eq!(e.allocations()[0].state, State::Active, "nothing lost");
    d.fail("hipMemUnmap", 1, 1);
    let err = e.pause(Some("a")).unwrap_err();
    assert!(err.to_string().contains("hipMemUnmap"), "{err}");
    assert_eq!(e.allocations()[0].state, State::Active);
    e.pause(Some("a")).unwrap();
    e.resume(Some("a")).unwrap();
    e.free(p).unwrap();
    assert_eq!((d.live(0), d.counts().reservations), (0, 0));
}

#[test]
fn a_runtime_that_cannot_start_or_lacks_virtual_memory_is_refused_at_load() {
    let setup = Setup::default();
    let mut d = HipDouble::new(&setup, 0);
    d.fail("hipInit", 1, 100);
    let err = d.driver(true).err().expect("hipInit failed");
    assert_eq!(
        driver_error(&err),
        ("hipInit", 100, "hipErrorNoDevice".to_string())
    );

    let mut d = HipDouble::new(&setup.clone().devices(2), 0);
    d.set_attribute(ATTR_VMM, 0);
    let err = d.driver(true).err().expect("no VMM");
    assert_eq!(*err.kind(), ErrorKind::Unsupported, "{err}");
    assert!(
        err.to_string()
            .contains("hipDeviceAttributeVirtualMemoryManagementSupported"),
        "{err}"
    );

    // A library that is not a HIP runtime.
    let err = HipDriver::load_from("libc.so.6", true)
        .err()
        .expect("not HIP");
    assert!(err.to_string().contains("lacks hipInit"), "{err}");
    let err = HipDriver::load_from("/nonexistent/libamdhip64.so", true)
        .err()
        .expect("no file");
    assert!(err.to_string().contains("TMS_HIP_LIBRARY"), "{err}");
}

#[test]
fn without_stream_waits_a_nonblocking_resume_blocks_instead() {
    let (d, e) = engine(&Setup::default(), 0, true);
    d.set_attribute(ATTR_STREAM_WAIT, 0);
    let err = e.driver().gate().unwrap_err();
    assert_eq!(*err.kind(), ErrorKind::Unsupported);
    assert!(
        err.to_string()
            .contains("hipDeviceAttributeCanUseStreamWaitValue"),
        "{err}"
    );
    let p = e.alloc(&backed(G, "a")).unwrap();
    let data = pattern(G as usize, 4);
    write_books(&d, p, &data);
    e.pause(None).unwrap();
    let r = Engine::resume_nonblocking(e.clone(), None, &[], None).unwrap();
    assert_eq!(r.pending, 0, "blocked until restored");
    assert_eq!(read_books(&d, p, data.len()), data);
    assert_eq!(d.calls("hipStreamWaitValue32"), 0);
}

#[test]
fn a_nonblocking_resume_makes_the_stream_wait_on_the_gate() {
    let (d, e) = engine(&Setup::default().small_pieces(2), 0, true);
    let p = e.alloc(&backed(4 * G, "a")).unwrap();
    let data = pattern((4 * G) as usize, 5);
    write_books(&d, p, &data);
    e.pause(None).unwrap();
    let stream = tms::engine::StreamOf {
        device: 0,
        stream: tms::driver::Stream(0),
    };
    Engine::resume_nonblocking(e.clone(), None, &[], Some(stream)).unwrap();
    assert!(e.wait_restored(None, None).unwrap());
    assert_eq!(read_books(&d, p, data.len()), data);
    assert_eq!(d.calls("hipStreamWaitValue32"), 1);
    assert_eq!(d.counts().host_allocs, 1, "the gate, made once");
    // The null stream's next work waits for the gate: open now, so it runs.
    e.driver().stream_sync(tms::driver::Stream(0)).unwrap();
}

#[test]
fn the_callers_device_is_put_back_after_each_call() {
    let setup = Setup::default().devices(2);
    let (d, e) = engine(&setup, 0, true);
    let driver = e.driver().clone();
    std::thread::spawn(move || {
        driver.push_device(1).map(|t| driver.pop_device(t)).unwrap();
        assert_eq!(driver.current_device().unwrap(), 0, "put back");
        let t = driver.push_device(1).unwrap();
        driver.mem_info(0).unwrap();
        assert_eq!(driver.current_device().unwrap(), 1, "the scope's, restored");
        driver.pop_device(t);
        assert_eq!(driver.current_device().unwrap(), 0);
    })
    .join()
    .unwrap();
    assert!(
        d.calls("hipThreadExchangeStreamCaptureMode") >= 4,
        "relaxed and restored"
    );
    let p = e
        .alloc(&AllocRequest {
            device: 1,
            ..backed(G, "one")
        })
        .unwrap();
    assert_eq!((d.live(0), d.live(1)), (0, G));
    e.free(p).unwrap();
}

#[test]
fn ranges_given_back_and_reserved_again_while_other_threads_allocate_lose_nothing() {
    let setup = Setup::default().devices(2).small_pieces(3);
    let (d, e) = engine(&setup, QUIRK_RELEASE_HOLDS, true);
    let mut keep = Vec::new();
    for k in 0..6u64 {
        let size = (1 + k % 3) * G + 4096 * k;
        let req = AllocRequest {
            device: (k % 2) as i32,
            ..backed(size, "kv")
        };
        let p = e.alloc(&req).unwrap();
        let data = pattern(size as usize, 10 + k);
        write_books(&d, p, &data);
        keep.push((p, data));
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..3 {
            let (e, stop) = (&e, &stop);
            s.spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let req = AllocRequest {
                        device: t % 2,
                        ..AllocRequest::new(G, &format!("churn{t}"), None)
                    };
                    let p = e.alloc(&req).unwrap();
                    assert!(e.free(p).unwrap());
                }
            });
        }
        for round in 0..10 {
            e.pause(Some("kv")).unwrap();
            for (p, _) in &keep {
                assert!(!d.is_accessible(*p, 1), "round {round}: {p:#x} paused");
            }
            e.resume(Some("kv")).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    for (p, data) in &keep {
        assert_eq!(&read_books(&d, *p, data.len()), data, "{p:#x}");
    }
    e.pause(None).unwrap();
    assert_eq!(
        (d.live(0), d.live(1)),
        (0, 0),
        "everything paused is given back"
    );
    assert_eq!(d.counts().reservations, keep.len() as u64);
}

#[test]
fn a_free_whose_address_another_library_would_take_frees_everything_without_an_error() {
    let (d, e) = engine(&Setup::default(), QUIRK_RELEASE_HOLDS, true);
    let p = e.alloc(&backed(2 * G, "w")).unwrap();
    // Any range let go is taken at once by someone else.
    d.set_quirks(QUIRK_RELEASE_HOLDS | QUIRK_IGNORE_ADDRESS);
    let reserves = d.calls("hipMemAddressReserve");
    assert!(e.free(p).unwrap());
    assert_eq!(
        d.calls("hipMemAddressReserve"),
        reserves,
        "a range being freed is not reserved again"
    );
    let c = d.counts();
    assert_eq!(
        (d.live(0), c.handles, c.mappings, c.reservations),
        (0, 0, 0, 0)
    );
}
