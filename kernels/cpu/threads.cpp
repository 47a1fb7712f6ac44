// Binding the threads of torch's parallel regions to cores (Linux): each thread of a region run from
// the calling thread sets its own affinity to one core of the list. With torch's OpenMP runtime
// (kernels/cpu/build.py links the kernels against it) the region's threads are the ones every later
// region of that calling thread reuses, torch's own products included, so one call binds them all.

#include <ATen/Parallel.h>

#include "ops.h"

#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace kvserve {

// Thread t of a region of len(cores) threads is bound to cores[t]; returns, per thread, the core it
// is bound to (-1 where it could not be: not Linux, a core outside the process's CPUs, or a region
// that ran fewer threads than asked).
std::vector<int64_t> bind_threads(std::vector<int64_t> cores) {
  const int64_t n = static_cast<int64_t>(cores.size());
  std::vector<int64_t> bound(n, -1);
  if (n == 0) return bound;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    const int64_t t = at::get_thread_num();
    if (t >= n || end - begin != 1) return;  // a thread with several items: the region is narrower than asked
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cores[t]), &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0) bound[t] = cores[t];
#endif
  });
  return bound;
}

// The core each thread of a region of n threads runs on now (-1: unknown).
std::vector<int64_t> thread_cores(int64_t n) {
  std::vector<int64_t> where(n, -1);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t) {
    const int64_t t = at::get_thread_num();
#if defined(__linux__)
    if (t < n) where[t] = sched_getcpu();
#endif
    (void)begin;
  });
  return where;
}

}  // namespace kvserve
