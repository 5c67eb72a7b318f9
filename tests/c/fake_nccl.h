/*
 * The part of NCCL's interface (nccl.h, NCCL 2.29.7 and later) that the test double
 * tests/c/fake_nccl.c implements and tests/c/nccl_prog.c calls, with the double's own
 * counters. Signatures as NCCL declares them; ncclResult_t is an int.
 */
#ifndef FAKE_NCCL_H
#define FAKE_NCCL_H

#include <stddef.h>
#include <stdint.h>

typedef struct fake_comm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;

#define ncclSuccess 0
#define ncclUnhandledCudaError 1
#define ncclInvalidArgument 4
#define ncclInvalidUsage 5
#define ncclRemoteError 6
#define ncclInProgress 7
#define NCCL_SPLIT_NOCOLOR -1
#define NCCL_SUSPEND_MEM 0x01
#define ncclFloat32 7
#define ncclSum 0

int ncclGetVersion(int *version);
int ncclGetUniqueId(ncclUniqueId *id);
int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
int ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank, void *config);
int ncclCommInitAll(ncclComm_t *comm, int ndev, const int *devlist);
int ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, void *config);
int ncclCommFinalize(ncclComm_t comm);
int ncclCommDestroy(ncclComm_t comm);
int ncclCommAbort(ncclComm_t comm);
int ncclCommRegister(ncclComm_t comm, void *buff, size_t size, void **handle);
int ncclCommDeregister(ncclComm_t comm, void *handle);
int ncclCommWindowRegister(ncclComm_t comm, void *buff, size_t size, void **win, int flags);
int ncclCommWindowDeregister(ncclComm_t comm, void *win);
int ncclMemAlloc(void **ptr, size_t size);
int ncclMemFree(void *ptr);
int ncclCommCuDevice(ncclComm_t comm, int *device);
const char *ncclGetLastError(ncclComm_t comm);
int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op,
                  ncclComm_t comm, void *stream);

/* The double's counters. */
long fake_nccl_live(void);         /* communicators made and not ended */
long fake_nccl_suspended(void);    /* of those, suspended */
long fake_nccl_suspend_calls(void);
long fake_nccl_resume_calls(void);
long fake_nccl_registered(void);   /* registrations (buffers and windows) not undone */
long fake_nccl_blocked(void);      /* calls waiting for peers (FAKE_NCCL_BLOCK_SUSPEND) */

#endif /* FAKE_NCCL_H */
