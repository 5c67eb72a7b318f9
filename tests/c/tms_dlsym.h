/*
 * The tms_* API of a preloaded libtms.so, looked up with dlsym(RTLD_DEFAULT) (the library is
 * preloaded, not linked), for the end-to-end test programs. Define TMS_FUNCTIONS(X) to list the
 * functions used, then include this after tms.h: each is called through p_<name>, whose type
 * comes from the header's prototype, and load_api() finds them all, saying which it cannot.
 */
#ifndef TMS_DLSYM_H
#define TMS_DLSYM_H

#include <dlfcn.h>
#include <stdio.h>

#define DECLARE_POINTER(name) static __typeof__(&name) p_##name;
TMS_FUNCTIONS(DECLARE_POINTER)
#undef DECLARE_POINTER

static int load_api(void) {
    int ok = 1;
#define LOAD_POINTER(name)                                                                   \
    p_##name = (__typeof__(&name))dlsym(RTLD_DEFAULT, #name);                                \
    if (p_##name == NULL) {                                                                  \
        printf("FAIL: %s not found: is libtms.so preloaded (LD_PRELOAD)?\n", #name);         \
        ok = 0;                                                                              \
    }
    TMS_FUNCTIONS(LOAD_POINTER)
#undef LOAD_POINTER
    fflush(stdout);
    return ok;
}

#endif /* TMS_DLSYM_H */
