// Where the engine's log lines go. The engine has no logging framework of its own: the
// binding installs a sink that hands each line to Python's `logging` (logger
// "libmccl.engine"), so operators filter and route engine lines like every other MCCL
// line. Without a sink, warnings go to stderr and the rest is dropped.
#pragma once
#include <string>

namespace mccl {

enum class LogLevel : int { kDebug = 10, kInfo = 20, kWarning = 30 };

using LogSink = void (*)(LogLevel level, const std::string& line);

// Not synchronised with log_line: install once, before any communicator is built.
void set_log_sink(LogSink sink);
void log_line(LogLevel level, const std::string& line);

}  // namespace mccl
