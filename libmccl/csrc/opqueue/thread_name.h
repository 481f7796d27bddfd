// Names the calling thread (at most 15 characters), so `top -H`, /proc and tests can tell
// the fast path's threads from the engine's.
#pragma once
#include <pthread.h>

namespace mccl::opqueue {

inline void name_this_thread(const char* name) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), name);
#elif defined(__APPLE__)
  pthread_setname_np(name);
#else
  (void)name;
#endif
}

}  // namespace mccl::opqueue
