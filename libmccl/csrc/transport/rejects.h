// The connections an acceptor dropped because they never proved the job key: strangers,
// port scanners, or a real rank that holds another key. Set-up goes on past them; they
// are logged once per source host at WARNING and then at DEBUG, so a scanner cannot fill
// the log, and if set-up times out the error says who failed and how often, because a
// real peer with the wrong key looks exactly like a stranger from here.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace mccl {

class Rejects {
 public:
  // `context` leads every log line ("[transport] rank 1").
  explicit Rejects(std::string context) : context_(std::move(context)) {}

  // One dropped connection from `addr` ("host:port"); `why` says what it failed.
  void note(const std::string& addr, const std::string& why);

  uint64_t total() const;
  // "3 connection(s) from 10.0.0.9:4711 failed the proof of the job key", for the few
  // busiest sources; empty when none was dropped.
  std::string summary() const;

 private:
  struct Source {
    uint64_t count = 0;
    std::string last_addr;
    std::string last_why;
  };
  static constexpr size_t kMaxSources = 64;  // beyond: counted, not remembered

  std::string context_;
  mutable std::mutex mu_;
  std::map<std::string, Source> sources_;  // by host
  uint64_t unremembered_ = 0;
};

}  // namespace mccl
