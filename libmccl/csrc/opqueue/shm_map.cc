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
    int err = errno;
    ::close(fd);
    throw_error(ErrorKind::kGeneric, "[opqueue] mmap of " + name + " (" + std::to_string(bytes) +
                                         " bytes) failed: " + std::strerror(err) +
                                         "; the host may be out of memory");
  }
  ::close(fd);
  return static_cast<uint8_t*>(p);
}

}  // namespace

std::unique_ptr<SharedMap> SharedMap::create(const std::string& name, size_t bytes) {
  int fd = ::shm_open(("/" + name).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    throw_error(ErrorKind::kConfig, "[opqueue] cannot create shared memory " + name + ": " +
                                        std::strerror(errno) +
                                        "; a stale segment of a reused pid? remove /dev/shm/" + name);
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    ::close(fd);
    ::shm_unlink(("/" + name).c_str());
    throw_error(ErrorKind::kGeneric, "[opqueue] sizing shared memory " + name + " failed: " +
                                         std::strerror(err) + "; /dev/shm may be full");
  }
  uint8_t* base = nullptr;
  try {
    base = map_fd(fd, bytes, name);
  } catch (...) {
    ::shm_unlink(("/" + name).c_str());
    throw;
  }
  return std::unique_ptr<SharedMap>(new SharedMap(name, base, bytes));
}

std::unique_ptr<SharedMap> SharedMap::open(const std::string& name, size_t bytes) {
  int fd = ::shm_open(("/" + name).c_str(), O_RDWR, 0600);
  if (fd < 0) {
    throw_error(ErrorKind::kProtocol, "[opqueue] client queue " + name + " cannot be opened: " +
                                          std::strerror(errno) +
                                          "; the client exited or named a segment it did not create");
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || st.st_size < 0 || static_cast<size_t>(st.st_size) < bytes) {
    ::close(fd);
    throw_error(ErrorKind::kProtocol, "[opqueue] client queue " + name + " holds fewer than the " +
                                          std::to_string(bytes) +
                                          " bytes its client announced; client and daemon differ");
  }
  return std::unique_ptr<SharedMap>(new SharedMap(name, map_fd(fd, bytes, name), bytes));
}

SharedMap::~SharedMap() { ::munmap(base_, bytes_); }

void SharedMap::unlink() const { ::shm_unlink(("/" + name_).c_str()); }

}  // namespace mccl::opqueue
