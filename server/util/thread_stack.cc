// civetweb (serving /metrics) starts its threads with a 100 KiB stack. With cuBLAS in the process
// its static TLS (~104 KiB) no longer fits, pthread_create fails with EINVAL and the metrics
// endpoint dies. Executables link this file so that such small stack requests become 1 MiB; it
// must live in the executable itself (exported with --export-dynamic-symbol) to take precedence
// over libc's definition.
#include <dlfcn.h>
#include <pthread.h>

#include <cstddef>

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using Real = int (*)(pthread_attr_t*, size_t);
  static const Real real = reinterpret_cast<Real>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  constexpr size_t kMinimumStack = size_t{1} << 20;
  return real(attr, size < kMinimumStack ? kMinimumStack : size);
}
