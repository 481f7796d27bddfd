// A shared-memory mapping owned by C++, so the threads that touch a queue (dispatcher.h,
// client_queue.h) keep it mapped for exactly as long as they run, whatever the Python side
// does with its own objects.
//
// The client creates the memory and hands its descriptor to mccld over the runtime dir's
// Unix socket (mccl_common/fd_handover.py); nothing is reachable by name. On Linux it is a
// memfd sealed against shrinking and growing: the client cannot truncate it under mccld's
// mapping, so mccld's native thread cannot die of SIGBUS, and mccld refuses a descriptor
// without that seal. macOS has no memfd: a POSIX shm object, unlinked once handed over (a
// macOS shm object cannot be resized after its first ftruncate, so it cannot shrink either).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace mccl::opqueue {

class SharedMap {
 public:
  // New memory of `bytes`, sealed (Linux): the client's side. `name` labels it in errors
  // and in /proc/<pid>/fd; fd() is what the client hands over.
  static std::unique_ptr<SharedMap> create(const std::string& name, size_t bytes);
  // mccld's side: memory a client handed over as `fd` (duplicated here; the caller keeps
  // its own), holding at least `bytes`, mapped over exactly `bytes`. ProtocolError if it is
  // smaller or (Linux) not sealed against shrinking.
  static std::unique_ptr<SharedMap> adopt(int fd, const std::string& name, size_t bytes);
  ~SharedMap();
  SharedMap(const SharedMap&) = delete;
  SharedMap& operator=(const SharedMap&) = delete;

  uint8_t* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }
  // The creator's descriptor of the memory, -1 on mccld's side (closed once mapped).
  int fd() const { return fd_; }
  // Drops the creator's name (macOS) and descriptor once mccld holds its own; the mapping
  // stays valid until destruction. A second call is harmless.
  void unlink();

 private:
  SharedMap(std::string name, uint8_t* base, size_t bytes, int fd)
      : name_(std::move(name)), base_(base), bytes_(bytes), fd_(fd) {}
  std::string name_;
  uint8_t* base_;
  size_t bytes_;
  int fd_;
};

}  // namespace mccl::opqueue
