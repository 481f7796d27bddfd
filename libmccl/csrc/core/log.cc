#include "core/log.h"

#include <atomic>
#include <cstdio>

namespace mccl {

namespace {
std::atomic<LogSink> g_sink{nullptr};
}  // namespace

void set_log_sink(LogSink sink) { g_sink.store(sink); }

void log_line(LogLevel level, const std::string& line) {
  LogSink sink = g_sink.load();
  if (sink) {
    sink(level, line);
  } else if (level >= LogLevel::kWarning) {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

}  // namespace mccl
