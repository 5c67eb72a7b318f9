/*
 * A test double of NCCL (built as libnccl.so.2 by tests/build.rs; never shipped), for the
 * tests of NCCL's communicators as the tag "nccl" on the simulated device.
 *
 * A communicator holds 1 MiB of "suspendable" memory from cudaMalloc (which reaches the fake
 * CUDA runtime, so its live count shows memory given back and taken again) and 4 KiB it keeps.
 * ncclCommSuspend frees the 1 MiB, ncclCommResume allocates it again; ncclAllReduce over one
 * rank copies its input and fails on a suspended communicator, as NCCL refuses to use one.
 * ncclCommMemStats answers as NCCL does (suspendable, suspended flag, persistent, total).
 *
 * Built twice: as NCCL 2.29.7, and with FAKE_NCCL_NO_SUSPEND as NCCL 2.21.5, which lacks
 * ncclCommSuspend, ncclCommResume and ncclCommMemStats.
 *
 * Fault injection, read at each call: FAKE_NCCL_FAIL_SUSPEND=N fails the N-th call of
 * ncclCommSuspend in the process (counting from 1) with ncclInvalidUsage, and
 * FAKE_NCCL_FAIL_RESUME=N the N-th call of ncclCommResume with ncclUnhandledCudaError;
 * FAKE_NCCL_BLOCK_SUSPEND=N makes the N-th ncclCommSuspend wait for peers that never come, until
 * ncclCommAbort on that communicator ends it with ncclRemoteError. FAKE_NCCL_DEREGISTER_ASYNC=N
 * makes a deregistration go on in the background, as on a non-blocking communicator: it answers
 * ncclInProgress, and ncclCommGetAsyncError answers ncclInProgress for the next N calls, then
 * ncclSuccess.
 */
#include "fake_nccl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int cudaMalloc(void **dev_ptr, size_t size);
int cudaFree(void *ptr);

#define MAGIC 0xfacec0deu
#define SUSPENDABLE ((uint64_t)1 << 20)
#define PERSISTENT ((uint64_t)4096)
#define MAX_COMMS 64

struct fake_comm {
    unsigned magic;
    int rank, nranks;
    int suspended;
    void *scratch;
    int aborting; /* ncclCommAbort began (atomic) */
    int in_call;  /* a call waits for peers (atomic): ncclCommAbort ends it first */
    long running; /* ncclCommGetAsyncError answers ncclInProgress this many more times */
};

static struct fake_comm *comms[MAX_COMMS];
static long suspend_calls, resume_calls, registrations;
static long blocked; /* calls waiting for peers (atomic) */
static char last_error[256];

static int valid(ncclComm_t c) {
    return c != NULL && c->magic == MAGIC;
}

static int make(ncclComm_t *out, int nranks, int rank) {
    if (out == NULL) {
        return ncclInvalidArgument;
    }
    for (int i = 0; i < MAX_COMMS; i++) {
        if (comms[i] == NULL) {
            struct fake_comm *c = calloc(1, sizeof *c);
            if (c == NULL || cudaMalloc(&c->scratch, SUSPENDABLE) != 0) {
                free(c);
                return ncclUnhandledCudaError;
            }
            c->magic = MAGIC;
            c->nranks = nranks;
            c->rank = rank;
            comms[i] = c;
            *out = c;
            return ncclSuccess;
        }
    }
    return ncclInvalidUsage;
}

static int end(ncclComm_t c) {
    if (!valid(c)) {
        return ncclInvalidArgument;
    }
    for (int i = 0; i < MAX_COMMS; i++) {
        if (comms[i] == c) {
            comms[i] = NULL;
        }
    }
    if (c->scratch != NULL) {
        cudaFree(c->scratch);
    }
    c->magic = 0;
    free(c);
    return ncclSuccess;
}

int ncclGetVersion(int *version) {
#ifdef FAKE_NCCL_NO_SUSPEND
    *version = 22105;
#else
    *version = 22907;
#endif
    return ncclSuccess;
}

int ncclGetUniqueId(ncclUniqueId *id) {
    memset(id, 7, sizeof *id);
    return ncclSuccess;
}

int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    if (id.internal[0] != 7) {
        return ncclInvalidArgument; /* the id did not arrive whole */
    }
    return make(comm, nranks, rank);
}

int ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, void *config) {
    (void)config;
    return ncclCommInitRank(comm, nranks, id, rank);
}

int ncclCommInitAll(ncclComm_t *comm, int ndev, const int *devlist) {
    (void)devlist;
    for (int i = 0; i < ndev; i++) {
        int rc = make(&comm[i], ndev, i);
        if (rc != ncclSuccess) {
            return rc;
        }
    }
    return ncclSuccess;
}

int ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, void *config) {
    (void)key;
    (void)config;
    if (!valid(comm)) {
        return ncclInvalidArgument;
    }
    if (color == NCCL_SPLIT_NOCOLOR) {
        *newcomm = NULL;
        return ncclSuccess;
    }
    return make(newcomm, 1, 0);
}

int ncclCommFinalize(ncclComm_t comm) {
    return valid(comm) ? ncclSuccess : ncclInvalidArgument;
}

int ncclCommDestroy(ncclComm_t comm) {
    return end(comm);
}

/* As NCCL's: it ends a call waiting on the communicator (its peers gone), then frees it. */
int ncclCommAbort(ncclComm_t comm) {
    if (valid(comm)) {
        __atomic_store_n(&comm->aborting, 1, __ATOMIC_SEQ_CST);
        while (__atomic_load_n(&comm->in_call, __ATOMIC_SEQ_CST)) {
            usleep(1000);
        }
    }
    return end(comm);
}

struct registration {
    void *buff;
    size_t size;
};

static int register_buffer(ncclComm_t comm, void *buff, size_t size, void **handle) {
    if (!valid(comm) || handle == NULL) {
        return ncclInvalidArgument;
    }
    struct registration *r = malloc(sizeof *r);
    if (r == NULL) {
        return ncclUnhandledCudaError;
    }
    r->buff = buff;
    r->size = size;
    *handle = r;
    registrations++;
    return ncclSuccess;
}

static int deregister_buffer(ncclComm_t comm, void *handle) {
    if (!valid(comm) || handle == NULL) {
        return ncclInvalidArgument;
    }
    free(handle);
    registrations--;
    const char *async = getenv("FAKE_NCCL_DEREGISTER_ASYNC");
    if (async != NULL) {
        comm->running = atol(async);
        return ncclInProgress;
    }
    return ncclSuccess;
}

int ncclCommRegister(ncclComm_t comm, void *buff, size_t size, void **handle) {
    return register_buffer(comm, buff, size, handle);
}

int ncclCommDeregister(ncclComm_t comm, void *handle) {
    return deregister_buffer(comm, handle);
}

int ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, void **win, int flags) {
    (void)flags;
    return register_buffer(comm, buff, size, win);
}

int ncclCommWindowDeregister(ncclComm_t comm, void *win) {
    return deregister_buffer(comm, win);
}

/* NCCL's fallback where CUDA's virtual memory management is off: plain cudaMalloc. */
int ncclMemAlloc(void **ptr, size_t size) {
    return cudaMalloc(ptr, size) == 0 ? ncclSuccess : ncclUnhandledCudaError;
}

int ncclMemFree(void *ptr) {
    return cudaFree(ptr) == 0 ? ncclSuccess : ncclUnhandledCudaError;
}

int ncclCommCuDevice(ncclComm_t comm, int *device) {
    if (!valid(comm)) {
        return ncclInvalidArgument;
    }
    *device = 0;
    return ncclSuccess;
}

int ncclCommGetAsyncError(ncclComm_t comm, int *async_error) {
    if (!valid(comm)) {
        return ncclInvalidArgument;
    }
    *async_error = ncclSuccess;
    if (comm->running > 0) {
        comm->running--;
        *async_error = ncclInProgress;
    }
    return ncclSuccess;
}

const char *ncclGetLastError(ncclComm_t comm) {
    (void)comm;
    return last_error;
}

int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op,
                  ncclComm_t comm, void *stream) {
    (void)stream;
    if (!valid(comm) || datatype != ncclFloat32 || op != ncclSum) {
        return ncclInvalidArgument;
    }
    if (comm->suspended) {
        snprintf(last_error, sizeof last_error, "communicator is suspended");
        return ncclInvalidUsage;
    }
    /* NCCL uses its own memory for the collective: it must be there. */
    memset(comm->scratch, 0, 64);
    memmove(recvbuff, sendbuff, count * sizeof(float));
    return ncclSuccess;
}

#ifndef FAKE_NCCL_NO_SUSPEND
static int failing(const char *var, long call) {
    const char *v = getenv(var);
    return v != NULL && atol(v) == call;
}

int ncclCommSuspend(ncclComm_t comm, int flags) {
    long call = ++suspend_calls;
    if (!valid(comm) || !(flags & NCCL_SUSPEND_MEM)) {
        return ncclInvalidArgument;
    }
    if (failing("FAKE_NCCL_BLOCK_SUSPEND", call)) {
        /* Waits for peers that never come, until ncclCommAbort ends the wait. */
        __atomic_store_n(&comm->in_call, 1, __ATOMIC_SEQ_CST);
        __atomic_add_fetch(&blocked, 1, __ATOMIC_SEQ_CST);
        while (!__atomic_load_n(&comm->aborting, __ATOMIC_SEQ_CST)) {
            usleep(1000);
        }
        __atomic_sub_fetch(&blocked, 1, __ATOMIC_SEQ_CST);
        snprintf(last_error, sizeof last_error, "communicator aborted while suspending");
        __atomic_store_n(&comm->in_call, 0, __ATOMIC_SEQ_CST); /* freed from here on */
        return ncclRemoteError;
    }
    if (failing("FAKE_NCCL_FAIL_SUSPEND", call)) {
        snprintf(last_error, sizeof last_error, "injected failure of suspend call %ld", call);
        return ncclInvalidUsage;
    }
    if (comm->suspended) {
        snprintf(last_error, sizeof last_error, "MemManager: Already suspended");
        return ncclInvalidUsage;
    }
    cudaFree(comm->scratch);
    comm->scratch = NULL;
    comm->suspended = 1;
    return ncclSuccess;
}

int ncclCommResume(ncclComm_t comm) {
    long call = ++resume_calls;
    if (!valid(comm)) {
        return ncclInvalidArgument;
    }
    if (failing("FAKE_NCCL_FAIL_RESUME", call)) {
        snprintf(last_error, sizeof last_error, "injected failure of resume call %ld", call);
        return ncclUnhandledCudaError;
    }
    if (!comm->suspended) {
        snprintf(last_error, sizeof last_error, "not suspended");
        return ncclInvalidUsage;
    }
    if (cudaMalloc(&comm->scratch, SUSPENDABLE) != 0) {
        return ncclUnhandledCudaError;
    }
    comm->suspended = 0;
    return ncclSuccess;
}

int ncclCommMemStats(ncclComm_t comm, int stat, uint64_t *value) {
    if (!valid(comm) || value == NULL) {
        return ncclInvalidArgument;
    }
    switch (stat) {
    case 0: *value = SUSPENDABLE; break;
    case 1: *value = (uint64_t)comm->suspended; break;
    case 2: *value = PERSISTENT; break;
    case 3: *value = SUSPENDABLE + PERSISTENT; break;
    default: return ncclInvalidArgument;
    }
    return ncclSuccess;
}
#endif

long fake_nccl_live(void) {
    long n = 0;
    for (int i = 0; i < MAX_COMMS; i++) {
        n += comms[i] != NULL;
    }
    return n;
}

long fake_nccl_suspended(void) {
    long n = 0;
    for (int i = 0; i < MAX_COMMS; i++) {
        n += comms[i] != NULL && comms[i]->suspended;
    }
    return n;
}

long fake_nccl_suspend_calls(void) { return suspend_calls; }

long fake_nccl_resume_calls(void) { return resume_calls; }

long fake_nccl_registered(void) { return registrations; }

long fake_nccl_blocked(void) { return __atomic_load_n(&blocked, __ATOMIC_SEQ_CST); }
