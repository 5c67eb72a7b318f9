/*
 * Test program of NCCL's communicators as the tag "nccl" (built by tests/build.rs, run by
 * tests/tests/nccl.rs on the simulated device), linked against the NCCL test double
 * (fake_nccl.c, found through LD_LIBRARY_PATH: the test picks the NCCL with or without
 * ncclCommSuspend) and the fake CUDA runtime. libtms.so is preloaded, except in mode "adopt",
 * where the program loads it locally as PyTorch's pluggable allocator does and hands its
 * communicators over.
 *
 * Output as e2e_prog.c's (checks.h). Usage errors exit 2.
 */
#define _GNU_SOURCE
#include "tms.h"
#include "checks.h"
#include "fake_nccl.h"

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

/* From the fake runtime. */
int cudaMalloc(void **dev_ptr, size_t size);
int cudaFree(void *ptr);
long fake_cuda_malloc_calls(void);
long fake_cuda_live(void);

#define MIB ((size_t)1 << 20)

#define TMS_FUNCTIONS(X)                                                                     \
    X(tms_last_error)                                                                        \
    X(tms_region_enter)                                                                      \
    X(tms_region_exit)                                                                       \
    X(tms_pause)                                                                             \
    X(tms_resume)                                                                            \
    X(tms_stats_json)                                                                        \
    X(tms_nccl_adopt)                                                                        \
    X(tms_nccl_set_in_all)                                                                   \
    X(tms_nccl_get_in_all)                                                                   \
    X(tms_nccl_set_registered)                                                               \
    X(tms_nccl_get_registered)

TMS_FUNCTIONS(DECLARE_POINTER)

DEFINE_LOAD_API(TMS_FUNCTIONS)

static ncclComm_t make_comm(void) {
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    ncclComm_t c = NULL;
    int rc = ncclCommInitRank(&c, 1, id, 0);
    check(rc == ncclSuccess && c != NULL, "ncclCommInitRank (rc %d)", rc);
    return c;
}

/* A one-rank all-reduce of 1024 floats: 1 when it ran and its result is right. */
static int all_reduce_ok(ncclComm_t c) {
    float in[1024], out[1024];
    for (int i = 0; i < 1024; i++) {
        in[i] = (float)i * 0.5f;
        out[i] = -1.0f;
    }
    if (ncclAllReduce(in, out, 1024, ncclFloat32, ncclSum, c, NULL) != ncclSuccess) {
        return 0;
    }
    return memcmp(in, out, sizeof in) == 0;
}

/* A pauseable allocation of `size` bytes in a region tagged `tag`. */
static void *alloc_in(const char *tag, size_t size) {
    void *p = NULL;
    check(p_tms_region_enter(1, tag, 0, NULL) == TMS_OK, "enter region %s", tag);
    int rc = cudaMalloc(&p, size);
    check(rc == 0 && p != NULL, "cudaMalloc(%zu) in region %s (rc %d)", size, tag, rc);
    p_tms_region_exit();
    return p;
}

/* Communicators made every way, counted, suspended and resumed by the tag; every tag leaves
 * them unless asked; all-reduce right before and after; memory given back while suspended. */
static int mode_flow(void) {
    print_stats("start");
    ncclComm_t a = make_comm();
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    ncclComm_t b = NULL;
    check(ncclCommInitRankConfig(&b, 1, id, 0, NULL) == ncclSuccess, "ncclCommInitRankConfig");
    ncclComm_t s = NULL, none = (ncclComm_t)1;
    check(ncclCommSplit(a, 0, 0, &s, NULL) == ncclSuccess && s != NULL, "ncclCommSplit");
    check(ncclCommSplit(a, NCCL_SPLIT_NOCOLOR, 0, &none, NULL) == ncclSuccess && none == NULL,
          "ncclCommSplit without a color makes none");
    ncclComm_t all[2] = {NULL, NULL};
    check(ncclCommInitAll(all, 2, NULL) == ncclSuccess, "ncclCommInitAll");
    check(ncclCommDestroy(all[0]) == ncclSuccess, "ncclCommDestroy");
    check(ncclCommFinalize(all[1]) == ncclSuccess && ncclCommAbort(all[1]) == ncclSuccess,
          "ncclCommFinalize, ncclCommAbort");
    check(fake_nccl_live() == 3, "three communicators live (%ld)", fake_nccl_live());
    print_stats("made");

    void *kv = alloc_in("kv", 4 * MIB);
    check(all_reduce_ok(a), "all-reduce before the pause");
    long live0 = fake_cuda_live();
    int rc = p_tms_pause("nccl");
    check(rc == TMS_OK, "tms_pause(\"nccl\") (rc %d: %s)", rc, last_error());
    check(fake_nccl_suspended() == 3, "every communicator suspended (%ld)",
          fake_nccl_suspended());
    check(fake_cuda_live() == live0 - 3, "their memory given back (%ld -> %ld)", live0,
          fake_cuda_live());
    check(!all_reduce_ok(a), "a suspended communicator is not used");
    print_stats("suspended");
    check(p_tms_pause("nccl") == TMS_OK && fake_nccl_suspend_calls() == 3,
          "pausing it again does nothing (%ld suspend calls)", fake_nccl_suspend_calls());

    check(p_tms_pause(NULL) == TMS_OK && p_tms_resume(NULL) == TMS_OK,
          "pause and resume of every tag");
    check(fake_nccl_suspended() == 3 && fake_nccl_resume_calls() == 0,
          "every tag leaves the communicators by default");
    int in_all = -1;
    check(p_tms_nccl_get_in_all(&in_all) == TMS_OK && in_all == 0, "in_all is off (%d)",
          in_all);

    rc = p_tms_resume("nccl");
    check(rc == TMS_OK, "tms_resume(\"nccl\") (rc %d: %s)", rc, last_error());
    check(fake_nccl_suspended() == 0 && fake_cuda_live() == live0,
          "every communicator resumed, its memory taken again");
    check(all_reduce_ok(a) && all_reduce_ok(b) && all_reduce_ok(s),
          "all-reduce right after the resume");
    print_stats("resumed");
    ncclCommDestroy(a);
    ncclCommDestroy(b);
    ncclCommDestroy(s);
    cudaFree(kv);
    print_stats("destroyed");
    return finish("flow");
}

/* TMS_NCCL_IN_ALL=1: every tag includes them; tms_nccl_set_in_all(0) turns that off. */
static int mode_in_all(void) {
    ncclComm_t a = make_comm();
    void *kv = alloc_in("kv", 4 * MIB);
    int in_all = -1;
    check(p_tms_nccl_get_in_all(&in_all) == TMS_OK && in_all == 1, "in_all is on (%d)",
          in_all);
    check(p_tms_pause(NULL) == TMS_OK, "pause of every tag (%s)", last_error());
    check(fake_nccl_suspended() == 1, "it suspended the communicator");
    print_stats("paused");
    check(p_tms_resume(NULL) == TMS_OK, "resume of every tag (%s)", last_error());
    check(fake_nccl_suspended() == 0 && all_reduce_ok(a), "it resumed the communicator");
    check(p_tms_nccl_set_in_all(0) == TMS_OK, "tms_nccl_set_in_all(0)");
    check(p_tms_pause(NULL) == TMS_OK && fake_nccl_suspended() == 0,
          "then every tag leaves it");
    p_tms_resume(NULL);
    cudaFree(kv);
    ncclCommDestroy(a);
    return finish("in_all");
}

/* A suspend failing on the second communicator resumes the first; a resume failing on the
 * second suspends the first again. */
static int mode_rollback(void) {
    ncclComm_t c[3] = {make_comm(), make_comm(), make_comm()};
    setenv("FAKE_NCCL_FAIL_SUSPEND", "2", 1);
    int rc = p_tms_pause("nccl");
    check(rc == TMS_ERR_DRIVER, "tms_pause(\"nccl\") fails with TMS_ERR_DRIVER (rc %d)", rc);
    report_error("suspend");
    check(fake_nccl_suspended() == 0, "nothing stays suspended (%ld)", fake_nccl_suspended());
    check(fake_nccl_suspend_calls() == 2 && fake_nccl_resume_calls() == 1,
          "the first was resumed (%ld suspends, %ld resumes)", fake_nccl_suspend_calls(),
          fake_nccl_resume_calls());
    check(all_reduce_ok(c[0]) && all_reduce_ok(c[1]) && all_reduce_ok(c[2]),
          "every communicator works");
    print_stats("after-suspend-failure");
    unsetenv("FAKE_NCCL_FAIL_SUSPEND");
    check(p_tms_pause("nccl") == TMS_OK && fake_nccl_suspended() == 3, "the next try works");
    setenv("FAKE_NCCL_FAIL_RESUME", "3", 1); /* the second of this resume */
    rc = p_tms_resume("nccl");
    check(rc == TMS_ERR_DRIVER, "tms_resume(\"nccl\") fails (rc %d)", rc);
    report_error("resume");
    check(fake_nccl_suspended() == 3, "all stay suspended (%ld)", fake_nccl_suspended());
    unsetenv("FAKE_NCCL_FAIL_RESUME");
    check(p_tms_resume("nccl") == TMS_OK && fake_nccl_suspended() == 0, "the next try works");
    for (int i = 0; i < 3; i++) {
        ncclCommDestroy(c[i]);
    }
    return finish("rollback");
}

/* An NCCL without ncclCommSuspend: the tag says so with its version, and every other tag
 * pauses as before (with TMS_NCCL_IN_ALL=1 too). */
static int mode_old(void) {
    ncclComm_t a = make_comm();
    void *kv = alloc_in("kv", 4 * MIB);
    int rc = p_tms_pause("nccl");
    check(rc == TMS_ERR_UNSUPPORTED, "tms_pause(\"nccl\") is unsupported (rc %d)", rc);
    report_error("pause");
    print_stats("old");
    rc = p_tms_pause(NULL);
    check(rc == TMS_OK, "pause of every tag still works (rc %d: %s)", rc, last_error());
    print_stats("paused");
    check(p_tms_resume(NULL) == TMS_OK && all_reduce_ok(a), "resume of every tag");
    cudaFree(kv);
    ncclCommDestroy(a);
    return finish("old");
}

/* Registered buffers: kept mapped by pauses (keep), or the pause refused naming them
 * (refuse); deregistered, or their communicator ended, they pause again. */
static int mode_registered(void) {
    ncclComm_t c = make_comm();
    char *a = alloc_in("kv", 4 * MIB);
    char *b = alloc_in("kv", 4 * MIB);
    char policy[16];
    check(p_tms_nccl_get_registered(policy, sizeof policy, NULL) == TMS_OK &&
              strcmp(policy, "keep") == 0,
          "the default is keep (%s)", policy);
    void *h = NULL, *w = NULL;
    check(ncclCommRegister(c, a + 4096, 8192, &h) == ncclSuccess && h != NULL,
          "ncclCommRegister");
    check(p_tms_pause("kv") == TMS_OK, "pause of kv (%s)", last_error());
    print_stats("kept");
    memset(a, 1, 4 * MIB); /* still mapped: on the sim, touching a paused range faults */
    check(p_tms_resume("kv") == TMS_OK, "resume of kv");
    check(p_tms_nccl_set_registered("refuse") == TMS_OK, "set refuse");
    int rc = p_tms_pause("kv");
    check(rc == TMS_ERR_INVALID_STATE, "a pause of kv is refused (rc %d)", rc);
    report_error("refused");
    print_stats("refused");
    check(p_tms_nccl_set_registered("sometimes") == TMS_ERR_INVALID_ARGUMENT,
          "an unknown policy is refused");
    check(ncclCommDeregister(c, h) == ncclSuccess, "ncclCommDeregister");
    check(ncclCommWindowRegister(c, b, 4 * MIB, &w, 0) == ncclSuccess, "ncclCommWindowRegister");
    rc = p_tms_pause("kv");
    check(rc == TMS_ERR_INVALID_STATE, "refused for the window (rc %d)", rc);
    report_error("window");
    check(p_tms_nccl_set_registered("keep") == TMS_OK, "set keep");
    check(p_tms_pause("kv") == TMS_OK, "pause of kv");
    print_stats("window-kept");
    p_tms_resume("kv");
    check(ncclCommDestroy(c) == ncclSuccess, "ncclCommDestroy ends its registrations");
    check(p_tms_pause("kv") == TMS_OK, "pause of kv");
    print_stats("unregistered");
    p_tms_resume("kv");
    cudaFree(a);
    cudaFree(b);
    return finish("registered");
}

/* A deregistration going on in the background (ncclInProgress, as on a non-blocking
 * communicator): its buffer stays kept while the communicator's calls run, and pauses once they
 * have ended well. */
static int mode_deregistering(void) {
    ncclComm_t c = make_comm();
    char *a = alloc_in("kv", 4 * MIB);
    void *h = NULL;
    check(ncclCommRegister(c, a + 4096, 8192, &h) == ncclSuccess && h != NULL,
          "ncclCommRegister");
    setenv("FAKE_NCCL_DEREGISTER_ASYNC", "1", 1);
    int rc = ncclCommDeregister(c, h);
    check(rc == ncclInProgress, "ncclCommDeregister goes on in the background (rc %d)", rc);
    unsetenv("FAKE_NCCL_DEREGISTER_ASYNC");
    check(p_tms_pause("kv") == TMS_OK, "pause of kv (%s)", last_error());
    print_stats("running");
    memset(a, 1, 4 * MIB); /* still mapped: on the sim, touching a paused range faults */
    check(p_tms_resume("kv") == TMS_OK, "resume of kv");
    check(p_tms_pause("kv") == TMS_OK, "pause of kv (%s)", last_error());
    print_stats("ended");
    check(p_tms_resume("kv") == TMS_OK, "resume of kv");
    cudaFree(a);
    ncclCommDestroy(c);
    return finish("deregistering");
}

/* TMS_INIT_ENABLE=1 (every cudaMalloc pauseable): NCCL's own allocations, making a
 * communicator and in ncclMemAlloc, pass through; the tag is reserved. */
static int mode_own_memory(void) {
    long m0 = fake_cuda_malloc_calls();
    ncclComm_t c = make_comm();
    void *p = NULL;
    check(ncclMemAlloc(&p, MIB) == ncclSuccess && p != NULL, "ncclMemAlloc");
    check(fake_cuda_malloc_calls() == m0 + 2, "both reached the CUDA runtime (%ld calls)",
          fake_cuda_malloc_calls() - m0);
    void *q = NULL;
    check(cudaMalloc(&q, MIB) == 0, "cudaMalloc");
    check(fake_cuda_malloc_calls() == m0 + 2, "a cudaMalloc of the program is pauseable");
    print_stats("own");
    int rc = p_tms_region_enter(1, "nccl", 0, NULL);
    check(rc == TMS_ERR_INVALID_ARGUMENT, "a region with the tag nccl is refused (rc %d)", rc);
    report_error("reserved");
    ncclMemFree(p);
    cudaFree(q);
    ncclCommDestroy(c);
    return finish("own_memory");
}

/* TMS_INIT_ENABLE=1: the memory NCCL takes again while the library resumes its communicators
 * (ncclCommResume, called by tms_resume("nccl") on a thread inside a region) is NCCL's, as
 * when it made them: it reaches the CUDA runtime, and a pause of every other tag leaves it. */
static int mode_own_memory_resume(void) {
    ncclComm_t c = make_comm();
    long m0 = fake_cuda_malloc_calls();
    int rc = p_tms_pause("nccl");
    check(rc == TMS_OK, "tms_pause(\"nccl\") (rc %d: %s)", rc, last_error());
    rc = p_tms_resume("nccl");
    check(rc == TMS_OK, "tms_resume(\"nccl\") (rc %d: %s)", rc, last_error());
    check(fake_cuda_malloc_calls() == m0 + 1,
          "NCCL's allocation in ncclCommResume reached the CUDA runtime (%ld calls)",
          fake_cuda_malloc_calls() - m0);
    print_stats("resumed");
    fflush(stdout);
    rc = p_tms_pause(NULL);
    check(rc == TMS_OK, "pause of every tag (rc %d: %s)", rc, last_error());
    fflush(stdout);
    check(all_reduce_ok(c), "the communicator works while every other tag is paused");
    p_tms_resume(NULL);
    ncclCommDestroy(c);
    return finish("own_memory_resume");
}

/* libtms.so loaded locally (torch mode): communicators are not seen being made; handed over,
 * they pause with the tag, and handing over none forgets them. */
static int mode_adopt(void) {
    const char *path = getenv("TMS_TEST_LIBTMS");
    void *h = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (h == NULL || !load_api(h)) {
        check(0, "load %s: %s", path ? path : "(TMS_TEST_LIBTMS unset)", dlerror());
        return finish("adopt");
    }
    ncclComm_t c[2] = {make_comm(), make_comm()};
    check(p_tms_pause("nccl") == TMS_OK && fake_nccl_suspended() == 0,
          "communicators not handed over are not known");
    uint64_t list[2] = {(uint64_t)(uintptr_t)c[0], (uint64_t)(uintptr_t)c[1]};
    check(p_tms_nccl_adopt(list, 2) == TMS_OK, "tms_nccl_adopt");
    int rc = p_tms_pause("nccl");
    check(rc == TMS_OK && fake_nccl_suspended() == 2, "handed over, they are suspended (%s)",
          last_error());
    print_stats("adopted");
    check(p_tms_resume("nccl") == TMS_OK && all_reduce_ok(c[0]) && all_reduce_ok(c[1]),
          "and resumed");
    check(p_tms_nccl_adopt(NULL, 0) == TMS_OK, "hand over none");
    print_stats("forgotten");
    ncclCommDestroy(c[0]);
    ncclCommDestroy(c[1]);
    return finish("adopt");
}

/* For tmsctl: two communicators and an allocation, then commands on stdin ("state", "quit"). */
static int mode_serve(void) {
    ncclComm_t c[2] = {make_comm(), make_comm()};
    void *kv = alloc_in("kv", 4 * MIB);
    printf("READY %d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin) != NULL) {
        if (strncmp(line, "state", 5) == 0) {
            printf("STATE suspended=%ld live_memory=%ld allreduce=%d\n", fake_nccl_suspended(),
                   fake_cuda_live(), all_reduce_ok(c[0]));
            fflush(stdout);
        } else if (strncmp(line, "quit", 4) == 0) {
            break;
        }
    }
    cudaFree(kv);
    ncclCommDestroy(c[0]);
    ncclCommDestroy(c[1]);
    return finish("serve");
}

static char pause_error[8192]; /* the pausing thread's last error */

static void *pause_nccl(void *arg) {
    (void)arg;
    int rc = p_tms_pause("nccl");
    snprintf(pause_error, sizeof pause_error, "%s", last_error());
    return (void *)(intptr_t)rc;
}

/* A suspend waiting for peers that are gone is ended by ncclCommAbort on another thread (as
 * PyTorch's watchdog does): the abort must reach NCCL, the pause then fail and undo, and the
 * survivor pause again. SIGALRM ends the program where the abort waits instead. */
static int mode_abort_hung(void) {
    ncclComm_t a = make_comm();
    ncclComm_t b = make_comm();
    setenv("FAKE_NCCL_BLOCK_SUSPEND", "2", 1); /* b's */
    pthread_t t;
    check(pthread_create(&t, NULL, pause_nccl, NULL) == 0, "start tms_pause(\"nccl\")");
    for (int i = 0; i < 5000 && fake_nccl_blocked() == 0; i++) {
        usleep(1000);
    }
    check(fake_nccl_blocked() == 1, "the suspend of the second communicator waits for peers");
    fflush(stdout);
    alarm(10);
    int rc = ncclCommAbort(b);
    check(rc == ncclSuccess, "ncclCommAbort ends it (rc %d)", rc);
    void *prc = NULL;
    pthread_join(t, &prc);
    alarm(0);
    check((intptr_t)prc == TMS_ERR_DRIVER, "the pause fails (rc %d)", (int)(intptr_t)prc);
    printf("ERROR pause %s\n", pause_error);
    check(fake_nccl_suspended() == 0 && all_reduce_ok(a), "the first was resumed");
    unsetenv("FAKE_NCCL_BLOCK_SUSPEND");
    print_stats("aborted");
    rc = p_tms_pause("nccl");
    check(rc == TMS_OK && fake_nccl_suspended() == 1, "the survivor pauses (rc %d: %s)", rc,
          last_error());
    check(p_tms_resume("nccl") == TMS_OK && all_reduce_ok(a), "and resumes");
    ncclCommDestroy(a);
    return finish("abort_hung");
}

/* Entry points this NCCL lacks (ncclCommShrink, ncclCommGrow), found as a program probing for
 * them finds them: libtms.so's interposers, which return ncclSystemError (2). */
static int mode_missing(void) {
    typedef int (*shrink_fn)(void *, int *, int, void **, void *, int);
    typedef int (*grow_fn)(void *, int, const void *, int, void **, void *);
    shrink_fn shrink = (shrink_fn)dlsym(RTLD_DEFAULT, "ncclCommShrink");
    grow_fn grow = (grow_fn)dlsym(RTLD_DEFAULT, "ncclCommGrow");
    check(shrink != NULL && grow != NULL, "the interposers are found");
    if (shrink == NULL || grow == NULL) {
        return finish("missing");
    }
    void *out = NULL;
    int rc = shrink(NULL, NULL, 0, &out, NULL, 0);
    check(rc == 2, "ncclCommShrink without an NCCL that has it (rc %d)", rc);
    rc = grow(NULL, 1, NULL, 0, &out, NULL);
    check(rc == 2, "ncclCommGrow without an NCCL that has it (rc %d)", rc);
    rc = shrink(NULL, NULL, 0, &out, NULL, 0);
    check(rc == 2, "ncclCommShrink again (rc %d)", rc);
    return finish("missing");
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s flow|in_all|rollback|old|registered|deregistering|own_memory|adopt|serve\n",
                argv[0]);
        return 2;
    }
    const char *mode = argv[1];
    if (strcmp(mode, "adopt") == 0) {
        return mode_adopt();
    }
    if (!load_api(RTLD_DEFAULT)) {
        printf("RESULT: FAIL %s (libtms.so API not found)\n", mode);
        return 1;
    }
    static const struct {
        const char *name;
        int (*run)(void);
    } modes[] = {
        {"flow", mode_flow},         {"in_all", mode_in_all},
        {"rollback", mode_rollback}, {"old", mode_old},
        {"registered", mode_registered}, {"deregistering", mode_deregistering},
        {"own_memory", mode_own_memory},
        {"own_memory_resume", mode_own_memory_resume},
        {"serve", mode_serve},       {"abort_hung", mode_abort_hung},
        {"missing", mode_missing},
    };
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        if (strcmp(mode, modes[i].name) == 0) {
            return modes[i].run();
        }
    }
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
}
