// A library that uses the CUDA runtime, opened by local_main with RTLD_LOCAL: its libcudart
// then lives in a local scope, as PyTorch's does when Python imports an extension module.
#include <stddef.h>

int cudaMalloc(void **p, size_t n);
int cudaFree(void *p);
int fake_cuda_malloc_calls(void);

int user_alloc_free(size_t n) {
  void *p = NULL;
  int rc = cudaMalloc(&p, n);
  if (rc != 0) return rc;
  return cudaFree(p);
}

int user_fake_calls(void) { return fake_cuda_malloc_calls(); }
