// Short-lived helper threads of a link source (a dial, a handshake): kept in a list, joined
// once finished (at the next start) or all at once when the source stops.
#pragma once
#include <atomic>
#include <list>
#include <memory>
#include <thread>
#include <utility>

#include "core/thread_name.h"

namespace mccl {

struct HelperThread {
  std::thread thread;
  std::shared_ptr<std::atomic<bool>> done = std::make_shared<std::atomic<bool>>(false);
};
using HelperThreads = std::list<HelperThread>;

// Joins the finished helpers (all of them with `all`, waiting for each).
inline void reap_helpers(HelperThreads* helpers, bool all) {
  for (auto it = helpers->begin(); it != helpers->end();) {
    if (all || it->done->load()) {
      it->thread.join();
      it = helpers->erase(it);
    } else {
      ++it;
    }
  }
}

// Runs `fn` (move-only is fine) on a new helper named `name`, after reaping finished ones.
template <typename F>
void start_helper(HelperThreads* helpers, const char* name, F fn) {
  reap_helpers(helpers, false);
  helpers->emplace_back();
  HelperThread& h = helpers->back();
  h.thread = std::thread([fn = std::move(fn), name, done = h.done]() mutable {
    name_this_thread(name);
    fn();
    done->store(true);
  });
}

}  // namespace mccl
