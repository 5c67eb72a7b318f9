/*
 * tms.h - C interface of libtms.so (Torch Memory Saver).
 *
 * libtms.so keeps selected CUDA allocations "pauseable": their device memory can be given
 * back (pause) and taken again (resume) at the same virtual addresses, optionally with a
 * host (CPU) backup of the contents across the pause.
 *
 * Two ways to use it:
 *  - preload mode: LD_PRELOAD=libtms.so interposes cudaMalloc/cudaFree. Allocations made
 *    by a thread inside a region (tms_region_enter, or TMS_INIT_ENABLE=1) are pauseable;
 *    everything else goes to the real CUDA runtime unchanged.
 *  - direct calls: link with -ltms (or dlsym the symbols when the library is preloaded).
 *
 * Conventions:
 *  - Functions returning int return a status code: TMS_OK (0) or one of TMS_ERR_*.
 *  - On failure the calling thread's last error message says what failed and where;
 *    read it with tms_last_error().
 *  - Strings are NUL-terminated UTF-8. Where a tag is optional, NULL means "every tag";
 *    an empty tag is an invalid argument.
 *  - Functions that write text take (buf, cap, out_len): the text and a NUL go into buf
 *    (cap bytes); *out_len (when out_len is not NULL) receives the text's length without
 *    the NUL. If it does not fit, TMS_ERR_BUFFER_TOO_SMALL is returned and *out_len still
 *    says how much is needed.
 *  - No panic or exception crosses this interface; a bug inside the library is reported as
 *    TMS_ERR_INTERNAL and the process carries on.
 *  - In a child created by fork() after the library was used, the library is disabled:
 *    the hooks pass everything through and the API reports TMS_ERR_INVALID_STATE.
 *
 * Environment (read once, at first use): TMS_INIT_ENABLE, TMS_INIT_TAG,
 * TMS_INIT_ENABLE_CPU_BACKUP, TMS_INIT_CPU_BACKUP_BACKEND (pinned|mmap),
 * TMS_RETAIN_CPU_BACKUP, TMS_MEMORY_MARGIN_BYTES, TMS_BACKEND (auto|cuda|sim), TMS_LOG,
 * TMS_LOG_FORMAT (text|json);
 * for the simulated device: TMS_SIM_CAPACITY, TMS_SIM_DEVICES, TMS_SIM_GRANULARITY,
 * TMS_SIM_FAULTS.
 */
#ifndef TMS_H
#define TMS_H

#ifndef __cplusplus
#include <stdbool.h>
#endif
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Status codes (stable: never renumbered) ---------------------------------------- */

/* Success. */
#define TMS_OK 0
/* Out of memory (device or host); the state is unchanged and the call may be retried. */
#define TMS_ERR_OUT_OF_MEMORY 1
/* A CUDA driver call failed (the message names the call and its error). */
#define TMS_ERR_DRIVER 2
/* Bad argument (NULL where a value is required, empty tag, malformed setting, ...). */
#define TMS_ERR_INVALID_ARGUMENT 3
/* Not valid in the current state (region exit without enter, forked child, ...). */
#define TMS_ERR_INVALID_STATE 4
/* Unknown address or tag. */
#define TMS_ERR_NOT_FOUND 5
/* Not supported with this driver or build. */
#define TMS_ERR_UNSUPPORTED 6
/* An operating-system call failed. */
#define TMS_ERR_IO 7
/* A bug inside the library (a caught panic); the process carries on. */
#define TMS_ERR_INTERNAL 8
/* The caller's output buffer is too small; the needed length was reported in *out_len. */
#define TMS_ERR_BUFFER_TOO_SMALL 9

/* ---- Library information and errors ------------------------------------------------- */

/* Library version, a static string. */
const char *tms_version(void);

/* What this build is, a static string: "libtms 0.1.0 (torch-memory-saver, Rust implementation;
 * commit abc1234)", with the git commit it was built from ("unknown" when the build could not
 * tell). */
const char *tms_build_info(void);

/* Symbolic name of a status code ("TMS_OK", "TMS_ERR_DRIVER", ...), a static string;
 * "TMS_ERR_UNKNOWN_STATUS" for codes outside the list above. */
const char *tms_status_name(int code);

/* Copy this thread's last error message into buf (truncated to cap - 1 bytes, always
 * NUL-terminated when cap > 0; buf may be NULL). Returns the full message length, 0 when
 * there is none. */
size_t tms_last_error(char *buf, size_t cap);

/* How many errors the calling thread has recorded (each failure counts one, also a refused
 * cudaMalloc inside a hook): compare before and after to learn whether the library failed. */
uint64_t tms_error_count(void);

/* Start the library now (it otherwise starts at the first pauseable allocation) and write
 * the driver's name ("cuda" or "sim") into buf. */
int tms_init(char *buf, size_t cap, size_t *out_len);

/* 1 if the library has started successfully in this process (and it is not a fork
 * child), else 0. Never starts it. */
int tms_is_active(void);

/* ---- Regions (per thread, nesting) --------------------------------------------------- */

/* Enter a region on the calling thread. With enabled != 0, allocations become pauseable
 * under tag (NULL: keep the enclosing region's tag), with a CPU backup when cpu_backup != 0
 * in backend host memory ("pinned", "mmap", or NULL for the process default; a backend
 * without cpu_backup is an invalid argument). enabled = 0 opens a non-pauseable scope.
 * Leave with tms_region_exit(). */
int tms_region_enter(int enabled, const char *tag, int cpu_backup, const char *backend);

/* Leave the innermost region of the calling thread (TMS_ERR_INVALID_STATE if none). */
int tms_region_exit(void);

/* The calling thread's effective region settings as JSON:
 * {"enabled":..,"tag":..,"cpu_backup":..,"backend":..,"depth":..}. */
int tms_region_current(char *buf, size_t cap, size_t *out_len);

/* ---- Pause and resume ---------------------------------------------------------------- */

/* Pause every active allocation of tag (NULL or "": every tag): back up the contents where
 * a CPU backup was asked, then give the device memory back. Touching a paused range faults. */
int tms_pause(const char *tag);

/* Resume every paused allocation of tag (NULL or "": every tag) at the same addresses, restoring
 * backed-up contents. Out of memory leaves the tag paused with its backups; call again
 * once memory is free. */
int tms_resume(const char *tag);

/* tms_pause / tms_resume with a saved state: save_chunk_state records which allocations of
 * the tag, and which chunks of chunked ones, are active before pausing; restore_chunk_state
 * resumes only those (all of an allocation with nothing recorded). 1 (any non-zero value but
 * 2): the program's record; 2: a second record, which job-wide operations keep for their undo
 * (distributed pauses, tmsctl pause --atomic), so that they never overwrite the program's. */
int tms_pause_ex(const char *tag, int save_chunk_state);
int tms_resume_ex(const char *tag, int restore_chunk_state);

/* ---- Non-blocking resume ------------------------------------------------------------- */

/* Resume tag (NULL or "": every tag) without waiting for the contents: returns once the memory
 * is mapped, with the restores running on a thread of the library. Work then queued on stream
 * (a CUstream of device's primary context, 0 for its legacy default stream; none if device < 0)
 * runs after the restore. order (n_order addresses inside the tag's allocations, NULL if 0)
 * names what to restore first. *out_pending (or NULL): bytes still being restored at return.
 * A failure before the return is this call's; one after it leaves the allocations paused with
 * their backups, their memory held, and belongs to them: tms_wait_restored for any of them
 * returns it every time until they are paused, resumed or freed, and if no wait did, the first
 * pause or resume acting on them does its work and then returns it. Where the driver cannot make
 * streams wait, or no thread can be started, it blocks until the data landed. */
int tms_resume_nonblocking(const char *tag, int device, uint64_t stream, const uint64_t *order,
                           uint64_t n_order, uint64_t *out_pending);

/* Block until the allocation holding addr (0: every one) is restored by the non-blocking
 * resumes in flight, for at most timeout_ms (negative: no limit); *out_done (or NULL) = 1 if it
 * landed, 0 if the time ran out. */
int tms_wait_restored(uint64_t addr, int64_t timeout_ms, int *out_done);

/* Make stream (of device; 0: its legacy default stream) wait, without blocking the host, until
 * the allocation holding addr (0: every one) is restored. Nothing in flight: nothing queued. */
int tms_stream_wait_restored(uint64_t addr, int device, uint64_t stream);

/* ---- Chunked allocations ------------------------------------------------------------- */

/* A chunked allocation (made while the thread's chunk size, tms_set_chunk_size below, is not
 * 0) is one reserved range backed by independent chunks of physical memory that pause and
 * resume on their own, with their backups; chunks already in the target state are skipped, so
 * chunk calls and whole-tag pause/resume compose in any order. A failed resume leaves every
 * chunk it was to resume paused with its backup, and its message names them. By address (any
 * address inside the allocation): */
int tms_chunks_of(uint64_t addr, uint64_t *start, uint64_t *chunk_size, uint64_t *count);
int tms_chunk_states_at(uint64_t addr, uint8_t *out, uint64_t n); /* 1 = active */
int tms_chunks_at(uint64_t addr, int pause, const uint64_t *idx, uint64_t n);
/* The chunks lying wholly inside [addr, addr + len), rounded inward; the first chunk and the
 * count acted on go to *first and *count (either may be NULL). */
int tms_range(uint64_t addr, uint64_t len, int pause, uint64_t *first, uint64_t *count);

/* Keep host backups across resume (on != 0), so a later pause need not allocate them. */
int tms_set_retain_cpu_backup(int on);

/* Whether host backups are kept across resume, into *out (0 or 1). (The existing library's
 * bool tms_get_retain_cpu_backup(void), below, cannot report a failure.) */
int tms_query_retain_cpu_backup(int *out);

/* Refuse pauseable allocations that would leave fewer than bytes free on the device. */
int tms_set_memory_margin(uint64_t bytes);

/* The memory margin in bytes, into *out. */
int tms_get_memory_margin(uint64_t *out);

/* ---- CPU backups --------------------------------------------------------------------- */

/* Only complete snapshots are offered: the contents while paused with a backup, or the last
 * pause's contents while active with the backup retained. None (NULL, *found = 0) where there
 * is no backup, where it was released, or while a pause writes it or after one that failed.
 * TMS_ERR_NOT_FOUND if the range does not lie inside one pauseable allocation. */

/* Address of the host backup of [addr, addr + len) in *out, or NULL. Unguarded: the bytes
 * change with the next pause and go with a resume without retention or a free. Prefer
 * tms_acquire_cpu_backup. */
int tms_get_cpu_backup(uint64_t addr, uint64_t len, const void **out);

/* As tms_get_cpu_backup, but the bytes at *out stay mapped and unchanged until
 * tms_release_cpu_backup(*lease): a pause writes a new buffer instead, and a resume or free
 * leaves this one to the lease. *out is NULL (and *lease 0) where there is none. */
int tms_acquire_cpu_backup(uint64_t addr, uint64_t len, const void **out, uint64_t *lease);

/* End a lease from tms_acquire_cpu_backup. TMS_ERR_NOT_FOUND if it is not held. */
int tms_release_cpu_backup(uint64_t lease);

/* Copy the host backup of [addr, addr + len) into dst (len bytes); *found is 0 where there
 * is none (dst untouched), 1 when copied. */
int tms_copy_cpu_backup(uint64_t addr, uint64_t len, void *dst, int *found);

/* ---- Statistics ---------------------------------------------------------------------- */

/* Statistics as JSON: {"backend":..,"retain_cpu_backup":..,"memory_margin_bytes":..,
 * "tags":[{"tag":..,"allocations":..,"bytes_active":..,"bytes_paused":..,..},..]}. */
int tms_stats_json(char *buf, size_t cap, size_t *out_len);

/* Progress of the pause or resume running in the process, whoever started it (any thread, or
 * tmsctl through the control socket). Pauses and resumes run one at a time. */
typedef struct tms_progress {
    int32_t active;       /* 1 while a pause or resume runs; 0 when none does (all else 0) */
    int32_t op;           /* 1: a pause, 2: a resume */
    uint64_t bytes_total; /* bytes it copies to or from backups in all (0: nothing to copy;
                             known once its backups are prepared) */
    uint64_t bytes_done;  /* of those, copied so far */
    double seconds;       /* since it started (after waiting for another one to end) */
    double copy_seconds;  /* since its first bytes were copied (0 before): the rate so far is
                             bytes_done / copy_seconds */
    uint64_t thread_id;   /* the OS thread id (gettid) of the thread running it: a watcher
                             tells its own thread's call from another thread's */
    uint32_t backing;     /* where the copies go or come from: bit 0 host memory (CPU
                             backups), bit 1 disk files */
    uint32_t reserved;    /* 0 */
    char phase[32];       /* what it does now, NUL-terminated: "preparing", "synchronizing"
                             (waiting for the device's queued work), "mapping",
                             "copying_to_host", "writing_to_disk", "reading_from_disk",
                             "copying_to_device", "releasing" */
} tms_progress;

/* Write the progress into *out, of which the caller has size bytes (pass
 * sizeof(tms_progress); less is TMS_ERR_INVALID_ARGUMENT). Never starts the library and never
 * waits for the operation: a thread may poll it while another thread's tms_pause runs. */
int tms_get_progress(tms_progress *out, size_t size);

/* The calling thread's last tms_pause, tms_resume, tms_pause_ex, tms_resume_ex or chunk pause or
 * resume, once it has succeeded, into *out (size as above): active 0, phase "done", bytes_total
 * and bytes_done the bytes it copied to or from backups, seconds its duration; op 0 when that
 * call failed or there was none. The true totals of an operation too short to be watched. */
int tms_last_progress(tms_progress *out, size_t size);

/* Copy len bytes from host memory src into the active pauseable allocation at addr (the range
 * must lie inside one allocation). For tools, demos and tests; real workloads write with
 * kernels. */
int tms_write_bytes(uint64_t addr, const void *src, uint64_t len);

/* Copy len bytes from the active pauseable allocation at addr into host memory dst. */
int tms_read_bytes(uint64_t addr, void *dst, uint64_t len);

/* Start the library if needed and write this process's control socket path into buf;
 * TMS_ERR_UNSUPPORTED when there is none (TMS_CONTROL=0, or the socket folder was refused). */
int tms_control_socket(char *buf, size_t cap, size_t *out_len);

/* ---- The existing torch_memory_saver library's names ---------------------------------- */

/*
 * The names that users of the existing library call directly (through ctypes), with its
 * arguments. The setters act on the calling thread's innermost region; with none open they
 * open one from the thread's effective settings (tms_region_exit closes it). Where the
 * original returns nothing these return a status, which a caller may ignore; a getter's
 * failure reads as false / NULL with the reason in tms_last_error(). None of them ends the
 * process.
 */

/* Allocations of this thread become pauseable (true) or ordinary (false). */
int tms_set_interesting_region(bool is_interesting);
bool tms_get_interesting_region(void);

/* The tag of this thread's region (non-empty). tms_get_current_tag's string belongs to the
 * calling thread and is valid until its next call of tms_get_current_tag. */
int tms_set_current_tag(const char *tag);
const char *tms_get_current_tag(void);

/* CPU backup of this thread's new pauseable allocations, and its host memory ("pinned",
 * "mmap", or NULL for the process default; a static string from the getter). */
int tms_set_enable_cpu_backup(bool enable);
bool tms_get_enable_cpu_backup(void);
int tms_set_cpu_backup_backend(const char *backend);

const char *tms_get_cpu_backup_backend(void);

/* Disk backup of this thread's new pauseable allocations: each one's contents go to a file of
 * its own at pause and come back at resume (mutually exclusive with a CPU backup: enabling
 * one while the other is on is TMS_ERR_INVALID_ARGUMENT). The directory of new files (made
 * now if missing, mode 0700; found again by its path at each new file), or NULL / "" for the
 * default (TMS_DISK_BACKUP_DIR, else the system's temporary directory). */
int tms_set_enable_disk_backup(bool enable);
bool tms_get_enable_disk_backup(void);
int tms_set_disk_backup_dir(const char *dir);

/* Chunked allocations by tag (the tag must have exactly one). The chunk size of this thread's
 * new pauseable allocations: 0 (not chunked) or a multiple of the device's granularity; each
 * allocation's size must be a multiple of it. tms_get_num_chunks_for_tag returns 0 on failure;
 * tms_get_chunk_states returns false on failure; the arrays need room for every chunk. */
int tms_set_chunk_size(size_t bytes);
size_t tms_get_chunk_size(void);
int tms_pause_chunks(const char *tag, const size_t *idx, size_t n);
int tms_resume_chunks(const char *tag, const size_t *idx, size_t n);
size_t tms_get_num_chunks_for_tag(const char *tag);
bool tms_get_chunk_states(const char *tag, uint8_t *out, size_t n);
int tms_get_chunk_layout(const char *tag, size_t *offsets, size_t *sizes, size_t n);

/* tms_set_memory_margin under its old name. */
int set_memory_margin_bytes(uint64_t bytes);

/* Whether host backups are kept across resume (tms_set_retain_cpu_backup sets it). */
bool tms_get_retain_cpu_backup(void);

/* The host backup of [gpu_ptr, gpu_ptr + size), or NULL where there is none; valid as
 * tms_get_cpu_backup's pointer is. */
uint8_t *tms_get_cpu_backup_pointer(const uint8_t *gpu_ptr, uint64_t size);

/* Keep the whole allocation holding ptr mapped, at the same physical memory, across every
 * later pause and resume until it is freed (NCCL user-buffer registration needs that).
 * Returns its size in bytes; 0 for an address outside every pauseable allocation, and 0 with
 * the last error set when refused (some of it is paused, or a pause or resume is changing
 * it). tms_keep_resident_ex returns a status instead and the size through out_size (may be
 * NULL). */
size_t tms_keep_resident(const void *ptr);
int tms_keep_resident_ex(uint64_t ptr, uint64_t *out_size);

/* The devices a pause or resume of tag (NULL or "": every tag) acts on, ascending: the first
 * capacity of them go to out. Returns how many there are (more than capacity when out is too
 * short), or -1 with the last error set. */
int tms_affected_devices(const char *tag, int *out, int capacity);

/* ---- PyTorch pluggable allocator (torch.cuda.memory.CUDAPluggableAllocator) ---------- */

/* Allocate size bytes of pauseable memory on device, with the calling thread's region tag
 * and backup settings (always pauseable, region or not). Returns NULL on failure, with the
 * reason in the thread's last error. stream is ignored. */
void *tms_torch_malloc(ssize_t size, int device, void *stream);

/* Free memory from tms_torch_malloc; size, device and stream are ignored. */
void tms_torch_free(void *ptr, ssize_t size, int device, void *stream);

/* ---- CUDA runtime interposers (preload mode) ----------------------------------------- */

/*
 * libtms.so also exports cudaMalloc and cudaFree with the CUDA runtime's signatures:
 *   cudaMalloc: pauseable memory inside a region, the real runtime's outside
 *               (returns 2 = cudaErrorMemoryAllocation when pauseable memory runs out,
 *               with the reason in tms_last_error());
 *   cudaFree:   frees pauseable allocations, hands every other pointer to the runtime.
 * They are declared only when TMS_DECLARE_CUDA_INTERPOSERS is defined, so that this header
 * can be included next to cuda_runtime_api.h (whose cudaError_t return type differs).
 */
#ifdef TMS_DECLARE_CUDA_INTERPOSERS
int cudaMalloc(void **dev_ptr, size_t size);
int cudaFree(void *ptr);
#endif

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TMS_H */
