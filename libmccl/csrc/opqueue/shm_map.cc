#include "opqueue/shm_map.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/errors.h"

namespace mccl::opqueue {

namespace {

uint8_t* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw_error(ErrorKind::kGeneric, "[opqueue] mmap of " + name + " (" + std::to_string(bytes) +
                                         " bytes) failed: " + std::strerror(errno) +
                                         "; the host may be out of memory");
  }
  return static_cast<uint8_t*>(p);
}

[[noreturn]] void fail_create(int fd, const std::string& name, const char* what, int err) {
  if (fd >= 0) ::close(fd);
#ifndef __linux__
  ::shm_unlink(("/" + name).c_str());
#endif
  throw_error(ErrorKind::kGeneric, "[opqueue] " + std::string(what) + " shared memory " + name +
                                       " failed: " + std::strerror(err) +
                                       "; the host may be out of memory (or /dev/shm full)");
}

}  // namespace

std::unique_ptr<SharedMap> SharedMap::create(const std::string& name, size_t bytes) {
#ifdef __linux__
  int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) fail_create(-1, name, "creating", errno);
  // A memfd starts 0777; /proc/<pid>/fd/N would reopen it by that mode.
  if (::fchmod(fd, 0600) != 0) fail_create(fd, name, "restricting", errno);
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) fail_create(fd, name, "sizing", errno);
  // Sealed before anyone else sees it: from here on nobody (we included) can change its size.
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    fail_create(fd, name, "sealing", errno);
  }
#else
  int fd = ::shm_open(("/" + name).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    throw_error(ErrorKind::kConfig, "[opqueue] cannot create shared memory " + name + ": " +
                                        std::strerror(errno) + "; a stale segment of a reused pid?");
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) fail_create(fd, name, "sizing", errno);
#endif
  uint8_t* base = nullptr;
  try {
    base = map_fd(fd, bytes, name);
  } catch (...) {
    fail_create(fd, name, "mapping", errno);
  }
  return std::unique_ptr<SharedMap>(new SharedMap(name, base, bytes, fd));
}

std::unique_ptr<SharedMap> SharedMap::adopt(int fd, const std::string& name, size_t bytes) {
  int own = fd >= 0 ? ::fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
  if (own < 0) {
    throw_error(ErrorKind::kProtocol, "[opqueue] client queue " + name +
                                          " was not handed over to mccld (no descriptor); the client "
                                          "and mccld releases differ?");
  }
#ifdef __linux__
  int seals = ::fcntl(own, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    ::close(own);
    throw_error(ErrorKind::kProtocol, "[opqueue] client queue " + name +
                                          " is not sealed against shrinking; the client could "
                                          "truncate it under mccld: refused");
  }
#endif
  struct stat st;
  if (::fstat(own, &st) != 0 || st.st_size < 0 || static_cast<size_t>(st.st_size) < bytes) {
    ::close(own);
    throw_error(ErrorKind::kProtocol, "[opqueue] client queue " + name + " holds fewer than the " +
                                          std::to_string(bytes) +
                                          " bytes its client announced; client and daemon differ");
  }
  uint8_t* base = nullptr;
  try {
    base = map_fd(own, bytes, name);
  } catch (...) {
    ::close(own);
    throw;
  }
  ::close(own);
  return std::unique_ptr<SharedMap>(new SharedMap(name, base, bytes, -1));
}

SharedMap::~SharedMap() {
  ::munmap(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

void SharedMap::unlink() {
#ifndef __linux__
  if (fd_ >= 0) ::shm_unlink(("/" + name_).c_str());
#endif
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace mccl::opqueue
