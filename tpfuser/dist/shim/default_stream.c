/* Lets ranks that share one GPU run nvFuser 0.2.36's host IR (the overlapped
 * fusions, parallel/overlapped.py).
 *
 * HostIrEvaluator's constructor (csrc/host_ir/evaluator.cpp at 7e04d26) asks
 * for c10::cuda::getDefaultCUDAStream(communicator->deviceId()): the global
 * rank, used as a CUDA device index. On a machine with fewer GPUs than ranks
 * every rank past the last GPU fails there ("Device index value 1 is out of
 * index range [0, 1)"). Preloaded (LD_PRELOAD), this library takes that
 * function's symbol first: an index at or past the visible device count
 * becomes -1, the current device (the one tpfuser.dist.sharegpu gives every rank), and
 * every call is then passed to c10's own function. Nothing else changes.
 *
 * Built by tpfuser.dist.sharegpu.build_default_stream_shim (gcc -shared -fPIC -O2 -fexceptions ...:
 * c10 may throw through this frame).
 * TPFUSER_SHIM_LOG=1 prints each index it changes to stderr.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* c10::cuda::CUDAStream: a c10::Stream, {Device {int8 type, int8 index}, int64 id}:
 * 16 bytes, trivially copyable, so returned in two integer registers, as this struct is. */
typedef struct { uint64_t device; int64_t id; } cuda_stream;
typedef cuda_stream (*default_stream_fn)(signed char);
typedef signed char (*device_count_fn)(void);

#define C10_CUDA "libc10_cuda.so"
#define DEFAULT_STREAM "_ZN3c104cuda20getDefaultCUDAStreamEa" /* c10::cuda::getDefaultCUDAStream(DeviceIndex) */
#define DEVICE_COUNT "_ZN3c104cuda12device_countEv"           /* c10::cuda::device_count() */

static default_stream_fn real;
static device_count_fn count;
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* torch loads libc10_cuda privately (RTLD_LOCAL): its symbols are not in the
 * global scope that RTLD_NEXT and RTLD_DEFAULT search, so look in it by name
 * (already loaded: RTLD_NOLOAD), then in the global scope. */
static void resolve(void) {
  void *c10 = dlopen(C10_CUDA, RTLD_LAZY | RTLD_NOLOAD);
  if (c10 != NULL) {
    real = (default_stream_fn)dlsym(c10, DEFAULT_STREAM);
    count = (device_count_fn)dlsym(c10, DEVICE_COUNT);
  }
  if (real == NULL) real = (default_stream_fn)dlsym(RTLD_NEXT, DEFAULT_STREAM);
  if (count == NULL) count = (device_count_fn)dlsym(RTLD_NEXT, DEVICE_COUNT);
}

/* 1 when c10's two functions are found (for the tests and the curious). */
int tpfuser_shim_resolved(void) {
  pthread_once(&once, resolve);
  return real != NULL && count != NULL;
}

cuda_stream _ZN3c104cuda20getDefaultCUDAStreamEa(signed char index) {
  pthread_once(&once, resolve);
  if (real == NULL) {
    fprintf(stderr, "default_stream shim: %s not found in %s or after this library\n", DEFAULT_STREAM, C10_CUDA);
    abort();
  }
  if (index >= 0 && count != NULL) {
    signed char visible = count();
    if (index >= visible) {
      if (getenv("TPFUSER_SHIM_LOG") != NULL)
        fprintf(stderr, "default_stream shim: device index %d of %d visible -> the current device\n", index,
                visible);
      index = -1;
    }
  }
  return real(index);
}
