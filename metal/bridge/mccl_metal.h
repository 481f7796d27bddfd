// The Metal bridge's C ABI: the only code of MCCL that speaks Objective-C, kept to the
// calls that need Metal. Every decision (which tensors reduce in place, which stage, what
// a missing piece means, when a ticket is raised) lives in libmccl/devices/metal_ops.py and
// libmccl/devices/metal_tensors.py, which run on Linux too, against a fake of this ABI.
//
// Threads: the encode_* and commit calls run on the thread torch called us on (O3); they
// enqueue on torch's own MPS dispatch queue and command buffer, found at run time in
// libtorch_cpu, so this library does not link against torch. notify/mirror callbacks
// run on Metal's listener queue and on one bridge thread; they touch only memory.
//
// Every call returns 0 on success; on failure, non-zero and mccl_metal_error() names
// what failed on this thread.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MCCL_METAL_ABI 1

// Storage modes as MTLStorageMode numbers (Shared 0, Managed 1, Private 2, Memoryless 3).
enum { MCCL_METAL_SHARED = 0, MCCL_METAL_PRIVATE = 2 };

int mccl_metal_abi(void);
const char* mccl_metal_error(void);

// Finds torch's MPS entry points (torch::mps::get_command_buffer, get_dispatch_queue,
// commit) in `torch_lib` (the path of torch's libtorch_cpu, already loaded by `import
// torch`) and the system's default Metal device.
int mccl_metal_open(const char* torch_lib);
int mccl_metal_has_unified_memory(void);

// One MTLSharedEvent per ticket, never shared or reused: a reused event's earlier value
// could satisfy a later op (the public MCCL's shared-counter bug).
void* mccl_metal_event_new(void);
void mccl_metal_event_free(void* event);
uint64_t mccl_metal_event_value(void* event);

// O1 / O2: end torch's open encoder (torch's commit), then encode into torch's command
// buffer a signal of (a wait for) `event` at `value`. Nothing runs until mccl_metal_commit.
int mccl_metal_encode_signal(void* event, uint64_t value);
int mccl_metal_encode_wait(void* event, uint64_t value);
// A blit of `n` bytes between two MTLBuffers, into torch's command buffer.
int mccl_metal_encode_copy(void* src, uint64_t src_off, void* dst, uint64_t dst_off, uint64_t n);
// torch::mps::commit() on torch's queue.
int mccl_metal_commit(void);

// Once `event` reaches `value`, raise the 64-bit word at `word` to `value` (atomic max:
// a poisoned word stays poisoned) and call wake(word) (the engine's mccl_ticket_wake).
int mccl_metal_notify(void* event, uint64_t value, uint64_t* word, void (*wake)(void*));
// Once the word at `word` holds >= `value` (or the poison 2^64-1), set `event`'s
// signaledValue to the word's value, releasing GPU waits at or below it. Served by one
// bridge thread that sleeps when nothing is pending.
int mccl_metal_mirror(void* event, const uint64_t* word, uint64_t value);

// The CPU address (null for private storage), length and storage mode of the MTLBuffer
// `buffer` (torch's MPS storage pointer is its id<MTLBuffer>).
int mccl_metal_buffer_info(void* buffer, void** contents, uint64_t* length, int* storage_mode);
// An MTLBuffer over page-aligned host memory, no copy: staging buffers and mccld's
// shared-memory segments, so blits write where the engine reads.
void* mccl_metal_wrap_host(void* ptr, uint64_t nbytes);
void mccl_metal_buffer_free(void* buffer);

#ifdef __cplusplus
}
#endif
