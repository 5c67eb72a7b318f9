//! Pauseable memory made RDMA-capable and exportable as asked (`TMS_RDMA`, `TMS_SHAREABLE`;
//! issue 38, item 2): the properties read back from each handle are the ones asked for, before
//! and after a pause and resume; an exported segment is a file descriptor whose memory holds
//! the allocation's bytes (read here through the simulated device's memfd; on a GPU a second
//! process imports it, `python/tests/test_gpu_export.py`); memory made without the shareable
//! flag is refused with a message naming the setting.

mod common;

use common::{engine_test, pattern, req};
use tms::backup::BackupKind;
use tms::driver::MemoryFlags;

/// The bytes of `len` behind the exported file descriptor `fd` (the simulated device's memfd).
fn read_fd(fd: &std::os::fd::OwnedFd, len: usize) -> Vec<u8> {
    let f = std::fs::File::from(fd.try_clone().expect("dup"));
    let mut v = vec![0u8; len];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut v, 0).expect("read the exported memory");
    v
}

engine_test! {
    fn memory_is_rdma_capable_and_exportable_as_asked(h) {
        let d = h.e.driver();
        let both = MemoryFlags {
            rdma: true,
            shareable: true,
        };
        d.set_memory_flags(both);
        let g = h.g();
        let size = 3 * g;
        let p = h.e.alloc(&req(size, "x", Some(BackupKind::Pinned))).unwrap();
        let data = pattern(size as usize, 38);
        h.write(p, &data);
        if d.name() == "hip" {
            // The HIP driver neither reads properties back nor exports yet: said so, plainly.
            let e = h.e.export(p).unwrap_err().to_string();
            assert!(e.contains("cannot export"), "{e}");
            d.set_memory_flags(MemoryFlags::default());
            return;
        }
        let check = |when: &str| {
            let props = h.e.memory_props(p + 7).unwrap();
            assert!(!props.is_empty());
            assert!(props.iter().all(|f| *f == both), "{when}: {props:?}");
            let ex = h.e.export(p).unwrap();
            assert_eq!(ex.iter().map(|x| x.len).sum::<u64>(), size, "{when}");
            assert_eq!(ex[0].offset, 0);
            if h.sim().is_some() {
                let mut got = Vec::new();
                for x in &ex {
                    got.extend(read_fd(&x.fd, x.len as usize));
                }
                assert!(got == data, "{when}: the exported memory holds the allocation's bytes");
            }
        };
        check("made");
        h.e.pause(Some("x")).unwrap();
        let e = h.e.export(p).unwrap_err().to_string();
        assert!(e.contains("resume it first"), "{e}");
        h.e.resume(Some("x")).unwrap();
        check("after a resume");

        // Made without the flags: read back so, and no export.
        d.set_memory_flags(MemoryFlags::default());
        let q = h.e.alloc(&req(g, "plain", None)).unwrap();
        assert!(h.e.memory_props(q).unwrap().iter().all(|f| *f == MemoryFlags::default()));
        let e = h.e.export(q).unwrap_err().to_string();
        assert!(e.contains("TMS_SHAREABLE=1"), "{e}");
        let e = h.e.export(0x10).unwrap_err().to_string();
        assert!(e.contains("does not lie inside"), "{e}");
    }
}
