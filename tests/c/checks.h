/*
 * What the test programs (e2e_prog.c, nccl_prog.c) share: the tms_* API through function
 * pointers of the header's types, and their output: one "PASS: ..." or "FAIL: ..." line per
 * check, machine-readable lines ("STATS <label> <json>", "ERROR <label> <message>") and a last
 * line "RESULT: PASS <mode>" or "RESULT: FAIL <mode> ...".
 *
 * Included after tms.h. The includer loads p_tms_last_error and p_tms_stats_json with the rest
 * of the API it uses (LOAD_POINTER).
 */
#ifndef TMS_TEST_CHECKS_H
#define TMS_TEST_CHECKS_H

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* p_NAME: a pointer to the tms_* function NAME, with the header's type. */
#define DECLARE_POINTER(name) static __typeof__(&name) p_##name;

/* Look NAME up in HANDLE into p_NAME; says so and clears OK where it is missing. */
#define LOAD_POINTER(handle, name, ok)                                                       \
    p_##name = (__typeof__(&name))dlsym(handle, #name);                                      \
    if (p_##name == NULL) {                                                                  \
        printf("FAIL: %s not found: is libtms.so preloaded (LD_PRELOAD)?\n", #name);         \
        ok = 0;                                                                              \
    }

/* static int load_api(void *handle): every function of LIST (an X-macro of names) into its
 * pointer, from HANDLE; 0 (each missing one said) when some is missing. */
#define LOAD_FROM_HANDLE(name) LOAD_POINTER(handle, name, ok)
#define DEFINE_LOAD_API(LIST)                                                                \
    static int load_api(void *handle) {                                                      \
        int ok = 1;                                                                          \
        LIST(LOAD_FROM_HANDLE)                                                               \
        fflush(stdout);                                                                      \
        return ok;                                                                           \
    }

DECLARE_POINTER(tms_last_error)
DECLARE_POINTER(tms_stats_json)

static int failures;
static const char *who = "";

__attribute__((format(printf, 2, 3))) static void check(int ok, const char *fmt, ...) {
    va_list ap;
    printf("%s%s: ", ok ? "PASS" : "FAIL", who);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    fflush(stdout);
    if (!ok) {
        failures++;
    }
}

static const char *last_error(void) {
    static char buf[8192];
    buf[0] = 0;
    p_tms_last_error(buf, sizeof buf);
    return buf;
}

static void report_error(const char *label) {
    printf("ERROR %s %s\n", label, last_error());
    fflush(stdout);
}

/* Print the engine's statistics as "STATS <label> <json>", exercising the too-small-buffer
 * protocol on the way. */
static void print_stats(const char *label) {
    size_t need = 0;
    int rc = p_tms_stats_json(NULL, 0, &need);
    check(rc == TMS_ERR_BUFFER_TOO_SMALL && need > 0,
          "tms_stats_json(NULL, 0) reports TMS_ERR_BUFFER_TOO_SMALL and the length (rc %d, %zu)",
          rc, need);
    char *buf = malloc(need + 1);
    size_t len = 0;
    rc = buf ? p_tms_stats_json(buf, need + 1, &len) : -1;
    check(rc == TMS_OK && len == need, "tms_stats_json(%s) (rc %d)", label, rc);
    if (rc == TMS_OK) {
        printf("STATS %s %s\n", label, buf);
        fflush(stdout);
    }
    free(buf);
}

static int finish(const char *mode) {
    if (failures == 0) {
        printf("RESULT: PASS %s\n", mode);
    } else {
        printf("RESULT: FAIL %s (%d failed checks)\n", mode, failures);
    }
    fflush(stdout);
    return failures == 0 ? 0 : 1;
}

#endif /* TMS_TEST_CHECKS_H */
