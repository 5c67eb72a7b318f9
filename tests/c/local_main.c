// Opens local_user (and so the fake libcudart) with RTLD_LOCAL and allocates outside any
// region: with libtms.so preloaded the call must still reach the runtime below.
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) { printf("FAIL dlopen: %s\n", dlerror()); return 2; }
  int (*alloc_free)(size_t) = (int (*)(size_t))dlsym(h, "user_alloc_free");
  int (*calls)(void) = (int (*)(void))dlsym(h, "user_fake_calls");
  if (!alloc_free || !calls) { printf("FAIL dlsym\n"); return 2; }
  int rc1 = alloc_free(64);
  int rc2 = alloc_free(128);
  int n = calls();
  printf("rc1=%d rc2=%d fake_calls=%d\n", rc1, rc2, n);
  return (rc1 == 0 && rc2 == 0 && n == 2) ? 0 : 1;
}
