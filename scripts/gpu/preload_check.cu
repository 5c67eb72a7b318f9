// LD_PRELOAD check against the real CUDA runtime: cudaMalloc outside a region is the
// runtime's, inside a region it is pauseable VMM memory that kernels and cudaMemcpy use
// like any other; pause gives it back (cudaMemGetInfo), resume restores it at the same
// address with its contents (CPU backup), and cudaFree of either kind works.
// Build: nvcc -cudart shared -arch=sm_90 -o preload_check preload_check.cu -ldl
// Run:   LD_PRELOAD=libtms.so ./preload_check
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*enter_fn)(int, const char *, int, const char *);
typedef int (*exit_fn)(void);
typedef int (*tag_fn)(const char *);
typedef int (*backup_fn)(uint64_t, uint64_t, const void **);
typedef size_t (*err_fn)(char *, size_t);

static int passed, failed;
static void check(const char *name, int ok, const char *detail) {
  printf("%s  %s: %s\n", ok ? "PASS" : "FAIL", name, detail);
  if (ok) passed++; else failed++;
}

__global__ void add_one(unsigned char *p, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] += 1;
}

static size_t free_mem(void) {
  size_t f = 0, t = 0;
  cudaMemGetInfo(&f, &t);
  return f;
}

int main(void) {
  enter_fn enter = (enter_fn)dlsym(RTLD_DEFAULT, "tms_region_enter");
  exit_fn leave = (exit_fn)dlsym(RTLD_DEFAULT, "tms_region_exit");
  tag_fn pause = (tag_fn)dlsym(RTLD_DEFAULT, "tms_pause");
  tag_fn resume = (tag_fn)dlsym(RTLD_DEFAULT, "tms_resume");
  backup_fn backup = (backup_fn)dlsym(RTLD_DEFAULT, "tms_get_cpu_backup");
  err_fn last_error = (err_fn)dlsym(RTLD_DEFAULT, "tms_last_error");
  if (!enter || !leave || !pause || !resume || !backup || !last_error) {
    printf("FAIL  libtms.so is not preloaded (tms_* symbols missing)\n");
    return 1;
  }
  char msg[512];
  const size_t n = (1ull << 30) + 12345;
  void *plain = NULL, *p = NULL;
  cudaError_t e = cudaMalloc(&plain, 64 << 20);
  const void *hb = NULL;
  check("outside a region cudaMalloc is the runtime's", e == cudaSuccess && backup((uint64_t)plain, 1, &hb) == 5,
        cudaGetErrorString(e));

  enter(1, "kv", 1, "pinned");
  e = cudaMalloc(&p, n);
  leave();
  int owned = e == cudaSuccess && backup((uint64_t)p, 1, &hb) == 0;
  snprintf(msg, sizeof msg, "%s, ptr %p", cudaGetErrorString(e), p);
  check("inside a region cudaMalloc is pauseable", owned, msg);
  if (!owned) return 1;

  unsigned char *host = (unsigned char *)malloc(n), *back = (unsigned char *)malloc(n);
  uint64_t x = 88172645463325252ull;
  for (size_t i = 0; i < n; i++) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; host[i] = (unsigned char)x; }
  e = cudaMemcpy(p, host, n, cudaMemcpyHostToDevice);
  add_one<<<1024, 256>>>((unsigned char *)p, n);
  cudaError_t k = cudaDeviceSynchronize();
  check("cudaMemcpy and a kernel work on pauseable memory", e == cudaSuccess && k == cudaSuccess, cudaGetErrorString(k));

  size_t f0 = free_mem();
  int rc = pause("kv");
  size_t f1 = free_mem();
  last_error(msg, sizeof msg);
  char d[600];
  snprintf(d, sizeof d, "status %d, free rose by %.3f GiB for %.3f GiB %s", rc, ((double)f1 - (double)f0) / (1 << 30),
           (double)n / (1 << 30), rc ? msg : "");
  check("tms_pause gives the memory back", rc == 0 && (double)(f1 - f0) >= 0.99 * (double)n, d);

  rc = resume("kv");
  size_t f2 = free_mem();
  snprintf(d, sizeof d, "status %d, free fell by %.3f GiB", rc, ((double)f1 - (double)f2) / (1 << 30));
  check("tms_resume takes it again", rc == 0 && (double)(f1 - f2) >= 0.99 * (double)n, d);

  add_one<<<1024, 256>>>((unsigned char *)p, n);
  k = cudaDeviceSynchronize();
  e = cudaMemcpy(back, p, n, cudaMemcpyDeviceToHost);
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += back[i] != (unsigned char)(host[i] + 2);
  snprintf(d, sizeof d, "%zu of %zu bytes differ (%s)", bad, n, cudaGetErrorString(k));
  check("same address, contents kept, kernels run after resume", e == cudaSuccess && k == cudaSuccess && bad == 0, d);

  size_t f3 = free_mem();
  e = cudaFree(p);
  size_t f4 = free_mem();
  snprintf(d, sizeof d, "%s, free rose by %.3f GiB", cudaGetErrorString(e), ((double)f4 - (double)f3) / (1 << 30));
  check("cudaFree of a pauseable allocation", e == cudaSuccess && (double)(f4 - f3) >= 0.99 * (double)n, d);
  e = cudaFree(plain);
  check("cudaFree of a plain allocation goes to the runtime", e == cudaSuccess, cudaGetErrorString(e));
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
