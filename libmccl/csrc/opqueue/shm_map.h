// A named POSIX shared-memory mapping owned by C++, so the threads that touch a queue
// (dispatcher.h, client_queue.h) keep it mapped for exactly as long as they run, whatever
// the Python side does with its own objects.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace mccl::opqueue {

class SharedMap {
 public:
  // A new segment of `bytes` (fails if the name exists): the client's side.
  static std::unique_ptr<SharedMap> create(const std::string& name, size_t bytes);
  // An existing one holding at least `bytes`, mapped over exactly `bytes`: mccld's side.
  // ProtocolError if it is missing or smaller.
  static std::unique_ptr<SharedMap> open(const std::string& name, size_t bytes);
  ~SharedMap();
  SharedMap(const SharedMap&) = delete;
  SharedMap& operator=(const SharedMap&) = delete;

  uint8_t* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }
  // Removes the name; the mapping stays valid until destruction. A second call is harmless.
  void unlink() const;

 private:
  SharedMap(std::string name, uint8_t* base, size_t bytes)
      : name_(std::move(name)), base_(base), bytes_(bytes) {}
  std::string name_;
  uint8_t* base_;
  size_t bytes_;
};

}  // namespace mccl::opqueue
