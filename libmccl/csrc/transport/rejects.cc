#include "transport/rejects.h"

#include <algorithm>
#include <vector>

#include "core/log.h"

namespace mccl {

namespace {

std::string host_of(const std::string& addr) {
  if (!addr.empty() && addr[0] == '[') return addr.substr(0, addr.find(']') + 1);
  return addr.substr(0, addr.rfind(':'));
}

}  // namespace

void Rejects::note(const std::string& addr, const std::string& why) {
  LogLevel level = LogLevel::kDebug;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const std::string host = host_of(addr);
    auto it = sources_.find(host);
    if (it == sources_.end()) {
      if (sources_.size() >= kMaxSources) {
        ++unremembered_;
      } else {
        it = sources_.emplace(host, Source{}).first;
        level = LogLevel::kWarning;
      }
    }
    if (it != sources_.end()) {
      it->second.count++;
      it->second.last_addr = addr;
      it->second.last_why = why;
    }
  }
  log_line(level, context_ + " dropped a connection from " + addr + ": it " + why +
                      (level == LogLevel::kWarning
                           ? "; a stranger or a rank with another job key (further drops from "
                             "this host are logged at DEBUG)"
                           : ""));
}

uint64_t Rejects::total() const {
  std::lock_guard<std::mutex> lk(mu_);
  uint64_t n = unremembered_;
  for (const auto& kv : sources_) n += kv.second.count;
  return n;
}

std::string Rejects::summary() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<const Source*> busiest;
  for (const auto& kv : sources_) busiest.push_back(&kv.second);
  std::sort(busiest.begin(), busiest.end(),
            [](const Source* a, const Source* b) { return a->count > b->count; });
  std::string out;
  for (size_t i = 0; i < busiest.size() && i < 3; ++i) {
    if (!out.empty()) out += "; ";
    out += std::to_string(busiest[i]->count) + " connection(s) from " + busiest[i]->last_addr +
           " " + busiest[i]->last_why;
  }
  size_t rest = busiest.size() > 3 ? busiest.size() - 3 : 0;
  if (rest || unremembered_) {
    out += "; and more from " + std::to_string(rest + (unremembered_ ? 1 : 0)) + "+ other host(s)";
  }
  return out;
}

}  // namespace mccl
