#include "transport/link_acceptor.h"

#include <exception>
#include <list>
#include <memory>
#include <mutex>
#include <thread>

#include "core/errors.h"
#include "core/thread_name.h"
#include "transport/rejects.h"

namespace mccl {

namespace {

// A peer that connected but stays silent gives up its slot after this long.
constexpr auto kHandshakeBudget = std::chrono::seconds(10);
// How often the loop looks up from accept(): the last link landing on a handshake thread
// ends set-up at most this late.
constexpr auto kSlice = std::chrono::milliseconds(50);

struct Worker {
  std::thread thread;
  std::shared_ptr<std::atomic<bool>> done = std::make_shared<std::atomic<bool>>(false);
};

// What the handshake threads share with the loop, under `mu`.
struct Shared {
  std::mutex mu;
  MeshLinks* out = nullptr;
  std::vector<std::vector<bool>> reserved;  // a proved peer is being answered for this slot
  int accepted = 0;
  std::exception_ptr error;                  // a proved peer refused: set-up fails with it
};

std::string first_missing(const MeshSpec& spec, const MeshLinks& m, int* rank) {
  for (int r = 0; r < spec.rank; ++r) {
    for (int s = 0; s < spec.sockets_per_peer; ++s) {
      if (!m.links[r][s].valid()) {
        *rank = r;
        return "rank " + std::to_string(r) + " (" + spec.peer_addrs[r] + ")";
      }
    }
  }
  *rank = -1;
  return "?";
}

[[noreturn]] void throw_timeout(const MeshSpec& spec, const MeshLinks& m, const Rejects& rejects,
                                Clock::time_point started) {
  int missing_rank = -1;
  std::string missing = first_missing(spec, m, &missing_rank);
  const std::string addr = missing_rank >= 0 ? spec.peer_addrs[missing_rank] : "";
  const auto waited = std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - started);
  if (rejects.total() > 0) {
    // From here a peer with the wrong key and a stranger look alike: name both.
    throw_error(ErrorKind::kTimeout,
                "[transport] " + missing + " never proved the job key to rank " +
                    std::to_string(spec.rank) + " within " + std::to_string(waited.count()) +
                    " s; " + rejects.summary() +
                    ": the ranks hold different job keys (MCCL_JOB_KEY_FILE / fleet key), or a "
                    "stranger dialled",
                missing_rank, addr);
  }
  throw_error(ErrorKind::kTimeout,
              "[transport] Timed out building links: waiting for " + missing +
                  " to connect to this rank; likely cause: that rank did not start or cannot "
                  "reach " + spec.peer_addrs[spec.rank] +
                  "; check it runs and that the address is reachable (MCCL_BIND_ADDR)",
              missing_rank, addr);
}

void handshake_one(const MeshSpec& spec, const Hello& mine, const SignatureRules& rules, Fd fd,
                   const std::string& from, Deadline deadline, const std::atomic<bool>& quit,
                   Shared* sh, Rejects* rejects) {
  int held_r = -1, held_s = -1;  // the slot this handshake reserved, if any
  // Asked only once the peer proved the key; reserving here keeps a second proved
  // connection for the same slot (a duplicate process) from racing this one.
  auto seen = [&](uint32_t r, uint32_t s) {
    std::lock_guard<std::mutex> lk(sh->mu);
    if (sh->out->links[r][s].valid() || sh->reserved[r][s]) return true;
    sh->reserved[r][s] = true;
    held_r = static_cast<int>(r);
    held_s = static_cast<int>(s);
    return false;
  };
  try {
    Deadline hs = std::min(deadline, Clock::now() + kHandshakeBudget);
    std::string why;
    auto got = handshake_accept(fd.get(), mine, spec.secret, rules, hs, seen, &why, &quit);
    if (!got) {
      if (held_r >= 0) {
        std::lock_guard<std::mutex> lk(sh->mu);
        sh->reserved[held_r][held_s] = false;
      }
      if (!quit.load()) rejects->note(from, why);
      return;
    }
    configure_link_socket(fd.get(), spec.socket_buffer_bytes);
    set_nonblocking(fd.get(), true);
    std::lock_guard<std::mutex> lk(sh->mu);
    const uint32_t r = got->hello.from_rank, s = got->hello.sock_index;
    sh->out->links[r][s] = std::move(fd);
    if (!sh->out->keys.empty()) sh->out->keys[r][s] = got->keys;
    wipe(&got->keys, sizeof(got->keys));
    sh->reserved[r][s] = false;
    sh->accepted++;
  } catch (...) {
    std::lock_guard<std::mutex> lk(sh->mu);
    if (!sh->error) sh->error = std::current_exception();
  }
}

}  // namespace

void accept_lower_ranks(const MeshSpec& spec, const Hello& mine, const SignatureRules& rules,
                        int listen_fd, Deadline deadline, const std::atomic<bool>& stop,
                        MeshLinks* out) {
  const int needed = spec.rank * spec.sockets_per_peer;
  const auto started = Clock::now();
  Rejects rejects("[transport] rank " + std::to_string(spec.rank));
  Shared sh;
  sh.out = out;
  sh.reserved.assign(spec.rank, std::vector<bool>(spec.sockets_per_peer, false));
  std::atomic<bool> quit{false};
  std::list<Worker> workers;
  auto reap = [&](bool all) {
    for (auto it = workers.begin(); it != workers.end();) {
      if (all || it->done->load()) {
        it->thread.join();
        it = workers.erase(it);
      } else {
        ++it;
      }
    }
  };
  try {
    while (!stop.load()) {
      {
        std::lock_guard<std::mutex> lk(sh.mu);
        if (sh.error) std::rethrow_exception(sh.error);
        if (sh.accepted == needed) break;
        if (Clock::now() >= deadline) throw_timeout(spec, *out, rejects, started);
      }
      reap(false);
      Fd fd = accept_tcp(listen_fd, std::min(deadline, Clock::now() + kSlice));
      if (!fd.valid()) continue;
      const std::string from = remote_address(fd.get());  // before the peer can hang up
      if (static_cast<int>(workers.size()) >= kMaxPendingHandshakes) {
        rejects.note(from, "came while " + std::to_string(kMaxPendingHandshakes) +
                               " handshakes were pending (a flood of connections?)");
        continue;
      }
      workers.emplace_back();
      Worker& w = workers.back();
      w.thread = std::thread([&, fd = std::move(fd), from, done = w.done]() mutable {
        name_this_thread("mccl-handshake");
        handshake_one(spec, mine, rules, std::move(fd), from, deadline, quit, &sh, &rejects);
        done->store(true);
      });
    }
  } catch (...) {
    quit.store(true);
    reap(true);
    throw;
  }
  // Strangers still talking get cut off; a late error of a proved peer still counts.
  quit.store(true);
  reap(true);
  if (sh.error && sh.accepted < needed && !stop.load()) std::rethrow_exception(sh.error);
}

}  // namespace mccl
