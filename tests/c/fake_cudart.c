/*
 * A fake CUDA runtime (built as libcudart.so by tests/build.rs): cudaMalloc is malloc,
 * cudaFree is free, and both count their calls so a test can tell whether libtms.so passed
 * a call through or served it itself.
 *
 * cudaFree only frees pointers this fake handed out; any other non-NULL pointer (say, a
 * pauseable allocation that libtms.so wrongly passed through) is refused with
 * cudaErrorInvalidValue and counted, instead of corrupting the heap.
 */
#include <stddef.h>
#include <stdlib.h>

#define FAKE_MAX_LIVE 1024

static long malloc_calls;
static long free_calls;
static long foreign_frees;
static void *live[FAKE_MAX_LIVE];

int cudaMalloc(void **dev_ptr, size_t size) {
    malloc_calls++;
    if (dev_ptr == NULL) {
        return 1; /* cudaErrorInvalidValue */
    }
    for (int i = 0; i < FAKE_MAX_LIVE; i++) {
        if (live[i] == NULL) {
            void *p = malloc(size ? size : 1);
            if (p == NULL) {
                return 2; /* cudaErrorMemoryAllocation */
            }
            live[i] = p;
            *dev_ptr = p;
            return 0;
        }
    }
    return 2;
}

int cudaFree(void *ptr) {
    free_calls++;
    if (ptr == NULL) {
        return 0;
    }
    for (int i = 0; i < FAKE_MAX_LIVE; i++) {
        if (live[i] == ptr) {
            live[i] = NULL;
            free(ptr);
            return 0;
        }
    }
    foreign_frees++;
    return 1; /* cudaErrorInvalidValue */
}

/* Calls of cudaMalloc that reached this fake. */
long fake_cuda_malloc_calls(void) { return malloc_calls; }

/* Calls of cudaFree that reached this fake. */
long fake_cuda_free_calls(void) { return free_calls; }

/* Calls of cudaFree with a pointer this fake never handed out. */
long fake_cuda_foreign_frees(void) { return foreign_frees; }

/* Pointers handed out and not yet freed. */
long fake_cuda_live(void) {
    long n = 0;
    for (int i = 0; i < FAKE_MAX_LIVE; i++) {
        n += live[i] != NULL;
    }
    return n;
}
