/*
 * End-to-end test program for libtms.so on HIP (built by tests/build.rs, run by
 * tests/tests/e2e_hip.rs with LD_PRELOAD=libtms.so). It is linked against the HIP test double
 * (preload/tests/hip/libamdhip64.c, built as libamdhip64.so), so hipMalloc/hipFree reach
 * libtms.so's interposers first, and the library's HIP driver opens the same double the
 * program loaded. No AMD GPU: the double keeps device memory in host memory, so the program
 * reads and writes allocations directly, and it behaves as ROCm 7.2 does (released memory is
 * kept while its range stays reserved), so a pause that gives memory back shows the library's
 * way around that.
 *
 * Usage: e2e_hip BACKEND (pinned or mmap, the CPU backup's host memory). Output as
 * e2e_prog.c's: PASS/FAIL lines, "STATS <label> <json>", "ERROR <label> <message>", and a last
 * line "RESULT: PASS <mode>" (exit 0) or "RESULT: FAIL ..." (exit 1).
 */
#define _GNU_SOURCE
#define TMS_DECLARE_HIP_INTERPOSERS
#include "tms.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MIB ((size_t)1 << 20)

/* The double's controls. */
struct hipsim_counts {
    uint64_t handles, mappings, reservations, pinned_bytes, host_allocs, pageable, malloc_live,
        malloc_calls, free_calls, foreign_frees;
};
int hipsim_configure(int devices, uint64_t capacity, uint64_t granularity, uint64_t recommended);
void hipsim_set_quirks(unsigned quirks);
void hipsim_counts(struct hipsim_counts *out);
uint64_t hipsim_live_bytes(int device);
long hipsim_calls(const char *call);

#define TMS_FUNCTIONS(X)                                                                     \
    X(tms_last_error)                                                                        \
    X(tms_region_enter)                                                                      \
    X(tms_region_exit)                                                                       \
    X(tms_pause)                                                                             \
    X(tms_resume)                                                                            \
    X(tms_stats_json)

#include "tms_dlsym.h"

static int failures;

__attribute__((format(printf, 2, 3))) static void check(int ok, const char *fmt, ...) {
    va_list ap;
    printf("%s: ", ok ? "PASS" : "FAIL");
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    fflush(stdout);
    failures += !ok;
}

static void report_error(const char *label) {
    char buf[8192] = {0};
    p_tms_last_error(buf, sizeof buf);
    printf("ERROR %s %s\n", label, buf);
    fflush(stdout);
}

static void print_stats(const char *label) {
    static char buf[1 << 16];
    size_t len = 0;
    if (p_tms_stats_json(buf, sizeof buf, &len) == TMS_OK) {
        printf("STATS %s %s\n", label, buf);
        fflush(stdout);
    }
}

static unsigned char byte_at(size_t i) { return (unsigned char)((i * 131u + (i >> 12)) & 0xffu); }

int main(int argc, char **argv) {
    if (argc != 2 || (strcmp(argv[1], "pinned") != 0 && strcmp(argv[1], "mmap") != 0)) {
        fprintf(stderr, "usage: e2e_hip pinned|mmap\n");
        return 2;
    }
    const char *backend = argv[1];
    if (!load_api()) {
        return 1;
    }
    /* Before the library starts the runtime: 64 MiB, 2 MiB granularity, ROCm 7.2's release. */
    check(hipsim_configure(1, 64 * MIB, 2 * MIB, 2 * MIB) == 0, "the double takes its shape");
    hipsim_set_quirks(1);

    struct hipsim_counts c0, c;
    hipsim_counts(&c0);
    void *outside = NULL;
    int rc = hipMalloc(&outside, 4096);
    hipsim_counts(&c);
    check(rc == 0 && outside && c.malloc_calls == c0.malloc_calls + 1,
          "hipMalloc outside a region reaches the runtime (rc %d)", rc);

    rc = p_tms_region_enter(1, "kv", 1, backend);
    check(rc == TMS_OK, "tms_region_enter(kv, cpu backup in %s memory) (rc %d)", backend, rc);
    const size_t size = 3 * MIB + 123;
    void *kv = NULL;
    rc = hipMalloc(&kv, size);
    hipsim_counts(&c);
    check(rc == 0 && kv && c.malloc_calls == c0.malloc_calls + 1,
          "hipMalloc inside the region is served by libtms.so, not the runtime (rc %d)", rc);
    if (rc != 0 || !kv) {
        report_error("alloc");
        printf("RESULT: FAIL basic\n");
        return 1;
    }
    check(hipsim_live_bytes(0) == 4 * MIB, "4 MiB of device memory mapped (%llu)",
          (unsigned long long)hipsim_live_bytes(0));
    unsigned char *b = kv;
    for (size_t i = 0; i < size; i++) {
        b[i] = byte_at(i);
    }
    print_stats("active");

    rc = p_tms_pause("kv");
    check(rc == TMS_OK, "tms_pause(kv) (rc %d)", rc);
    if (rc != TMS_OK) {
        report_error("pause");
    }
    check(hipsim_live_bytes(0) == 0,
          "paused: the memory is back although ROCm 7.2 keeps it while its range is reserved (%llu)",
          (unsigned long long)hipsim_live_bytes(0));
    hipsim_counts(&c);
    check(c.reservations == 1, "the range is reserved again (%llu)",
          (unsigned long long)c.reservations);

    void *big = (void *)0x1;
    rc = hipMalloc(&big, 65 * MIB);
    check(rc == 2, "hipMalloc beyond the device inside a region: hipErrorOutOfMemory (rc %d)",
          rc);
    report_error("oom");

    rc = p_tms_resume("kv");
    check(rc == TMS_OK, "tms_resume(kv) (rc %d)", rc);
    if (rc != TMS_OK) {
        report_error("resume");
    }
    size_t bad = size;
    for (size_t i = 0; i < size; i++) {
        if (b[i] != byte_at(i)) {
            bad = i;
            break;
        }
    }
    check(bad == size, "the contents are back at the same address (first difference at %zu)",
          bad);
    print_stats("resumed");

    rc = hipFree(kv);
    hipsim_counts(&c);
    check(rc == 0 && c.free_calls == c0.free_calls && c.reservations == 0 && c.handles == 0,
          "hipFree of the pauseable allocation is served by libtms.so (rc %d)", rc);
    check(p_tms_region_exit() == TMS_OK, "leave the region");
    rc = hipFree(outside);
    hipsim_counts(&c);
    check(rc == 0 && c.free_calls == c0.free_calls + 1 && c.foreign_frees == 0,
          "hipFree of the runtime's memory reaches the runtime (rc %d)", rc);
    check(hipsim_calls("hipMemAddressReserve") >= 2, "the library reserved through the double");

    printf("RESULT: %s basic\n", failures == 0 ? "PASS" : "FAIL");
    fflush(stdout);
    return failures == 0 ? 0 : 1;
}
