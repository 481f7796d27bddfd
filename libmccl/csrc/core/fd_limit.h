// RLIMIT_NOFILE: every link socket is an open file, and macOS starts processes with a
// soft limit of 256. Raising the soft limit (up to the hard one) is allowed without
// privileges, so the engine does it rather than failing with EMFILE mid-job.
#pragma once

namespace mccl {

// Files this process has open now (-1 if it cannot tell).
int open_file_count();

// Makes sure `more` files can still be opened: raises the soft limit towards `want`
// (at least open + more, at most the hard limit) when it is lower. Throws a ConfigError
// naming `ulimit -n`, what is needed and what the limits are, when even the hard limit
// leaves no room for `more`. `who` leads the message ("[engine] rank 3").
void ensure_open_files(int more, int want, const char* who);

}  // namespace mccl
