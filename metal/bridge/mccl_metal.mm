// The Metal bridge (see mccl_metal.h for the contract). Built on macOS only (CMake,
// APPLE); linked against Metal and Foundation, not torch. NOT compiled or run in this
// repository's CI: metal/README.md lists what verifies it on a Mac.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#include <dispatch/dispatch.h>
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mccl_metal.h"

namespace {

thread_local std::string g_error;
int fail(const std::string& what) {
  g_error = what;
  return 1;
}

// torch::mps's three entry points. Their return types are Objective-C objects in torch's
// headers (id<MTLCommandBuffer>, dispatch_queue_t) and void* to C++; the mangled names do
// not encode return types, so plain pointers are what we call.
using GetPtr = void* (*)();
using Commit = void (*)();
GetPtr g_command_buffer = nullptr;
GetPtr g_dispatch_queue = nullptr;
Commit g_commit = nullptr;
id<MTLDevice> g_device = nil;
MTLSharedEventListener* g_listener = nil;

// Runs `body` on torch's serial queue (dispatch_sync: its encoding is done when we return,
// and torch's own encoders cannot interleave with ours).
int on_torch_queue(const char* what, void (^body)(id<MTLCommandBuffer>)) {
  if (!g_commit) return fail(std::string("[metal] ") + what + ": mccl_metal_open was not called");
  __block std::string error;
  dispatch_queue_t q = (__bridge dispatch_queue_t)g_dispatch_queue();
  dispatch_sync(q, ^{
    @autoreleasepool {
      // torch's commit ends its coalesced compute encoder (a command buffer with an open
      // encoder takes no other encoder) and hands what torch queued to the GPU.
      g_commit();
      id<MTLCommandBuffer> cb = (__bridge id<MTLCommandBuffer>)g_command_buffer();
      if (cb == nil) {
        error = "torch::mps::get_command_buffer returned nil";
        return;
      }
      body(cb);
    }
  });
  if (!error.empty()) return fail(std::string("[metal] ") + what + ": " + error);
  return 0;
}

// The mirror thread: CPU words -> event signaledValue, for O2 (GPU waits on the engine).
struct Mirror {
  id<MTLSharedEvent> event;
  const uint64_t* word;
  uint64_t value;
};
std::mutex g_mirror_mu;
std::condition_variable g_mirror_cv;
std::vector<Mirror> g_mirrors;
bool g_mirror_started = false;

void mirror_loop() {
  std::unique_lock<std::mutex> lk(g_mirror_mu);
  for (;;) {
    g_mirror_cv.wait(lk, [] { return !g_mirrors.empty(); });
    for (size_t i = 0; i < g_mirrors.size();) {
      uint64_t now = __atomic_load_n(g_mirrors[i].word, __ATOMIC_ACQUIRE);
      if (now >= g_mirrors[i].value) {
        g_mirrors[i].event.signaledValue = now;  // poison (2^64-1) releases every wait
        g_mirrors[i] = g_mirrors.back();
        g_mirrors.pop_back();
      } else {
        ++i;
      }
    }
    if (!g_mirrors.empty()) {
      // The engine raises done words with a futex/ulock wake that cannot reach Metal; a
      // 50 us look while ops are pending costs little next to a ring of milliseconds.
      lk.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      lk.lock();
    }
  }
}

}  // namespace

extern "C" {

int mccl_metal_abi(void) { return MCCL_METAL_ABI; }
const char* mccl_metal_error(void) { return g_error.c_str(); }

int mccl_metal_open(const char* torch_lib) {
  void* lib = dlopen(torch_lib, RTLD_LAZY | RTLD_NOLOAD);
  if (!lib) return fail(std::string("[metal] ") + torch_lib + " is not loaded in this process (import torch first): " + dlerror());
  g_command_buffer = reinterpret_cast<GetPtr>(dlsym(lib, "_ZN5torch3mps18get_command_bufferEv"));
  g_dispatch_queue = reinterpret_cast<GetPtr>(dlsym(lib, "_ZN5torch3mps18get_dispatch_queueEv"));
  Commit commit = reinterpret_cast<Commit>(dlsym(lib, "_ZN5torch3mps6commitEv"));
  if (!g_command_buffer) return fail("[metal] torch::mps::get_command_buffer not found in " + std::string(torch_lib));
  if (!g_dispatch_queue) return fail("[metal] torch::mps::get_dispatch_queue not found in " + std::string(torch_lib));
  if (!commit) return fail("[metal] torch::mps::commit not found in " + std::string(torch_lib));
  g_device = MTLCreateSystemDefaultDevice();
  if (g_device == nil) return fail("[metal] MTLCreateSystemDefaultDevice returned nil (no Metal GPU)");
  if (g_listener == nil) {
    g_listener = [[MTLSharedEventListener alloc]
        initWithDispatchQueue:dispatch_queue_create("mccl.metal.listener", DISPATCH_QUEUE_SERIAL)];
  }
  g_commit = commit;  // last: on_torch_queue tests it
  return 0;
}

int mccl_metal_has_unified_memory(void) { return g_device != nil && g_device.hasUnifiedMemory ? 1 : 0; }

void* mccl_metal_event_new(void) {
  if (g_device == nil) return nullptr;
  return (__bridge_retained void*)[g_device newSharedEvent];
}

void mccl_metal_event_free(void* event) {
  if (event) CFRelease(event);
}

uint64_t mccl_metal_event_value(void* event) {
  return ((__bridge id<MTLSharedEvent>)event).signaledValue;
}

int mccl_metal_encode_signal(void* event, uint64_t value) {
  id<MTLSharedEvent> ev = (__bridge id<MTLSharedEvent>)event;
  return on_torch_queue("encode signal", ^(id<MTLCommandBuffer> cb) { [cb encodeSignalEvent:ev value:value]; });
}

int mccl_metal_encode_wait(void* event, uint64_t value) {
  id<MTLSharedEvent> ev = (__bridge id<MTLSharedEvent>)event;
  return on_torch_queue("encode wait", ^(id<MTLCommandBuffer> cb) { [cb encodeWaitForEvent:ev value:value]; });
}

int mccl_metal_encode_copy(void* src, uint64_t src_off, void* dst, uint64_t dst_off, uint64_t n) {
  id<MTLBuffer> s = (__bridge id<MTLBuffer>)src;
  id<MTLBuffer> d = (__bridge id<MTLBuffer>)dst;
  if (src_off + n > s.length || dst_off + n > d.length)
    return fail("[metal] blit out of bounds: " + std::to_string(n) + " bytes at " + std::to_string(src_off) + " of " +
                std::to_string(s.length) + " -> " + std::to_string(dst_off) + " of " + std::to_string(d.length));
  return on_torch_queue("encode copy", ^(id<MTLCommandBuffer> cb) {
    id<MTLBlitCommandEncoder> blit = [cb blitCommandEncoder];
    [blit copyFromBuffer:s sourceOffset:src_off toBuffer:d destinationOffset:dst_off size:n];
    [blit endEncoding];
  });
}

int mccl_metal_commit(void) {
  if (!g_commit) return fail("[metal] commit: mccl_metal_open was not called");
  dispatch_sync((__bridge dispatch_queue_t)g_dispatch_queue(), ^{ g_commit(); });
  return 0;
}

int mccl_metal_notify(void* event, uint64_t value, uint64_t* word, void (*wake)(void*)) {
  if (g_listener == nil) return fail("[metal] notify: mccl_metal_open was not called");
  id<MTLSharedEvent> ev = (__bridge id<MTLSharedEvent>)event;
  [ev notifyListener:g_listener
             atValue:value
               block:^(id<MTLSharedEvent>, uint64_t) {
                 uint64_t seen = __atomic_load_n(word, __ATOMIC_RELAXED);
                 while (seen < value &&
                        !__atomic_compare_exchange_n(word, &seen, value, true, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
                 }
                 if (wake) wake(word);
               }];
  return 0;
}

int mccl_metal_mirror(void* event, const uint64_t* word, uint64_t value) {
  std::lock_guard<std::mutex> lk(g_mirror_mu);
  if (!g_mirror_started) {
    std::thread(mirror_loop).detach();  // lives as long as the process, like Metal's own
    g_mirror_started = true;
  }
  g_mirrors.push_back(Mirror{(__bridge id<MTLSharedEvent>)event, word, value});
  g_mirror_cv.notify_one();
  return 0;
}

int mccl_metal_buffer_info(void* buffer, void** contents, uint64_t* length, int* storage_mode) {
  if (!buffer) return fail("[metal] buffer_info: null buffer");
  id<MTLBuffer> b = (__bridge id<MTLBuffer>)buffer;
  *storage_mode = static_cast<int>(b.storageMode);
  *length = b.length;
  *contents = b.storageMode == MTLStorageModePrivate ? nullptr : b.contents;
  return 0;
}

void* mccl_metal_wrap_host(void* ptr, uint64_t nbytes) {
  if (g_device == nil) return nullptr;
  id<MTLBuffer> b = [g_device newBufferWithBytesNoCopy:ptr
                                                length:nbytes
                                               options:MTLResourceStorageModeShared
                                           deallocator:nil];
  if (b == nil) {
    fail("[metal] newBufferWithBytesNoCopy refused " + std::to_string(nbytes) + " bytes (page-aligned address and length?)");
    return nullptr;
  }
  return (__bridge_retained void*)b;
}

void mccl_metal_buffer_free(void* buffer) {
  if (buffer) CFRelease(buffer);
}

}  // extern "C"
