// Names the calling thread (at most 15 characters), so `top -H`, /proc, tests and
// tools/bench/threadcpu.py can tell the engine's threads apart and from the fast path's.
#pragma once
#include <pthread.h>

namespace mccl {

inline void name_this_thread(const char* name) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), name);
#elif defined(__APPLE__)
  pthread_setname_np(name);
#else
  (void)name;
#endif
}

}  // namespace mccl
