/*
 * A test double of AMD's HIP runtime (libamdhip64.so): the calls libtms.so's HIP driver makes,
 * with HIP's signatures, structures, flags and error codes, over host memory shaped like the
 * simulated device (preload/src/driver/sim/): reservations are places in an address space of
 * PROT_NONE host memory taken at hipInit, physical memory a memfd counted against the device's
 * capacity, a mapping the memfd mapped over the reservation, access an mprotect. Built by the tests with the system `cc` (the engine tests'
 * harness, and tests/build.rs for the LD_PRELOAD tests); never shipped. No AMD GPU is involved:
 * what this proves is the loading, the arguments and the error paths, not ROCm's behaviour.
 *
 * Each call checks its arguments as HIP documents them and fails with HIP's code where they are
 * wrong (a bad handle, a size that is not a multiple of the granularity, a range not mapped).
 * Copies run when queued (memcpy), after any wait queued before them on their stream
 * (hipStreamWaitValue32) is met; device memory is host memory, so a test may touch it.
 *
 * Test controls (hipsim_*): the machine's shape before hipInit, faults (fail the nth call of a
 * function with a code), ROCm's known bugs as quirks (HIPSIM_QUIRK_*), attributes, counters.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int hipError_t;
enum {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    hipErrorOutOfMemory = 2,
    hipErrorNotInitialized = 3,
    hipErrorNoDevice = 100,
    hipErrorInvalidDevice = 101,
    hipErrorInvalidHandle = 400,
    hipErrorIllegalAddress = 700,
    hipErrorLaunchTimeOut = 702,
    hipErrorHostMemoryAlreadyRegistered = 712,
    hipErrorHostMemoryNotRegistered = 713,
    hipErrorNotSupported = 801,
    hipErrorUnknown = 999,
};

typedef struct hipMemLocation {
    int type; /* hipMemLocationTypeDevice = 1 */
    int id;
} hipMemLocation;

typedef struct hipMemAllocationProp {
    int type;                /* hipMemAllocationTypePinned = 1 */
    int requestedHandleType; /* hipMemHandleTypeNone = 0 */
    hipMemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
    } allocFlags;
} hipMemAllocationProp;

typedef struct hipMemAccessDesc {
    hipMemLocation location;
    int flags; /* hipMemAccessFlagsProtNone 0, ProtRead 1, ProtReadWrite 3 */
} hipMemAccessDesc;

typedef struct phys *hipMemGenericAllocationHandle_t;
typedef struct stream *hipStream_t;
typedef struct event *hipEvent_t;
typedef void *hipDeviceptr_t;

#define ATTR_VMM_SUPPORTED 89          /* hipDeviceAttributeVirtualMemoryManagementSupported */
#define ATTR_CAN_USE_STREAM_WAIT 10013 /* hipDeviceAttributeCanUseStreamWaitValue */

/* hipMemRelease does not give the memory back while the range it was mapped in stays reserved
   (ROCm 7.2): it goes when that range is freed. */
#define HIPSIM_QUIRK_RELEASE_HOLDS 1u
/* hipMemAddressReserve never gives the address asked for (as if another reservation had it). */
#define HIPSIM_QUIRK_IGNORE_ADDRESS 2u
/* hipMemSetAccess fails with hipErrorInvalidValue for a range with mappings before it in its
   reservation (ROCm 7.2: it adds up mappings from the reservation's first one). */
#define HIPSIM_QUIRK_TAIL_ACCESS 4u

#define MAX_DEVICES 64
#define WAIT_LIMIT_S 20

/* ---- state -------------------------------------------------------------------------------- */

struct phys {
    int fd;
    size_t size;
    int device;
    int released;
    int maps;
    uintptr_t reservation; /* where it was last mapped (0: never) */
    struct phys *next;
};

struct reservation {
    uintptr_t start;
    size_t size;
    struct reservation *next;
};

struct mapping {
    uintptr_t start;
    size_t size;
    struct phys *phys;
    int access;
    struct mapping *next;
};

struct range {
    uintptr_t start;
    size_t len;
    struct range *next;
};

struct wait {
    const uint32_t *word;
    uint32_t value;
    uint32_t mask;
    struct wait *next;
};

struct stream {
    int device;
    struct wait *waits;
    struct stream *next;
};

struct event {
    int device;
    struct event *next;
};

struct fault {
    char call[48];
    long remaining;
    int code;
    struct fault *next;
};

struct count {
    char call[48];
    long n;
    struct count *next;
};

/* What a test reads of the double's books (hipsim_counts). */
struct hipsim_counts {
    uint64_t handles;       /* physical allocations not given back */
    uint64_t mappings;      /* mapped ranges */
    uint64_t reservations;  /* reserved address ranges */
    uint64_t pinned_bytes;  /* bytes registered by hipHostRegister */
    uint64_t host_allocs;   /* hipHostMalloc blocks */
    uint64_t pageable;      /* copies whose host side was neither registered nor hipHostMalloc */
    uint64_t malloc_live;   /* hipMalloc blocks not freed */
    uint64_t malloc_calls;  /* calls of hipMalloc */
    uint64_t free_calls;    /* calls of hipFree */
    uint64_t foreign_frees; /* hipFree of a pointer hipMalloc never gave */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static int devices = 1;
static uint64_t capacity = 8ull << 30;
static uint64_t granularity = 2u << 20;
static uint64_t recommended = 2u << 20;
static int version = 70200000; /* HIP's encoding of 7.2 */
static unsigned quirks;
static int vmm_supported = 1;
static int wait_supported = 1;
static uint64_t bandwidth; /* bytes per second of copies; 0: no limit */
static uint64_t live[MAX_DEVICES];
/* The device address space, as ROCr keeps one: PROT_NONE host address space taken at hipInit,
   which reservations are placed in and freed back to (never to the system, so that a freed
   range can be had again unless another reservation takes it). */
static uintptr_t aperture;
static size_t aperture_size;
static struct phys *physs;
static struct reservation *reservations;
static struct mapping *mappings;
static struct range *registered;
static struct range *host_allocs;
static struct range *mallocs;
static struct stream *streams;
static struct stream default_streams[MAX_DEVICES];
static struct event *events;
static struct fault *faults;
static struct count *counts;
static struct hipsim_counts books;
static __thread int current_device;
static __thread int capture_mode;

/* ---- helpers (called with the lock held) -------------------------------------------------- */

/* Count a call of `call`; its armed fault's code if this is the call it fails. */
static hipError_t count_call(const char *call) {
    struct count *c = counts;
    while (c && strcmp(c->call, call) != 0) {
        c = c->next;
    }
    if (!c && (c = calloc(1, sizeof *c))) {
        strncpy(c->call, call, sizeof c->call - 1);
        c->next = counts;
        counts = c;
    }
    if (c) {
        c->n++;
    }
    for (struct fault **f = &faults; *f; f = &(*f)->next) {
        if (strcmp((*f)->call, call) == 0 && --(*f)->remaining == 0) {
            struct fault *done = *f;
            int code = done->code;
            *f = done->next;
            free(done);
            return code;
        }
    }
    return hipSuccess;
}

/* Take the lock and count the call: hipSuccess, or the code of a fault armed for it. */
static hipError_t enter(const char *call) {
    pthread_mutex_lock(&lock);
    return count_call(call);
}

static hipError_t leave(hipError_t rc) {
    pthread_mutex_unlock(&lock);
    return rc;
}

/* enter(call), returning from the caller with the code of a fault armed for it. */
#define ENTER(call)                                                                          \
    do {                                                                                     \
        hipError_t fault_ = enter(call);                                                     \
        if (fault_ != hipSuccess) {                                                          \
            return leave(fault_);                                                            \
        }                                                                                    \
    } while (0)

static int valid_device(int d) { return d >= 0 && d < devices; }

static int multiple(uint64_t v) { return v > 0 && v % granularity == 0; }

static struct reservation *reservation_at(uintptr_t start) {
    for (struct reservation *r = reservations; r; r = r->next) {
        if (r->start == start) {
            return r;
        }
    }
    return NULL;
}

static struct reservation *reservation_holding(uintptr_t p, size_t len) {
    for (struct reservation *r = reservations; r; r = r->next) {
        if (p >= r->start && p + len <= r->start + r->size) {
            return r;
        }
    }
    return NULL;
}

static struct mapping *mapping_at(uintptr_t start) {
    for (struct mapping *m = mappings; m; m = m->next) {
        if (m->start == start) {
            return m;
        }
    }
    return NULL;
}

static struct mapping *mapping_holding(uintptr_t p) {
    for (struct mapping *m = mappings; m; m = m->next) {
        if (p >= m->start && p < m->start + m->size) {
            return m;
        }
    }
    return NULL;
}

/* [p, p+len) lies in accessible mappings, back to back. */
static int accessible(uintptr_t p, size_t len) {
    uintptr_t end = p + len;
    if (len == 0 || end < p) {
        return 0;
    }
    while (p < end) {
        struct mapping *m = mapping_holding(p);
        if (!m || m->access != 3) {
            return 0;
        }
        p = m->start + m->size;
    }
    return 1;
}

static struct range *range_holding(struct range *list, uintptr_t p, size_t len) {
    for (struct range *r = list; r; r = r->next) {
        if (p >= r->start && p + len <= r->start + r->len) {
            return r;
        }
    }
    return NULL;
}

static int phys_live(struct phys *h) {
    for (struct phys *p = physs; p; p = p->next) {
        if (p == h) {
            return !p->released;
        }
    }
    return 0;
}

static void unlink_phys(struct phys *h) {
    for (struct phys **p = &physs; *p; p = &(*p)->next) {
        if (*p == h) {
            *p = h->next;
            break;
        }
    }
    live[h->device] -= h->size;
    books.handles--;
    free(h);
}

/* Give the memory back once released and unmapped (or, with HIPSIM_QUIRK_RELEASE_HOLDS, once
   the range it was mapped in is freed too). */
static void drop_if_done(struct phys *h) {
    if (!h->released || h->maps > 0) {
        return;
    }
    if ((quirks & HIPSIM_QUIRK_RELEASE_HOLDS) && h->reservation && reservation_at(h->reservation)) {
        return;
    }
    unlink_phys(h);
}

static struct stream *stream_of(hipStream_t s) {
    /* 0: the device's null stream; 1 and 2: hipStreamLegacy and hipStreamPerThread. */
    if ((uintptr_t)s <= 2) {
        return &default_streams[current_device];
    }
    for (struct stream *x = streams; x; x = x->next) {
        if (x == s) {
            return x;
        }
    }
    return NULL;
}

static int met(const struct wait *w) {
    return (__atomic_load_n(w->word, __ATOMIC_ACQUIRE) & w->mask) >= w->value;
}

/* Let the waits queued on `s` pass before work queued after them: the lock is let go while
   waiting. hipErrorLaunchTimeOut if they are not met within WAIT_LIMIT_S (a GPU would hang). */
static hipError_t pass_waits(struct stream *s) {
    time_t until = time(NULL) + WAIT_LIMIT_S;
    while (s->waits) {
        struct wait *w = s->waits;
        if (met(w)) {
            s->waits = w->next;
            free(w);
            continue;
        }
        if (time(NULL) > until) {
            return hipErrorLaunchTimeOut;
        }
        pthread_mutex_unlock(&lock);
        struct timespec t = {0, 100000};
        nanosleep(&t, NULL);
        pthread_mutex_lock(&lock);
    }
    return hipSuccess;
}

static hipError_t pass_device_waits(int device) {
    hipError_t rc = pass_waits(&default_streams[device]);
    for (struct stream *x = streams; x && rc == hipSuccess; x = x->next) {
        if (x->device == device) {
            rc = pass_waits(x);
        }
    }
    return rc;
}

static int host_side_pinned(uintptr_t p, size_t len) {
    return range_holding(registered, p, len) || range_holding(host_allocs, p, len);
}

static hipError_t copy(void *dst, const void *src, size_t len, uintptr_t dev, uintptr_t host,
                       hipStream_t stream) {
    struct stream *s = stream_of(stream);
    if (!s) {
        return hipErrorInvalidHandle;
    }
    if (!dst || !src) {
        return hipErrorInvalidValue;
    }
    hipError_t rc = pass_waits(s);
    if (rc != hipSuccess) {
        return rc;
    }
    if (!accessible(dev, len)) {
        return hipErrorInvalidValue;
    }
    if (!host_side_pinned(host, len)) {
        books.pageable++;
    }
    memcpy(dst, src, len);
    return hipSuccess;
}

static struct range *add_range(struct range **list, uintptr_t start, size_t len) {
    struct range *r = calloc(1, sizeof *r);
    if (r) {
        r->start = start;
        r->len = len;
        r->next = *list;
        *list = r;
    }
    return r;
}

static struct range *take_range(struct range **list, uintptr_t start) {
    for (struct range **r = list; *r; r = &(*r)->next) {
        if ((*r)->start == start) {
            struct range *found = *r;
            *r = found->next;
            return found;
        }
    }
    return NULL;
}

/* ---- test controls ------------------------------------------------------------------------ */

/* The machine's shape: call before hipInit. 0, or 1 once initialized or for a bad shape. */
int hipsim_configure(int n_devices, uint64_t bytes, uint64_t minimum, uint64_t recommend) {
    pthread_mutex_lock(&lock);
    int bad = initialized || n_devices < 0 || n_devices > MAX_DEVICES || minimum == 0 ||
              minimum % (uint64_t)sysconf(_SC_PAGESIZE) != 0 || recommend == 0 ||
              recommend % minimum != 0;
    if (!bad) {
        devices = n_devices;
        capacity = bytes;
        granularity = minimum;
        recommended = recommend;
    }
    pthread_mutex_unlock(&lock);
    return bad;
}

void hipsim_set_quirks(unsigned q) {
    pthread_mutex_lock(&lock);
    quirks = q;
    pthread_mutex_unlock(&lock);
}

/* Answer `value` for the device attribute `attr` (VMM and stream-wait support). */
void hipsim_set_attribute(int attr, int value) {
    pthread_mutex_lock(&lock);
    if (attr == ATTR_VMM_SUPPORTED) {
        vmm_supported = value;
    } else if (attr == ATTR_CAN_USE_STREAM_WAIT) {
        wait_supported = value;
    }
    pthread_mutex_unlock(&lock);
}

/* Make every copy take as long as `bytes_per_second` says (0: no limit). */
void hipsim_set_bandwidth(uint64_t bytes_per_second) {
    pthread_mutex_lock(&lock);
    bandwidth = bytes_per_second;
    pthread_mutex_unlock(&lock);
}

/* Sleep, holding no lock, as long as a copy of `len` bytes takes over the link. */
static void use_link(size_t len) {
    pthread_mutex_lock(&lock);
    uint64_t bw = bandwidth;
    pthread_mutex_unlock(&lock);
    if (bw > 0) {
        uint64_t ns = (uint64_t)len * 1000000000ull / bw;
        struct timespec t = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
        nanosleep(&t, NULL);
    }
}

/* Make the nth call of `call` from now (1 = the next) return `code`. */
void hipsim_fail(const char *call, long nth, int code) {
    struct fault *f = calloc(1, sizeof *f);
    if (!f) {
        return;
    }
    strncpy(f->call, call, sizeof f->call - 1);
    f->remaining = nth > 0 ? nth : 1;
    f->code = code;
    pthread_mutex_lock(&lock);
    f->next = faults;
    faults = f;
    pthread_mutex_unlock(&lock);
}

long hipsim_calls(const char *call) {
    long n = 0;
    pthread_mutex_lock(&lock);
    for (struct count *c = counts; c; c = c->next) {
        if (strcmp(c->call, call) == 0) {
            n = c->n;
        }
    }
    pthread_mutex_unlock(&lock);
    return n;
}

uint64_t hipsim_live_bytes(int device) {
    pthread_mutex_lock(&lock);
    uint64_t n = valid_device(device) ? live[device] : 0;
    pthread_mutex_unlock(&lock);
    return n;
}

void hipsim_counts(struct hipsim_counts *out) {
    pthread_mutex_lock(&lock);
    *out = books;
    pthread_mutex_unlock(&lock);
}

int hipsim_accessible(uintptr_t p, size_t len) {
    pthread_mutex_lock(&lock);
    int yes = accessible(p, len);
    pthread_mutex_unlock(&lock);
    return yes;
}

/* ---- initialization, devices, errors ------------------------------------------------------ */

hipError_t hipInit(unsigned int flags) {
    hipError_t rc = enter("hipInit");
    if (rc == hipSuccess) {
        if (flags != 0) {
            rc = hipErrorInvalidValue;
        } else if (!initialized) {
            /* Room for paused allocations' ranges well beyond the memory. */
            aperture_size = (size_t)(capacity * 16 > (64ull << 30) ? capacity * 16 : 64ull << 30);
            void *a = mmap(NULL, aperture_size, PROT_NONE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (a == MAP_FAILED) {
                return leave(hipErrorOutOfMemory);
            }
            aperture = (uintptr_t)a;
            initialized = 1;
            for (int d = 0; d < MAX_DEVICES; d++) {
                default_streams[d].device = d;
            }
        }
    }
    return leave(rc);
}

/* A call that answers one int, `value`, in `out`. */
static hipError_t answer_int(const char *call, int *out, int value) {
    hipError_t rc = enter(call);
    if (rc == hipSuccess) {
        if (!out) {
            rc = hipErrorInvalidValue;
        } else {
            *out = value;
        }
    }
    return leave(rc);
}

hipError_t hipDriverGetVersion(int *v) { return answer_int("hipDriverGetVersion", v, version); }

hipError_t hipGetDeviceCount(int *n) {
    hipError_t rc = enter("hipGetDeviceCount");
    if (rc == hipSuccess) {
        if (!n) {
            rc = hipErrorInvalidValue;
        } else if (!initialized) {
            rc = hipErrorNotInitialized;
        } else if (devices == 0) {
            *n = 0;
            rc = hipErrorNoDevice;
        } else {
            *n = devices;
        }
    }
    return leave(rc);
}

hipError_t hipGetDevice(int *d) { return answer_int("hipGetDevice", d, current_device); }

hipError_t hipSetDevice(int d) {
    hipError_t rc = enter("hipSetDevice");
    if (rc == hipSuccess) {
        if (!valid_device(d)) {
            rc = hipErrorInvalidDevice;
        } else {
            current_device = d;
        }
    }
    return leave(rc);
}

hipError_t hipDeviceGetAttribute(int *value, int attr, int device) {
    hipError_t rc = enter("hipDeviceGetAttribute");
    if (rc == hipSuccess) {
        if (!value) {
            rc = hipErrorInvalidValue;
        } else if (!valid_device(device)) {
            rc = hipErrorInvalidDevice;
        } else if (attr == ATTR_VMM_SUPPORTED) {
            *value = vmm_supported;
        } else if (attr == ATTR_CAN_USE_STREAM_WAIT) {
            *value = wait_supported;
        } else {
            rc = hipErrorInvalidValue;
        }
    }
    return leave(rc);
}

hipError_t hipDeviceSynchronize(void) {
    hipError_t rc = enter("hipDeviceSynchronize");
    if (rc == hipSuccess) {
        rc = pass_device_waits(current_device);
    }
    return leave(rc);
}

hipError_t hipThreadExchangeStreamCaptureMode(int *mode) {
    hipError_t rc = enter("hipThreadExchangeStreamCaptureMode");
    if (rc == hipSuccess) {
        if (!mode || *mode < 0 || *mode > 2) {
            rc = hipErrorInvalidValue;
        } else {
            int old = capture_mode;
            capture_mode = *mode;
            *mode = old;
        }
    }
    return leave(rc);
}

const char *hipGetErrorName(hipError_t e) {
    switch (e) {
    case hipSuccess: return "hipSuccess";
    case hipErrorInvalidValue: return "hipErrorInvalidValue";
    case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
    case hipErrorNotInitialized: return "hipErrorNotInitialized";
    case hipErrorNoDevice: return "hipErrorNoDevice";
    case hipErrorInvalidDevice: return "hipErrorInvalidDevice";
    case hipErrorInvalidHandle: return "hipErrorInvalidHandle";
    case hipErrorIllegalAddress: return "hipErrorIllegalAddress";
    case hipErrorLaunchTimeOut: return "hipErrorLaunchTimeOut";
    case hipErrorHostMemoryAlreadyRegistered: return "hipErrorHostMemoryAlreadyRegistered";
    case hipErrorHostMemoryNotRegistered: return "hipErrorHostMemoryNotRegistered";
    case hipErrorNotSupported: return "hipErrorNotSupported";
    default: return "hipErrorUnknown";
    }
}

/* ---- virtual memory ----------------------------------------------------------------------- */

static int good_prop(const hipMemAllocationProp *prop) {
    return prop && prop->type == 1 && prop->location.type == 1 && prop->requestedHandleType == 0;
}

hipError_t hipMemGetAllocationGranularity(size_t *g, const hipMemAllocationProp *prop, int option) {
    hipError_t rc = enter("hipMemGetAllocationGranularity");
    if (rc == hipSuccess) {
        if (!g || !good_prop(prop) || (option != 0 && option != 1)) {
            rc = hipErrorInvalidValue;
        } else if (!valid_device(prop->location.id)) {
            rc = hipErrorInvalidDevice;
        } else {
            *g = option == 0 ? granularity : recommended;
        }
    }
    return leave(rc);
}

hipError_t hipMemGetInfo(size_t *free_bytes, size_t *total) {
    hipError_t rc = enter("hipMemGetInfo");
    if (rc == hipSuccess) {
        if (!free_bytes || !total) {
            rc = hipErrorInvalidValue;
        } else {
            *total = capacity;
            *free_bytes = capacity - live[current_device];
        }
    }
    return leave(rc);
}

static void *map_none(void *at, size_t len, int flags) {
    return mmap(at, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | flags, -1, 0);
}

static int taken(uintptr_t at, size_t size) {
    for (struct reservation *r = reservations; r; r = r->next) {
        if (r->start < at + size && at < r->start + r->size) {
            return 1;
        }
    }
    return 0;
}

/* A free, aligned place of `size` bytes in the aperture: `want` if it is one (and not to be
   avoided), else the first, never overlapping `avoid` bytes at `want` where `avoid` is set. */
static uintptr_t place(size_t size, size_t align, uintptr_t want, size_t avoid) {
    uintptr_t end = aperture + aperture_size;
    if (want && !avoid && want % align == 0 && want >= aperture && want + size <= end &&
        !taken(want, size)) {
        return want;
    }
    for (uintptr_t at = (aperture + align - 1) / align * align; at + size <= end;) {
        uintptr_t next = 0;
        for (struct reservation *r = reservations; r; r = r->next) {
            if (r->start < at + size && at < r->start + r->size && r->start + r->size > next) {
                next = r->start + r->size;
            }
        }
        if (avoid && want < at + size && at < want + avoid && want + avoid > next) {
            next = want + avoid;
        }
        if (!next) {
            return at;
        }
        at = (next + align - 1) / align * align;
    }
    return 0;
}

hipError_t hipMemAddressReserve(void **ptr, size_t size, size_t alignment, void *addr,
                                unsigned long long flags) {
    ENTER("hipMemAddressReserve");
    if (!ptr || !multiple(size) || flags != 0 || (alignment & (alignment - 1)) != 0 ||
        (uintptr_t)addr % granularity != 0) {
        return leave(hipErrorInvalidValue);
    }
    size_t align = alignment > granularity ? alignment : granularity;
    /* Ignoring the address is modelled as another reservation holding it. */
    size_t avoid = (quirks & HIPSIM_QUIRK_IGNORE_ADDRESS) && addr ? size : 0;
    uintptr_t p = place(size, align, (uintptr_t)addr, avoid);
    struct reservation *r = p ? calloc(1, sizeof *r) : NULL;
    if (!r) {
        return leave(hipErrorOutOfMemory);
    }
    *r = (struct reservation){.start = p, .size = size, .next = reservations};
    reservations = r;
    books.reservations++;
    *ptr = (void *)p;
    return leave(hipSuccess);
}

hipError_t hipMemAddressFree(void *ptr, size_t size) {
    ENTER("hipMemAddressFree");
    uintptr_t start = (uintptr_t)ptr;
    struct reservation **at = &reservations;
    while (*at && (*at)->start != start) {
        at = &(*at)->next;
    }
    if (!*at || (*at)->size != size) {
        return leave(hipErrorInvalidValue);
    }
    for (struct mapping *m = mappings; m; m = m->next) {
        if (m->start >= start && m->start < start + size) {
            return leave(hipErrorInvalidValue);
        }
    }
    struct reservation *r = *at;
    *at = r->next;
    free(r);
    books.reservations--;
    /* What HIPSIM_QUIRK_RELEASE_HOLDS kept goes with the range. */
    for (struct phys *h = physs, *next; h; h = next) {
        next = h->next;
        if (h->reservation == start && h->released && h->maps == 0) {
            unlink_phys(h);
        }
    }
    return leave(hipSuccess);
}

hipError_t hipMemCreate(hipMemGenericAllocationHandle_t *handle, size_t size,
                        const hipMemAllocationProp *prop, unsigned long long flags) {
    ENTER("hipMemCreate");
    if (!handle || !good_prop(prop) || flags != 0 || !multiple(size)) {
        return leave(hipErrorInvalidValue);
    }
    int d = prop->location.id;
    if (!valid_device(d)) {
        return leave(hipErrorInvalidDevice);
    }
    if (live[d] + size > capacity) {
        return leave(hipErrorOutOfMemory);
    }
    int fd = memfd_create("hipsim", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) {
            close(fd);
        }
        return leave(hipErrorOutOfMemory);
    }
    struct phys *h = calloc(1, sizeof *h);
    if (!h) {
        close(fd);
        return leave(hipErrorOutOfMemory);
    }
    *h = (struct phys){.fd = fd, .size = size, .device = d, .next = physs};
    physs = h;
    live[d] += size;
    books.handles++;
    *handle = h;
    return leave(hipSuccess);
}

hipError_t hipMemRelease(hipMemGenericAllocationHandle_t handle) {
    ENTER("hipMemRelease");
    if (!phys_live(handle)) {
        return leave(hipErrorInvalidValue);
    }
    handle->released = 1;
    close(handle->fd); /* mappings keep the pages */
    drop_if_done(handle);
    return leave(hipSuccess);
}

hipError_t hipMemMap(void *ptr, size_t size, size_t offset, hipMemGenericAllocationHandle_t handle,
                     unsigned long long flags) {
    ENTER("hipMemMap");
    uintptr_t p = (uintptr_t)ptr;
    if (!ptr || offset != 0 || flags != 0 || !multiple(size) || p % granularity != 0 ||
        !phys_live(handle) || handle->size < size) {
        return leave(hipErrorInvalidValue);
    }
    struct reservation *r = reservation_holding(p, size);
    if (!r) {
        return leave(hipErrorInvalidValue);
    }
    for (struct mapping *m = mappings; m; m = m->next) {
        if (m->start < p + size && p < m->start + m->size) {
            return leave(hipErrorInvalidValue);
        }
    }
    struct mapping *m = calloc(1, sizeof *m);
    if (!m) {
        return leave(hipErrorOutOfMemory);
    }
    if (mmap(ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle->fd, 0) == MAP_FAILED) {
        free(m);
        return leave(hipErrorOutOfMemory);
    }
    *m = (struct mapping){.start = p, .size = size, .phys = handle, .next = mappings};
    mappings = m;
    handle->maps++;
    handle->reservation = r->start;
    books.mappings++;
    return leave(hipSuccess);
}

hipError_t hipMemUnmap(void *ptr, size_t size) {
    ENTER("hipMemUnmap");
    struct mapping **at = &mappings;
    while (*at && (*at)->start != (uintptr_t)ptr) {
        at = &(*at)->next;
    }
    if (!*at || (*at)->size != size) {
        return leave(hipErrorInvalidValue);
    }
    if (map_none(ptr, size, MAP_FIXED) == MAP_FAILED) {
        return leave(hipErrorUnknown);
    }
    struct mapping *m = *at;
    *at = m->next;
    m->phys->maps--;
    drop_if_done(m->phys);
    free(m);
    books.mappings--;
    return leave(hipSuccess);
}

hipError_t hipMemSetAccess(void *ptr, size_t size, const hipMemAccessDesc *desc, size_t count) {
    ENTER("hipMemSetAccess");
    uintptr_t p = (uintptr_t)ptr, end = p + size;
    if (!desc || count == 0 || size == 0 || !mapping_at(p)) {
        return leave(hipErrorInvalidValue);
    }
    /* Whole mappings, back to back. */
    for (uintptr_t at = p; at < end;) {
        struct mapping *m = mapping_at(at);
        if (!m || m->start + m->size > end) {
            return leave(hipErrorInvalidValue);
        }
        at = m->start + m->size;
    }
    if (quirks & HIPSIM_QUIRK_TAIL_ACCESS) {
        struct reservation *r = reservation_holding(p, size);
        for (struct mapping *m = mappings; r && m; m = m->next) {
            if (m->start >= r->start && m->start < p) {
                return leave(hipErrorInvalidValue);
            }
        }
    }
    int access = 0;
    for (size_t i = 0; i < count; i++) {
        int f = desc[i].flags;
        if (desc[i].location.type != 1 || (f != 0 && f != 1 && f != 3)) {
            return leave(hipErrorInvalidValue);
        }
        if (!valid_device(desc[i].location.id)) {
            return leave(hipErrorInvalidDevice);
        }
        access |= f;
    }
    int prot = access == 3 ? PROT_READ | PROT_WRITE : access == 1 ? PROT_READ : PROT_NONE;
    if (mprotect(ptr, size, prot) != 0) {
        return leave(hipErrorUnknown);
    }
    for (uintptr_t at = p; at < end;) {
        struct mapping *m = mapping_at(at);
        m->access = access;
        at = m->start + m->size;
    }
    return leave(hipSuccess);
}

/* ---- streams, events, copies -------------------------------------------------------------- */

hipError_t hipStreamCreateWithFlags(hipStream_t *stream, unsigned int flags) {
    ENTER("hipStreamCreateWithFlags");
    struct stream *s = NULL;
    if (!stream || flags > 1 || !(s = calloc(1, sizeof *s))) {
        return leave(hipErrorInvalidValue);
    }
    s->device = current_device;
    s->next = streams;
    streams = s;
    *stream = s;
    return leave(hipSuccess);
}

hipError_t hipStreamSynchronize(hipStream_t stream) {
    hipError_t rc = enter("hipStreamSynchronize");
    if (rc == hipSuccess) {
        struct stream *s = stream_of(stream);
        rc = s ? pass_waits(s) : hipErrorInvalidHandle;
    }
    return leave(rc);
}

hipError_t hipStreamWaitValue32(hipStream_t stream, void *ptr, uint32_t value, unsigned int flags,
                                uint32_t mask) {
    ENTER("hipStreamWaitValue32");
    struct stream *s = stream_of(stream);
    if (!s) {
        return leave(hipErrorInvalidHandle);
    }
    if (!wait_supported) {
        return leave(hipErrorNotSupported);
    }
    /* Only the "greater or equal" comparison is modelled (hipStreamWaitValueGte = 0). */
    if (flags != 0 || (uintptr_t)ptr % 4 != 0 ||
        !range_holding(host_allocs, (uintptr_t)ptr, sizeof(uint32_t))) {
        return leave(hipErrorInvalidValue);
    }
    struct wait *w = calloc(1, sizeof *w);
    if (!w) {
        return leave(hipErrorOutOfMemory);
    }
    w->word = ptr;
    w->value = value;
    w->mask = mask;
    struct wait **tail = &s->waits;
    while (*tail) {
        tail = &(*tail)->next;
    }
    *tail = w;
    return leave(hipSuccess);
}

static struct event *event_of(hipEvent_t e) {
    for (struct event *x = events; x; x = x->next) {
        if (x == e) {
            return x;
        }
    }
    return NULL;
}

hipError_t hipEventCreateWithFlags(hipEvent_t *event, unsigned flags) {
    ENTER("hipEventCreateWithFlags");
    struct event *e = NULL;
    if (!event || (flags & ~0x7u) || !(e = calloc(1, sizeof *e))) {
        return leave(hipErrorInvalidValue);
    }
    e->device = current_device;
    e->next = events;
    events = e;
    *event = e;
    return leave(hipSuccess);
}

hipError_t hipEventRecord(hipEvent_t event, hipStream_t stream) {
    hipError_t rc = enter("hipEventRecord");
    if (rc == hipSuccess) {
        struct stream *s = stream_of(stream);
        rc = !event_of(event) || !s ? hipErrorInvalidHandle : pass_waits(s);
    }
    return leave(rc);
}

hipError_t hipEventSynchronize(hipEvent_t event) {
    hipError_t rc = enter("hipEventSynchronize");
    if (rc == hipSuccess && !event_of(event)) {
        rc = hipErrorInvalidHandle;
    }
    return leave(rc);
}

hipError_t hipEventDestroy(hipEvent_t event) {
    ENTER("hipEventDestroy");
    for (struct event **at = &events; *at; at = &(*at)->next) {
        if (*at == event) {
            *at = event->next;
            free(event);
            return leave(hipSuccess);
        }
    }
    return leave(hipErrorInvalidHandle);
}

hipError_t hipMemcpyDtoHAsync(void *dst, hipDeviceptr_t src, size_t len, hipStream_t stream) {
    use_link(len);
    hipError_t rc = enter("hipMemcpyDtoHAsync");
    if (rc == hipSuccess) {
        rc = copy(dst, src, len, (uintptr_t)src, (uintptr_t)dst, stream);
    }
    return leave(rc);
}

hipError_t hipMemcpyHtoDAsync(hipDeviceptr_t dst, void *src, size_t len, hipStream_t stream) {
    use_link(len);
    hipError_t rc = enter("hipMemcpyHtoDAsync");
    if (rc == hipSuccess) {
        rc = copy(dst, src, len, (uintptr_t)dst, (uintptr_t)src, stream);
    }
    return leave(rc);
}

/* ---- host memory -------------------------------------------------------------------------- */

hipError_t hipHostRegister(void *ptr, size_t len, unsigned int flags) {
    ENTER("hipHostRegister");
    uintptr_t p = (uintptr_t)ptr;
    if (!ptr || len == 0 || (flags & ~0xfu)) {
        return leave(hipErrorInvalidValue);
    }
    for (struct range *r = registered; r; r = r->next) {
        if (r->start < p + len && p < r->start + r->len) {
            return leave(hipErrorHostMemoryAlreadyRegistered);
        }
    }
    if (!add_range(&registered, p, len)) {
        return leave(hipErrorOutOfMemory);
    }
    books.pinned_bytes += len;
    return leave(hipSuccess);
}

hipError_t hipHostUnregister(void *ptr) {
    ENTER("hipHostUnregister");
    struct range *r = take_range(&registered, (uintptr_t)ptr);
    if (!r) {
        return leave(hipErrorHostMemoryNotRegistered);
    }
    books.pinned_bytes -= r->len;
    free(r);
    return leave(hipSuccess);
}

hipError_t hipHostMalloc(void **ptr, size_t size, unsigned int flags) {
    ENTER("hipHostMalloc");
    /* Portable, Mapped, WriteCombined, NumaUser, Coherent, NonCoherent. */
    if (!ptr || size == 0 || (flags & ~(0x7u | 0xe0000000u))) {
        return leave(hipErrorInvalidValue);
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    void *p = aligned_alloc(page, (size + page - 1) / page * page);
    if (!p) {
        return leave(hipErrorOutOfMemory);
    }
    memset(p, 0, size);
    if (!add_range(&host_allocs, (uintptr_t)p, size)) {
        free(p);
        return leave(hipErrorOutOfMemory);
    }
    books.host_allocs++;
    *ptr = p;
    return leave(hipSuccess);
}

hipError_t hipHostGetDevicePointer(void **dev, void *host, unsigned int flags) {
    hipError_t rc = enter("hipHostGetDevicePointer");
    if (rc == hipSuccess) {
        if (!dev || flags != 0 || !range_holding(host_allocs, (uintptr_t)host, 1)) {
            rc = hipErrorInvalidValue;
        } else {
            *dev = host; /* one address space, as on AMD GPUs */
        }
    }
    return leave(rc);
}

hipError_t hipHostFree(void *ptr) {
    hipError_t rc = enter("hipHostFree");
    if (rc == hipSuccess && ptr) {
        struct range *r = take_range(&host_allocs, (uintptr_t)ptr);
        if (!r) {
            rc = hipErrorInvalidValue;
        } else {
            free(r);
            free(ptr);
            books.host_allocs--;
        }
    }
    return leave(rc);
}

/* ---- hipMalloc and hipFree: ordinary memory, below libtms.so's interposers ---------------- */

hipError_t hipMalloc(void **ptr, size_t size) {
    ENTER("hipMalloc");
    books.malloc_calls++;
    void *p = NULL;
    if (!ptr) {
        return leave(hipErrorInvalidValue);
    }
    if (!(p = malloc(size ? size : 1)) || !add_range(&mallocs, (uintptr_t)p, size)) {
        free(p);
        return leave(hipErrorOutOfMemory);
    }
    books.malloc_live++;
    *ptr = p;
    return leave(hipSuccess);
}

hipError_t hipFree(void *ptr) {
    ENTER("hipFree");
    books.free_calls++;
    if (!ptr) {
        return leave(hipSuccess);
    }
    struct range *r = take_range(&mallocs, (uintptr_t)ptr);
    if (!r) {
        books.foreign_frees++;
        return leave(hipErrorInvalidValue);
    }
    free(r);
    free(ptr);
    books.malloc_live--;
    return leave(hipSuccess);
}
