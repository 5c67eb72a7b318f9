/*
 * End-to-end test program for libtms.so in preload mode (built by tests/build.rs, run by the
 * tests in tests/tests/ with LD_PRELOAD=libtms.so and TMS_BACKEND=sim).
 *
 * It is linked against the fake CUDA runtime (tests/c/fake_cudart.c), whose counters tell
 * which cudaMalloc/cudaFree calls libtms.so passed through. The tms_* API is looked up with
 * dlsym(RTLD_DEFAULT) since libtms.so is preloaded, not linked; the function pointer types
 * come from tms.h, so the header's prototypes are what this program calls through.
 *
 * On the simulated device a device address is host memory, so the program reads and writes
 * allocations directly.
 *
 * Output: one "PASS: ..." or "FAIL: ..." line per check, machine-readable lines
 * ("STATS <label> <json>", "REGION <label> <json>", "ERROR <label> <message>") for the Rust
 * side, and a last line "RESULT: PASS <mode>" (exit 0) or "RESULT: FAIL <mode> ..." (exit 1).
 * Usage errors exit 2.
 */
#define _GNU_SOURCE
#define TMS_DECLARE_CUDA_INTERPOSERS
#include "tms.h"
#include "checks.h"

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* From the fake runtime. */
long fake_cuda_malloc_calls(void);
long fake_cuda_free_calls(void);
long fake_cuda_foreign_frees(void);
long fake_cuda_live(void);

#define MIB ((size_t)1 << 20)

#define CUDA_SUCCESS 0
#define CUDA_ERROR_MEMORY_ALLOCATION 2
#define CUDA_ERROR_INITIALIZATION 3
#define CUDA_ERROR_UNKNOWN 999

/* ---- The tms_* API, through dlsym ---------------------------------------------------- */

#define TMS_FUNCTIONS(X)                                                                     \
    X(tms_version)                                                                           \
    X(tms_status_name)                                                                       \
    X(tms_last_error)                                                                        \
    X(tms_init)                                                                              \
    X(tms_is_active)                                                                         \
    X(tms_region_enter)                                                                      \
    X(tms_region_exit)                                                                       \
    X(tms_region_current)                                                                    \
    X(tms_pause)                                                                             \
    X(tms_resume)                                                                            \
    X(tms_set_memory_margin)                                                                 \
    X(tms_get_memory_margin)                                                                 \
    X(tms_copy_cpu_backup)                                                                   \
    X(tms_get_cpu_backup)                                                                    \
    X(tms_stats_json)                                                                        \
    X(tms_control_socket)                                                                    \
    X(tms_torch_malloc)

TMS_FUNCTIONS(DECLARE_POINTER)

DEFINE_LOAD_API(TMS_FUNCTIONS)

static void print_region(const char *label) {
    char buf[1024];
    size_t len = 0;
    int rc = p_tms_region_current(buf, sizeof buf, &len);
    check(rc == TMS_OK, "tms_region_current (rc %d)", rc);
    if (rc == TMS_OK) {
        printf("REGION %s %s\n", label, buf);
        fflush(stdout);
    }
}

/* ---- Patterns ------------------------------------------------------------------------ */

static unsigned char pattern_byte(size_t i, unsigned seed) {
    return (unsigned char)((i * 131u + seed * 7u + (i >> 12)) & 0xffu);
}

static void fill(void *p, size_t n, unsigned seed) {
    unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        b[i] = pattern_byte(i, seed);
    }
}

/* Offset of the first byte that differs from the pattern, or n. */
static size_t verify(const void *p, size_t n, unsigned seed) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        if (b[i] != pattern_byte(i, seed)) {
            return i;
        }
    }
    return n;
}

static int all_bytes(const void *p, size_t n, unsigned char v) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        if (b[i] != v) {
            return 0;
        }
    }
    return 1;
}

/* ---- Modes --------------------------------------------------------------------------- */

/* Outside/inside a region, pause/resume with and without CPU backup, stats, frees. */
static int mode_basic(void) {
    const size_t kv_size = MIB + 123;
    const size_t w_size = 3 * MIB;
    long m0 = fake_cuda_malloc_calls();
    long f0 = fake_cuda_free_calls();

    check(p_tms_is_active() == 0, "the library does not start before it is needed");

    void *outside = NULL;
    int rc = cudaMalloc(&outside, 4096);
    check(rc == CUDA_SUCCESS && outside != NULL, "cudaMalloc outside a region succeeds (rc %d)",
          rc);
    check(fake_cuda_malloc_calls() == m0 + 1,
          "cudaMalloc outside a region reaches the real runtime");
    check(p_tms_is_active() == 0, "a pass-through cudaMalloc does not start the library");

    rc = p_tms_region_enter(1, "kv", 1, NULL);
    check(rc == TMS_OK, "tms_region_enter(kv, cpu_backup) (rc %d)", rc);
    print_region("kv");

    void *kv = NULL;
    rc = cudaMalloc(&kv, kv_size);
    check(rc == CUDA_SUCCESS && kv != NULL, "cudaMalloc inside region kv (rc %d)", rc);
    check(fake_cuda_malloc_calls() == m0 + 1,
          "cudaMalloc inside a region does not reach the real runtime");
    check(p_tms_is_active() == 1, "the library is active after the first pauseable allocation");

    rc = p_tms_region_enter(1, "weights", 0, NULL);
    check(rc == TMS_OK, "nested tms_region_enter(weights, no backup) (rc %d)", rc);
    print_region("weights");
    void *w = NULL;
    rc = cudaMalloc(&w, w_size);
    check(rc == CUDA_SUCCESS && w != NULL, "cudaMalloc inside region weights (rc %d)", rc);

    rc = p_tms_region_enter(0, NULL, 0, NULL);
    check(rc == TMS_OK, "tms_region_enter(disabled) (rc %d)", rc);
    void *outside2 = NULL;
    rc = cudaMalloc(&outside2, 100);
    check(rc == CUDA_SUCCESS && fake_cuda_malloc_calls() == m0 + 2,
          "cudaMalloc in a disabled scope reaches the real runtime (rc %d)", rc);
    check(p_tms_region_exit() == TMS_OK, "leave the disabled scope");
    check(p_tms_region_exit() == TMS_OK, "leave region weights");
    print_region("back-in-kv");

    void *zero = (void *)0x1;
    rc = cudaMalloc(&zero, 0);
    check(rc == CUDA_SUCCESS && zero == NULL && fake_cuda_malloc_calls() == m0 + 2,
          "cudaMalloc of 0 bytes inside a region gives NULL (rc %d)", rc);

    if (kv == NULL || w == NULL) {
        return finish("basic");
    }
    fill(kv, kv_size, 1);
    memset(w, 0xAB, w_size);
    print_stats("active");

    rc = p_tms_pause("kv");
    check(rc == TMS_OK, "tms_pause(kv) (rc %d)", rc);
    if (rc != TMS_OK) {
        report_error("pause");
    }
    check(((volatile unsigned char *)w)[w_size - 1] == 0xAB,
          "allocations of another tag stay accessible while kv is paused");

    unsigned char peek[256];
    int found = -1;
    rc = p_tms_copy_cpu_backup((uint64_t)(uintptr_t)kv + 1000, sizeof peek, peek, &found);
    check(rc == TMS_OK && found == 1, "tms_copy_cpu_backup of the paused kv (rc %d, found %d)",
          rc, found);
    int same = 1;
    for (size_t i = 0; i < sizeof peek; i++) {
        same &= peek[i] == pattern_byte(1000 + i, 1);
    }
    check(same, "the CPU backup holds what was written");
    const void *bp = NULL;
    rc = p_tms_get_cpu_backup((uint64_t)(uintptr_t)kv, kv_size, &bp);
    check(rc == TMS_OK && bp != NULL && verify(bp, kv_size, 1) == kv_size,
          "tms_get_cpu_backup points at the whole backup (rc %d)", rc);
    rc = p_tms_get_cpu_backup((uint64_t)(uintptr_t)outside, 16, &bp);
    check(rc == TMS_ERR_NOT_FOUND, "tms_get_cpu_backup of a non-pauseable pointer: NOT_FOUND (rc %d)",
          rc);
    print_stats("kv-paused");

    rc = p_tms_pause("");
    check(rc == TMS_OK, "tms_pause(\"\") pauses every tag: the rest (rc %d)", rc);
    print_stats("all-paused");

    rc = p_tms_resume(NULL);
    check(rc == TMS_OK, "tms_resume(NULL) (rc %d)", rc);
    if (rc != TMS_OK) {
        report_error("resume");
        return finish("basic");
    }
    size_t bad = verify(kv, kv_size, 1);
    check(bad == kv_size, "kv (CPU backup) has its contents back at the same address "
                          "(first difference at %zu of %zu)",
          bad, kv_size);
    check(all_bytes(w, w_size, 0),
          "weights (no backup) was really released: the sim gives back zeroed memory");
    memset(w, 0x5A, w_size);
    check(all_bytes(w, w_size, 0x5A), "weights is writable again after resume");
    print_stats("resumed");

    check(p_tms_region_exit() == TMS_OK, "leave region kv");
    rc = p_tms_region_exit();
    check(rc == TMS_ERR_INVALID_STATE, "an unmatched tms_region_exit is refused (rc %d)", rc);
    report_error("unmatched-exit");
    rc = p_tms_region_enter(1, "", 0, NULL);
    check(rc == TMS_ERR_INVALID_ARGUMENT, "a region with an empty tag is refused (rc %d)", rc);
    report_error("empty-tag");

    rc = cudaFree(kv);
    check(rc == CUDA_SUCCESS, "cudaFree(kv) (rc %d)", rc);
    rc = cudaFree(w);
    check(rc == CUDA_SUCCESS, "cudaFree(weights) (rc %d)", rc);
    check(fake_cuda_free_calls() == f0, "cudaFree of pauseable memory does not reach the runtime");
    rc = cudaFree(outside);
    check(rc == CUDA_SUCCESS, "cudaFree(outside) (rc %d)", rc);
    rc = cudaFree(outside2);
    check(rc == CUDA_SUCCESS, "cudaFree(outside2) (rc %d)", rc);
    check(fake_cuda_free_calls() == f0 + 2, "cudaFree of runtime memory reaches the runtime");
    check(fake_cuda_foreign_frees() == 0 && fake_cuda_live() == 0,
          "the runtime got back exactly what it handed out");
    print_stats("freed");
    rc = p_tms_pause(NULL);
    check(rc == TMS_OK, "tms_pause(NULL) with nothing left (rc %d)", rc);
    return finish("basic");
}

/* Out of memory on the simulated device (run with TMS_SIM_CAPACITY=64MiB). */
static int mode_oom(void) {
    long m0 = fake_cuda_malloc_calls();
    int rc = p_tms_region_enter(1, "big", 0, NULL);
    check(rc == TMS_OK, "tms_region_enter(big) (rc %d)", rc);

    void *p = NULL;
    rc = cudaMalloc(&p, 128 * MIB);
    check(rc == CUDA_ERROR_MEMORY_ALLOCATION,
          "cudaMalloc beyond the capacity returns cudaErrorMemoryAllocation (rc %d)", rc);
    report_error("too-big");
    check(strstr(last_error(), "out of memory") != NULL, "tms_last_error explains it: %s",
          last_error());
    check(fake_cuda_malloc_calls() == m0, "the failed allocation did not fall back to the runtime");
    /* The runtime's answer for a size no device holds, as for one just below it (PyTorch frees
     * its cache and raises OutOfMemoryError only on this code). */
    rc = cudaMalloc(&p, SIZE_MAX);
    check(rc == CUDA_ERROR_MEMORY_ALLOCATION,
          "cudaMalloc of SIZE_MAX (overflows once rounded up) returns cudaErrorMemoryAllocation "
          "(rc %d)",
          rc);

    void *q = NULL;
    rc = cudaMalloc(&q, 8 * MIB);
    check(rc == CUDA_SUCCESS && q != NULL, "a smaller allocation still succeeds (rc %d)", rc);
    void *r = NULL;
    rc = cudaMalloc(&r, 60 * MIB);
    check(rc == CUDA_ERROR_MEMORY_ALLOCATION, "what no longer fits is refused (rc %d)", rc);
    rc = cudaFree(q);
    check(rc == CUDA_SUCCESS, "cudaFree (rc %d)", rc);
    rc = cudaMalloc(&r, 64 * MIB);
    check(rc == CUDA_SUCCESS && r != NULL, "after the free the whole capacity is usable (rc %d)",
          rc);
    rc = cudaFree(r);
    check(rc == CUDA_SUCCESS, "cudaFree (rc %d)", rc);

    rc = p_tms_set_memory_margin(32 * MIB);
    check(rc == TMS_OK, "tms_set_memory_margin(32 MiB) (rc %d)", rc);
    uint64_t margin = 0;
    rc = p_tms_get_memory_margin(&margin);
    check(rc == TMS_OK && margin == 32 * MIB, "tms_get_memory_margin (rc %d, %llu)", rc,
          (unsigned long long)margin);
    rc = cudaMalloc(&r, 40 * MIB);
    check(rc == CUDA_ERROR_MEMORY_ALLOCATION, "the memory margin is enforced (rc %d)", rc);
    report_error("margin");
    check(strstr(last_error(), "margin") != NULL, "the message names the margin");
    check(p_tms_set_memory_margin(0) == TMS_OK, "reset the margin");

    /* Resume that does not fit: the tag stays paused with its backup, retry works. */
    check(p_tms_region_enter(1, "a", 1, NULL) == TMS_OK, "tms_region_enter(a, cpu_backup)");
    void *a = NULL;
    rc = cudaMalloc(&a, 40 * MIB);
    check(rc == CUDA_SUCCESS && a != NULL, "allocate 40 MiB in tag a (rc %d)", rc);
    check(p_tms_region_exit() == TMS_OK, "leave region a");
    if (a == NULL) {
        return finish("oom");
    }
    fill(a, 40 * MIB, 3);
    rc = p_tms_pause("a");
    check(rc == TMS_OK, "pause a (rc %d)", rc);
    void *b = NULL;
    rc = cudaMalloc(&b, 40 * MIB);
    check(rc == CUDA_SUCCESS && b != NULL, "the memory a gave back is reusable (rc %d)", rc);
    rc = p_tms_resume("a");
    check(rc == TMS_ERR_OUT_OF_MEMORY, "resuming a while b holds the memory: OUT_OF_MEMORY (rc %d)",
          rc);
    report_error("resume");
    print_stats("resume-oom");
    rc = cudaFree(b);
    check(rc == CUDA_SUCCESS, "free b (rc %d)", rc);
    rc = p_tms_resume("a");
    check(rc == TMS_OK, "resume a again once memory is free (rc %d)", rc);
    if (rc == TMS_OK) {
        size_t bad = verify(a, 40 * MIB, 3);
        check(bad == 40 * MIB, "a's contents survived the failed resume (first difference at %zu)",
              bad);
    }
    rc = cudaFree(a);
    check(rc == CUDA_SUCCESS, "free a (rc %d)", rc);
    check(p_tms_region_exit() == TMS_OK, "leave region big");
    check(fake_cuda_malloc_calls() == m0 && fake_cuda_free_calls() == 0,
          "nothing reached the runtime");
    return finish("oom");
}

/* Injected driver faults (run with TMS_SIM_FAULTS=map:1,copy_d2h:1). */
static int mode_fault(void) {
    const size_t n = MIB;
    long m0 = fake_cuda_malloc_calls();
    int rc = p_tms_region_enter(1, "f", 1, NULL);
    check(rc == TMS_OK, "tms_region_enter(f, cpu_backup) (rc %d)", rc);

    void *p = NULL;
    rc = cudaMalloc(&p, n);
    check(rc == CUDA_ERROR_UNKNOWN, "cudaMalloc with a failing cuMemMap returns an error (rc %d)",
          rc);
    report_error("alloc");
    check(strstr(last_error(), "cuMemMap") != NULL && strstr(last_error(), "injected") != NULL,
          "the message names the injected fault");
    check(fake_cuda_malloc_calls() == m0, "the failed allocation did not fall back to the runtime");

    rc = cudaMalloc(&p, n);
    check(rc == CUDA_SUCCESS && p != NULL, "the next cudaMalloc succeeds (rc %d)", rc);
    if (p == NULL) {
        return finish("fault");
    }
    fill(p, n, 5);
    rc = p_tms_pause("f");
    check(rc == TMS_ERR_DRIVER, "tms_pause with a failing copy returns TMS_ERR_DRIVER (rc %d)",
          rc);
    report_error("pause");
    check(strstr(last_error(), "cuMemcpyDtoH") != NULL && strstr(last_error(), "injected") != NULL,
          "the message names the injected fault");
    size_t bad = verify(p, n, 5);
    check(bad == n, "after the failed pause the allocation is still active and intact (%zu)", bad);
    print_stats("after-failed-pause");

    rc = p_tms_pause("f");
    check(rc == TMS_OK, "pausing again succeeds (rc %d)", rc);
    rc = p_tms_resume("f");
    check(rc == TMS_OK, "resume (rc %d)", rc);
    if (rc == TMS_OK) {
        bad = verify(p, n, 5);
        check(bad == n, "contents restored (first difference at %zu)", bad);
    }
    rc = cudaFree(p);
    check(rc == CUDA_SUCCESS, "cudaFree (rc %d)", rc);
    check(p_tms_region_exit() == TMS_OK, "leave region f");
    check(fake_cuda_malloc_calls() == m0 && fake_cuda_free_calls() == 0,
          "nothing reached the runtime");
    return finish("fault");
}

/* Touch a paused allocation: the process must die of SIGSEGV. */
static int mode_touch_paused(void) {
    struct rlimit no_core = {0, 0};
    setrlimit(RLIMIT_CORE, &no_core); /* no core file from the expected crash */
    int rc = p_tms_region_enter(1, "t", 0, NULL);
    check(rc == TMS_OK, "tms_region_enter(t) (rc %d)", rc);
    void *p = NULL;
    rc = cudaMalloc(&p, MIB);
    check(rc == CUDA_SUCCESS && p != NULL, "cudaMalloc (rc %d)", rc);
    if (p == NULL) {
        return finish("touch-paused");
    }
    volatile unsigned char *v = p;
    v[0] = 42;
    check(v[0] == 42, "the active allocation is readable and writable");
    rc = p_tms_pause("t");
    check(rc == TMS_OK, "tms_pause(t) (rc %d)", rc);
    if (failures) {
        return finish("touch-paused");
    }
    printf("TOUCH: reading the paused allocation at %p\n", p);
    fflush(stdout);
    unsigned char x = v[MIB / 2];
    check(0, "reading a paused allocation did not fault (read %u)", x);
    return finish("touch-paused");
}

struct thread_result {
    int rc;
    void *p;
};

static void *thread_alloc(void *arg) {
    struct thread_result *r = arg;
    r->rc = cudaMalloc(&r->p, 64 * 1024);
    return NULL;
}

/* TMS_INIT_ENABLE=1 (with TMS_INIT_TAG=boot, TMS_INIT_ENABLE_CPU_BACKUP=1): every thread
 * starts inside a region, without any region call. */
static int mode_init_enable(void) {
    long m0 = fake_cuda_malloc_calls();
    long f0 = fake_cuda_free_calls();
    const size_t n = 2 * MIB + 17;

    void *p = NULL;
    int rc = cudaMalloc(&p, n);
    check(rc == CUDA_SUCCESS && p != NULL, "plain cudaMalloc (rc %d)", rc);
    check(fake_cuda_malloc_calls() == m0, "it does not reach the runtime: it is pauseable");
    check(p_tms_is_active() == 1, "the library is active");
    print_region("init");

    struct thread_result tr = {-1, NULL};
    pthread_t t;
    check(pthread_create(&t, NULL, thread_alloc, &tr) == 0 && pthread_join(t, NULL) == 0,
          "run a second thread");
    check(tr.rc == CUDA_SUCCESS && tr.p != NULL && fake_cuda_malloc_calls() == m0,
          "a new thread's cudaMalloc is pauseable too (rc %d)", tr.rc);

    rc = p_tms_region_enter(0, NULL, 0, NULL);
    check(rc == TMS_OK, "tms_region_enter(disabled) (rc %d)", rc);
    void *o = NULL;
    rc = cudaMalloc(&o, 64);
    check(rc == CUDA_SUCCESS && fake_cuda_malloc_calls() == m0 + 1,
          "a disabled scope still reaches the runtime (rc %d)", rc);
    check(p_tms_region_exit() == TMS_OK, "leave the disabled scope");

    if (p == NULL) {
        return finish("init-enable");
    }
    fill(p, n, 9);
    rc = p_tms_pause("boot");
    check(rc == TMS_OK, "tms_pause(boot) (rc %d)", rc);
    print_stats("paused");
    rc = p_tms_resume("boot");
    check(rc == TMS_OK, "tms_resume(boot) (rc %d)", rc);
    if (rc == TMS_OK) {
        size_t bad = verify(p, n, 9);
        check(bad == n, "TMS_INIT_ENABLE_CPU_BACKUP kept the contents (first difference at %zu)",
              bad);
    }
    check(cudaFree(p) == CUDA_SUCCESS && cudaFree(tr.p) == CUDA_SUCCESS,
          "cudaFree of the pauseable allocations");
    check(fake_cuda_free_calls() == f0, "they did not reach the runtime");
    check(cudaFree(o) == CUDA_SUCCESS && fake_cuda_free_calls() == f0 + 1,
          "cudaFree of runtime memory reaches the runtime");
    check(fake_cuda_foreign_frees() == 0 && fake_cuda_live() == 0,
          "the runtime got back exactly what it handed out");
    print_stats("freed");
    return finish("init-enable");
}

/* A malformed TMS_* variable (set by the caller): everything passes through, the region API
 * refuses with a message naming the variable. */
static int mode_malformed(void) {
    long m0 = fake_cuda_malloc_calls();
    long f0 = fake_cuda_free_calls();
    void *a = NULL;
    int rc = cudaMalloc(&a, 256);
    check(rc == CUDA_SUCCESS && fake_cuda_malloc_calls() == m0 + 1,
          "cudaMalloc reaches the runtime (rc %d)", rc);
    rc = p_tms_region_enter(1, "kv", 0, NULL);
    check(rc == TMS_ERR_INVALID_ARGUMENT, "tms_region_enter is refused (rc %d)", rc);
    report_error("region-enter");
    void *b = NULL;
    rc = cudaMalloc(&b, 512);
    check(rc == CUDA_SUCCESS && fake_cuda_malloc_calls() == m0 + 2,
          "cudaMalloc after the refused region still reaches the runtime (rc %d)", rc);
    rc = cudaFree(a);
    check(rc == CUDA_SUCCESS, "cudaFree (rc %d)", rc);
    rc = cudaFree(b);
    check(rc == CUDA_SUCCESS, "cudaFree (rc %d)", rc);
    check(fake_cuda_free_calls() == f0 + 2 && fake_cuda_foreign_frees() == 0 &&
              fake_cuda_live() == 0,
          "cudaFree reaches the runtime");
    check(p_tms_is_active() == 0, "the library is not active");
    return finish("malformed");
}

/* A malformed TMS_* variable (set by the caller) met first by PyTorch's allocator (torch mode):
 * it refuses, and PyTorch reads no tms_last_error, so stderr must name the variable. */
static int mode_torch_malformed(void) {
    void *p = p_tms_torch_malloc(4096, 0, NULL);
    check(p == NULL, "tms_torch_malloc refuses");
    report_error("torch-malloc");
    check(strstr(last_error(), "TMS_INIT_ENABLE") != NULL, "tms_last_error names the variable");
    check(p_tms_torch_malloc(4096, 0, NULL) == NULL, "and refuses again (said once)");
    return finish("torch-malformed");
}

/* A device that cannot start (TMS_BACKEND=cuda where no CUDA device can be used): the settings
 * are fine, so a region can be entered, but the library cannot start; allocations in the region
 * fail with cudaErrorInitializationError, others pass through. */
static int mode_bad_device(void) {
    long m0 = fake_cuda_malloc_calls();
    int rc = p_tms_region_enter(1, "kv", 0, NULL);
    check(rc == TMS_OK, "tms_region_enter (rc %d)", rc);
    for (int i = 0; i < 2; i++) {
        void *p = NULL;
        rc = cudaMalloc(&p, MIB);
        check(rc == CUDA_ERROR_INITIALIZATION && p == NULL,
              "cudaMalloc in a region fails with cudaErrorInitializationError (try %d, rc %d)", i,
              rc);
        report_error("alloc");
    }
    check(fake_cuda_malloc_calls() == m0, "the failed allocations did not reach the runtime");
    char name[16];
    rc = p_tms_init(name, sizeof name, NULL);
    check(rc == TMS_ERR_UNSUPPORTED || rc == TMS_ERR_DRIVER,
          "tms_init reports the same failure (rc %d)", rc);
    report_error("init");
    check(p_tms_region_exit() == TMS_OK, "leave the region");
    void *o = NULL;
    rc = cudaMalloc(&o, 64);
    check(rc == CUDA_SUCCESS && fake_cuda_malloc_calls() == m0 + 1,
          "outside the region cudaMalloc reaches the runtime (rc %d)", rc);
    check(cudaFree(o) == CUDA_SUCCESS && fake_cuda_live() == 0, "cudaFree reaches the runtime");
    check(p_tms_is_active() == 0, "the library is not active");
    return finish("bad-device");
}

/* The parent's side of the fork tests: in region "parent" (CPU backup), one allocation of `n`
 * bytes filled with pattern 11; NULL if it failed (checked). */
static void *parent_in_region(size_t n) {
    int rc = p_tms_region_enter(1, "parent", 1, NULL);
    check(rc == TMS_OK, "tms_region_enter(parent, cpu_backup) (rc %d)", rc);
    void *p = NULL;
    rc = cudaMalloc(&p, n);
    check(rc == CUDA_SUCCESS && p != NULL, "cudaMalloc in the parent (rc %d)", rc);
    if (p != NULL) {
        fill(p, n, 11);
    }
    return p;
}

/* A fork child (the runtime's counts were m0 and f0 at the fork): its hooks pass through to the
 * runtime and the API refuses, saying why; exits with the result of its checks as `name`. */
static void child_passes_through(const char *name, long m0, long f0) {
    who = " child";
    failures = 0;
    print_region("child");
    void *c = NULL;
    int rc = cudaMalloc(&c, 4096);
    check(rc == CUDA_SUCCESS && c != NULL && fake_cuda_malloc_calls() == m0 + 1,
          "cudaMalloc inside the inherited region passes through to the runtime (rc %d)", rc);
    check(p_tms_is_active() == 0, "the library reports itself inactive in the child");
    rc = p_tms_pause(NULL);
    check(rc == TMS_ERR_INVALID_STATE, "tms_pause in the child is refused (rc %d)", rc);
    report_error("child-pause");
    check(strstr(last_error(), "fork") != NULL, "the message says why");
    rc = cudaFree(c);
    check(rc == CUDA_SUCCESS && fake_cuda_free_calls() == f0 + 1 && fake_cuda_foreign_frees() == 0,
          "cudaFree in the child passes through to the runtime (rc %d)", rc);
    exit(finish(name));
}

/* fork() after the library started: the child's hooks pass through, the parent carries on. */
static int mode_fork(void) {
    const size_t n = MIB;
    int rc = TMS_OK;
    void *p = parent_in_region(n);
    if (p == NULL) {
        return finish("fork");
    }
    long m0 = fake_cuda_malloc_calls();
    long f0 = fake_cuda_free_calls();
    fflush(stdout);

    pid_t pid = fork();
    if (pid < 0) {
        check(0, "fork failed");
        return finish("fork");
    }
    if (pid == 0) {
        child_passes_through("fork-child", m0, f0);
    }
    int status = 0;
    check(waitpid(pid, &status, 0) == pid, "wait for the child");
    check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child passed (status %#x)", status);

    check(p_tms_is_active() == 1, "the library is still active in the parent");
    rc = p_tms_pause("parent");
    check(rc == TMS_OK, "tms_pause in the parent (rc %d)", rc);
    rc = p_tms_resume("parent");
    check(rc == TMS_OK, "tms_resume in the parent (rc %d)", rc);
    if (rc == TMS_OK) {
        size_t bad = verify(p, n, 11);
        check(bad == n, "the parent's contents survived (first difference at %zu)", bad);
    }
    void *q = NULL;
    rc = cudaMalloc(&q, n);
    check(rc == CUDA_SUCCESS && fake_cuda_malloc_calls() == m0,
          "the parent's cudaMalloc in a region is still pauseable (rc %d)", rc);
    check(cudaFree(p) == CUDA_SUCCESS && cudaFree(q) == CUDA_SUCCESS, "cudaFree in the parent");
    check(fake_cuda_free_calls() == f0, "the parent's frees did not reach the runtime");
    check(p_tms_region_exit() == TMS_OK, "leave region parent");
    return finish("fork");
}

/* A pause of every tag, on a thread of its own. */
static void *pause_all(void *arg) {
    (void)arg;
    return (void *)(intptr_t)p_tms_pause(NULL);
}

/* Set once pause_kv's tms_pause has returned. */
static atomic_int pause_kv_done;

/* A pause of tag kv, on a thread of its own. */
static void *pause_kv(void *arg) {
    (void)arg;
    int rc = p_tms_pause("kv");
    atomic_store(&pause_kv_done, 1);
    return (void *)(intptr_t)rc;
}

/* The hooks while tms_pause runs on another thread (each sync takes TMS_SIM_SYNC_DELAY_MS):
 * a cudaMalloc in the tag being paused returns without waiting for the pause and stays active;
 * a cudaFree of an allocation being paused waits for it, then succeeds; nothing is lost. */
static int mode_hooks_during_pause(void) {
    const size_t n = 2 * MIB;
    long f0 = fake_cuda_free_calls();
    check(p_tms_region_enter(1, "kv", 1, NULL) == TMS_OK, "enter region kv");
    void *kv = NULL, *kv2 = NULL, *fresh = NULL;
    check(cudaMalloc(&kv, n) == CUDA_SUCCESS && cudaMalloc(&kv2, n) == CUDA_SUCCESS,
          "cudaMalloc in kv");
    fill(kv, n, 5);
    pthread_t t;
    check(pthread_create(&t, NULL, pause_kv, NULL) == 0, "start a pause on a thread");
    usleep(300 * 1000);
    int rc = cudaMalloc(&fresh, n);
    /* Not a time limit: had it waited for the pause, the pause would be over. */
    int waited = atomic_load(&pause_kv_done);
    check(rc == CUDA_SUCCESS && fresh != NULL, "cudaMalloc during the pause (rc %d)", rc);
    check(!waited, "cudaMalloc returned while the pause still ran");
    rc = cudaFree(kv2);
    check(rc == CUDA_SUCCESS, "cudaFree of an allocation being paused (rc %d)", rc);
    void *ret = NULL;
    check(pthread_join(t, &ret) == 0 && (intptr_t)ret == TMS_OK, "the pause (rc %d)",
          (int)(intptr_t)ret);
    fill(fresh, n, 6);
    check(verify(fresh, n, 6) == n, "the allocation made during the pause is active");
    check(p_tms_resume("kv") == TMS_OK, "resume kv");
    check(verify(kv, n, 5) == n, "kv's contents after the resume");
    check(cudaFree(kv) == CUDA_SUCCESS && cudaFree(fresh) == CUDA_SUCCESS, "cudaFree the rest");
    check(fake_cuda_free_calls() == f0, "no free reached the runtime");
    check(p_tms_region_exit() == TMS_OK, "leave region kv");
    return finish("hooks-during-pause");
}

/* _Fork() (glibc >= 2.34) after the library started: it runs no pthread_atfork handler, yet the
 * child shares none of the parent's device state either: its hooks must pass through and the
 * API must refuse, as after fork(); also when another thread of the parent was inside a pause
 * (holding the engine's locks) at that moment, where the child must not wait for them. */
static int mode_fork_raw(void) {
    const size_t n = MIB;
    int rc = TMS_OK;
    void *p = parent_in_region(n);
    if (p == NULL) {
        return finish("fork-raw");
    }
    long m0 = fake_cuda_malloc_calls();
    long f0 = fake_cuda_free_calls();
    fflush(stdout);

    pid_t pid = _Fork();
    if (pid < 0) {
        check(0, "_Fork failed");
        return finish("fork-raw");
    }
    if (pid == 0) {
        alarm(20);
        child_passes_through("fork-raw-child", m0, f0);
    }
    int status = 0;
    check(waitpid(pid, &status, 0) == pid, "wait for the child");
    check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child passed (status %#x)", status);

    /* A pause in flight on another thread (each sync takes TMS_SIM_SYNC_DELAY_MS). */
    pthread_t t;
    check(pthread_create(&t, NULL, pause_all, NULL) == 0, "start a pause on a thread");
    usleep(300 * 1000);
    fflush(stdout);
    pid = _Fork();
    if (pid == 0) {
        alarm(5); /* a child that waits for the parent's locks dies of SIGALRM */
        who = " busy-child";
        failures = 0;
        rc = p_tms_pause(NULL);
        check(rc == TMS_ERR_INVALID_STATE, "tms_pause in the child is refused at once (rc %d)",
              rc);
        exit(finish("fork-raw-busy-child"));
    }
    status = 0;
    check(pid > 0 && waitpid(pid, &status, 0) == pid, "wait for the second child");
    check(WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "the second child passed without waiting (status %#x%s)", status,
          WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM ? ": killed by SIGALRM, it hung"
                                                              : "");
    void *prc = NULL;
    pthread_join(t, &prc);
    check((intptr_t)prc == TMS_OK, "the parent's pause (rc %d)", (int)(intptr_t)prc);
    rc = p_tms_resume(NULL);
    check(rc == TMS_OK, "tms_resume in the parent (rc %d)", rc);
    check(verify(p, n, 11) == n, "the parent's contents survived");
    check(cudaFree(p) == CUDA_SUCCESS && fake_cuda_free_calls() == f0, "cudaFree in the parent");
    check(p_tms_region_exit() == TMS_OK, "leave region parent");
    return finish("fork-raw");
}

/* The control socket (run with TMS_CONTROL=1 and TMS_SOCKET_DIR set): the path
 * tms_control_socket gives is where the socket is, whatever bytes the folder's name holds. */
static int mode_socket_path(void) {
    char path[4096];
    size_t len = 0;
    int rc = p_tms_control_socket(path, sizeof path, &len);
    check(rc == TMS_OK && len == strlen(path), "tms_control_socket (rc %d, %zu)", rc, len);
    if (rc != TMS_OK) {
        report_error("control-socket");
        return finish("socket-path");
    }
    struct stat st;
    check(stat(path, &st) == 0 && S_ISSOCK(st.st_mode), "the socket is at the path given: %s",
          path);
    size_t need = 0;
    rc = p_tms_control_socket(NULL, 0, &need);
    check(rc == TMS_ERR_BUFFER_TOO_SMALL && need == len,
          "with no buffer it says how long the path is (rc %d, %zu)", rc, need);
    return finish("socket-path");
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s basic|oom|fault|touch-paused|init-enable|malformed|torch-malformed|"
                        "bad-device|fork|fork-raw|socket-path\n",
                argv[0]);
        return 2;
    }
    if (!load_api(RTLD_DEFAULT)) {
        printf("RESULT: FAIL %s (libtms.so API not found)\n", argv[1]);
        return 1;
    }
    const char *mode = argv[1];
    if (strcmp(mode, "basic") == 0) {
        return mode_basic();
    } else if (strcmp(mode, "oom") == 0) {
        return mode_oom();
    } else if (strcmp(mode, "fault") == 0) {
        return mode_fault();
    } else if (strcmp(mode, "touch-paused") == 0) {
        return mode_touch_paused();
    } else if (strcmp(mode, "init-enable") == 0) {
        return mode_init_enable();
    } else if (strcmp(mode, "malformed") == 0) {
        return mode_malformed();
    } else if (strcmp(mode, "torch-malformed") == 0) {
        return mode_torch_malformed();
    } else if (strcmp(mode, "bad-device") == 0) {
        return mode_bad_device();
    } else if (strcmp(mode, "fork") == 0) {
        return mode_fork();
    } else if (strcmp(mode, "hooks-during-pause") == 0) {
        return mode_hooks_during_pause();
    } else if (strcmp(mode, "fork-raw") == 0) {
        return mode_fork_raw();
    } else if (strcmp(mode, "socket-path") == 0) {
        return mode_socket_path();
    }
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
}
