#include "core/fd_limit.h"

#include <dirent.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "core/errors.h"
#include "core/log.h"

namespace mccl {

int open_file_count() {
#ifdef __APPLE__
  const char* dir = "/dev/fd";
#else
  const char* dir = "/proc/self/fd";
#endif
  DIR* d = ::opendir(dir);
  if (!d) return -1;
  int n = 0;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n - 1;  // the directory's own fd
}

void ensure_open_files(int more, int want, const char* who) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return;  // nothing to go by: let open() say
  const int open = std::max(open_file_count(), 0);
  const rlim_t need = static_cast<rlim_t>(open) + static_cast<rlim_t>(more);
  const rlim_t target = std::max(need, static_cast<rlim_t>(want));
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur >= target) return;
  if (lim.rlim_cur == RLIM_INFINITY) return;
  const rlim_t before = lim.rlim_cur;
  rlim_t raised = lim.rlim_max == RLIM_INFINITY ? target : std::min(target, lim.rlim_max);
#ifdef __APPLE__
  raised = std::min<rlim_t>(raised, OPEN_MAX);  // setrlimit refuses more there
#endif
  if (raised > before) {
    rlimit next = lim;
    next.rlim_cur = raised;
    if (::setrlimit(RLIMIT_NOFILE, &next) == 0) {
      lim.rlim_cur = raised;
      log_line(LogLevel::kDebug, std::string(who) + " raised the open-file limit from " +
                                     std::to_string(before) + " to " + std::to_string(raised));
    }
  }
  if (lim.rlim_cur >= need) return;
  const std::string hard =
      lim.rlim_max == RLIM_INFINITY ? "unlimited" : std::to_string(lim.rlim_max);
  throw_error(ErrorKind::kConfig,
              std::string(who) + " needs to open " + std::to_string(more) +
                  " more files (link sockets; " + std::to_string(open) +
                  " open already) but the open-file limit is " + std::to_string(lim.rlim_cur) +
                  " (hard limit " + hard + "); raise it before starting: `ulimit -n " +
                  std::to_string(target) + "` (or the hard limit in /etc/security/limits.conf "
                  "/ launchctl limit maxfiles)");
}

}  // namespace mccl
