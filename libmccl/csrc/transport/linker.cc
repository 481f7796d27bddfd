#include "transport/linker.h"

#include <algorithm>

#include "core/errors.h"
#include "core/thread_name.h"

namespace mccl {

namespace {

// A peer that connected but stays silent gives up its handshake slot after this long.
constexpr auto kHandshakeBudget = std::chrono::seconds(10);
// How often the acceptor looks up from accept() to notice stop(): the longest stop() waits.
constexpr auto kSlice = std::chrono::milliseconds(100);

const SignatureRules& rules_of(const MeshSpec& spec) {
  static const OpaqueSignatureRules opaque;
  return spec.rules ? *spec.rules : opaque;
}

}  // namespace

Linker::Linker(MeshSpec spec, Fd listen_fd, double link_timeout_s)
    : spec_(std::move(spec)),
      listen_fd_(std::move(listen_fd)),
      link_timeout_s_(link_timeout_s),
      rejects_("[transport] rank " + std::to_string(spec_.rank)) {
  peers_.resize(spec_.size);
  for (int r = 0; r < spec_.size; ++r) {
    if (r == spec_.rank) continue;
    const size_t k = sockets_for(spec_.rank, r, spec_.size, spec_.sockets_per_peer);
    peers_[r].fds.resize(k);
    peers_[r].reserved.assign(k, false);
    if (spec_.wire_security != 0) peers_[r].keys.resize(k);
  }
  acceptor_ = std::thread([this] {
    name_this_thread("mccl-accept");
    accept_main();
  });
}

Linker::~Linker() { stop(); }

int Linker::sockets_for(int a, int b, int size, int sockets_per_peer) {
  const int d = a > b ? a - b : b - a;
  return d == 1 || d == size - 1 ? sockets_per_peer : 1;
}

void Linker::on_event(std::function<void()> fn) {
  std::lock_guard<std::mutex> lk(mu_);
  on_event_ = std::move(fn);
}

void Linker::fire() {
  std::function<void()> fn;
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn = on_event_;
  }
  cv_.notify_all();
  if (fn) fn();
}

Hello Linker::hello(int to_rank, int sock_index) const {
  Hello h;
  h.comm_id = spec_.comm_id;
  h.from_rank = static_cast<uint32_t>(spec_.rank);
  h.to_rank = static_cast<uint32_t>(to_rank);
  h.world = static_cast<uint32_t>(spec_.size);
  h.sock_index = static_cast<uint32_t>(sock_index);
  // The configured K, checked equal on both sides; the link's own count is sockets_for.
  h.socks_per_peer = static_cast<uint32_t>(spec_.sockets_per_peer);
  h.terms = spec_.terms;
  h.wire_security = spec_.wire_security;
  return h;
}

void Linker::ready_locked(int peer, std::vector<Fd> fds, std::vector<FrameKeys> keys) {
  peers_[peer].dialed = peers_[peer].state == State::kDialing;
  peers_[peer].state = State::kUp;
  NewLink link;
  link.peer = peer;
  link.fds = std::move(fds);
  link.keys = std::move(keys);
  ready_.push_back(std::move(link));
}

// ---------------------------------------------------------------- dialing

void Linker::want(int peer) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_.load() || peers_[peer].state != State::kNone) return;
    peers_[peer].state = State::kDialing;
    dial_queue_.push_back(peer);
    if (dialers_ >= kMaxDialers) return;  // a running dialer takes it up next
    ++dialers_;
    start_helper(&dialer_threads_, "mccl-dial", [this] { dial_main(); });
  }
}

void Linker::dial_main() {
  while (true) {
    int peer;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (dial_queue_.empty() || stop_.load()) {
        --dialers_;
        return;
      }
      peer = dial_queue_.front();
      dial_queue_.pop_front();
    }
    try {
      dial_one(peer);
    } catch (const Error& e) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        // The peer's own dial may have won meanwhile: then ours failing does not matter.
        if (peers_[peer].state == State::kDialing) error_.set(e);
      }
      fire();
    }
  }
}

void Linker::dial_one(int peer) {
  const Deadline deadline = deadline_after(link_timeout_s_);
  const int k = sockets_for(spec_.rank, peer, spec_.size, spec_.sockets_per_peer);
  HostPort hp = parse_host_port(spec_.peer_addrs[peer], "rank " + std::to_string(peer));
  std::vector<Fd> fds(k);
  std::vector<FrameKeys> keys(spec_.wire_security != 0 ? k : 0);
  for (int s = 0; s < k; ++s) {
    Fd fd = connect_tcp(hp, deadline, peer, &stop_);
    if (!fd.valid()) return;  // stopping
    FrameKeys got{};
    bool declined = false;
    if (!handshake_dial(fd.get(), hello(peer, s), spec_.secret, hp.str(), deadline, &stop_, &got,
                        &declined)) {
      // Declined: the lower rank is dialing us; its link lands at our acceptor, which
      // moved this peer out of kDialing when it took that link's first socket.
      return;
    }
    configure_link_socket(fd.get(), spec_.socket_buffer_bytes);
    set_nonblocking(fd.get(), true);
    fds[s] = std::move(fd);
    if (!keys.empty()) keys[s] = got;
    wipe(&got, sizeof(got));
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (peers_[peer].state != State::kDialing) return;  // cannot happen: the acceptor took
    ready_locked(peer, std::move(fds), keys);           // over only after declining us
  }
  wipe(keys.data(), keys.size() * sizeof(FrameKeys));
  fire();
}

// ---------------------------------------------------------------- accepting

void Linker::accept_main() {
  while (!stop_.load()) {
    reap_helpers(&handshakes_, false);
    Fd fd;
    try {
      fd = accept_tcp(listen_fd_.get(), Clock::now() + kSlice);
    } catch (const Error& e) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        error_.set(e);
      }
      fire();
      break;  // out of file descriptors: no later link could be accepted either
    }
    if (!fd.valid()) continue;
    const std::string from = remote_address(fd.get());  // before the peer can hang up
    if (static_cast<int>(handshakes_.size()) >= kMaxPendingHandshakes) {
      rejects_.note(from, "came while " + std::to_string(kMaxPendingHandshakes) +
                              " handshakes were pending (a flood of connections?)");
      continue;
    }
    start_helper(&handshakes_, "mccl-handshake",
                 [this, fd = std::move(fd), from]() mutable { handshake_one(std::move(fd), from); });
  }
  reap_helpers(&handshakes_, true);
}

int Linker::claim_slot(uint32_t from, uint32_t sock, int* held) {
  const int r = static_cast<int>(from);
  if (r < 0 || r >= spec_.size || r == spec_.rank) return kSlotDuplicate;
  Peer& p = peers_[r];
  if (sock >= p.fds.size()) return kSlotDuplicate;  // more sockets than this link has
  switch (p.state) {
    case State::kUp:
      // Our dial won and finished before the peer's own dial reached us: decline it too.
      return p.dialed && r > spec_.rank ? kSlotDecline : kSlotDuplicate;
    case State::kDialing:
      // Both dial: the lower rank's dial wins. Ours is declined at the peer.
      if (r > spec_.rank) return kSlotDecline;
      p.state = State::kAccepting;
      break;
    case State::kNone:
      p.state = State::kAccepting;
      break;
    case State::kAccepting:
      break;
  }
  if (p.fds[sock].valid() || p.reserved[sock]) return kSlotDuplicate;
  p.reserved[sock] = true;
  *held = static_cast<int>(sock);
  return kSlotTake;
}

void Linker::handshake_one(Fd fd, const std::string& from) {
  int held = -1;
  uint32_t held_from = 0;
  auto slot = [&](uint32_t r, uint32_t s) {
    std::lock_guard<std::mutex> lk(mu_);
    held_from = r;
    return claim_slot(r, s, &held);
  };
  Hello mine = hello(spec_.rank, 0);
  try {
    const Deadline hs = Clock::now() + kHandshakeBudget;
    std::string why;
    auto got = handshake_accept(fd.get(), mine, spec_.secret, rules_of(spec_), hs, slot, &why,
                                &stop_);
    if (!got) {
      if (held >= 0) {
        std::lock_guard<std::mutex> lk(mu_);
        peers_[held_from].reserved[held] = false;
      }
      if (!stop_.load() && why != kDeclinedWhy) rejects_.note(from, why);
      return;
    }
    configure_link_socket(fd.get(), spec_.socket_buffer_bytes);
    set_nonblocking(fd.get(), true);
    bool whole = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      const int r = static_cast<int>(got->hello.from_rank);
      Peer& p = peers_[r];
      const uint32_t s = got->hello.sock_index;
      p.fds[s] = std::move(fd);
      if (!p.keys.empty()) p.keys[s] = got->keys;
      p.reserved[s] = false;
      whole = std::all_of(p.fds.begin(), p.fds.end(), [](const Fd& f) { return f.valid(); });
      if (whole) {
        std::vector<FrameKeys> keys = p.keys;
        ready_locked(r, std::move(p.fds), keys);
        wipe(keys.data(), keys.size() * sizeof(FrameKeys));
        wipe(p.keys.data(), p.keys.size() * sizeof(FrameKeys));
      }
    }
    wipe(&got->keys, sizeof(got->keys));
    if (whole) fire();
  } catch (const Error& e) {
    // A proved peer refused (options differ, a duplicate rank): the job cannot work.
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (held >= 0) peers_[held_from].reserved[held] = false;
      error_.set(e);
    }
    fire();
  }
}

// ---------------------------------------------------------------- the transport's side

MeshLinks Linker::wait_for(const std::vector<int>& peers, Deadline deadline,
                           const std::atomic<bool>* cancel) {
  const auto started = Clock::now();
  MeshLinks mesh;
  mesh.links.resize(spec_.size);
  if (spec_.wire_security != 0) mesh.keys.resize(spec_.size);
  std::vector<bool> need(spec_.size, false);
  for (int p : peers) need[p] = true;
  size_t missing = peers.size();
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    for (auto it = ready_.begin(); it != ready_.end();) {
      if (need[it->peer]) {
        need[it->peer] = false;
        --missing;
        mesh.links[it->peer] = std::move(it->fds);
        if (!mesh.keys.empty()) mesh.keys[it->peer] = it->keys;
        wipe(it->keys.data(), it->keys.size() * sizeof(FrameKeys));
        it = ready_.erase(it);
      } else {
        ++it;
      }
    }
    if (missing == 0) return mesh;
    if (error_.failed()) error_.throw_taken();
    if (cancel && cancel->load()) {
      throw_error(ErrorKind::kAborted, "[transport] building the links of rank " +
                                           std::to_string(spec_.rank) + " was interrupted");
    }
    if (Clock::now() >= deadline) break;
    cv_.wait_until(lk, std::min(deadline, Clock::now() + std::chrono::milliseconds(100)));
  }
  int r = 0;
  while (!need[r]) ++r;
  const std::string addr = spec_.peer_addrs[r];
  const std::string who = "rank " + std::to_string(r) + " (" + addr + ")";
  const bool dialing = peers_[r].state == State::kDialing;
  lk.unlock();
  const auto waited = std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - started);
  if (rejects_.total() > 0) {
    // From here a peer with the wrong key and a stranger look alike: name both.
    throw_error(ErrorKind::kTimeout,
                "[transport] " + who + " never proved the job key to rank " +
                    std::to_string(spec_.rank) + " within " + std::to_string(waited.count()) +
                    " s; " + rejects_.summary() +
                    ": the ranks hold different job keys (MCCL_JOB_KEY_FILE / fleet key), or a "
                    "stranger dialled",
                r, addr);
  }
  throw_error(ErrorKind::kTimeout,
              "[transport] Timed out building links: " +
                  (dialing ? "dialing " + who + ", which did not answer"
                           : "waiting for " + who + " to connect to this rank") +
                  "; likely cause: that rank did not start or cannot reach " +
                  spec_.peer_addrs[spec_.rank] +
                  "; check it runs and that the address is reachable (MCCL_BIND_ADDR)",
              r, addr);
}

void Linker::take_ready(std::vector<NewLink>* out) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& l : ready_) out->push_back(std::move(l));
  ready_.clear();
}

std::shared_ptr<const Error> Linker::take_error() {
  std::lock_guard<std::mutex> lk(mu_);
  return error_.take();
}

bool Linker::linking(int peer) const {
  std::lock_guard<std::mutex> lk(mu_);
  return peers_[peer].state == State::kDialing || peers_[peer].state == State::kAccepting;
}

void Linker::stop() {
  std::lock_guard<std::mutex> guard(stop_mu_);
  if (stopped_) return;
  stopped_ = true;
  stop_.store(true);
  if (acceptor_.joinable()) acceptor_.join();  // joins the handshakes too
  HelperThreads dialers;
  {
    std::lock_guard<std::mutex> lk(mu_);
    dialers.swap(dialer_threads_);
    dial_queue_.clear();
  }
  reap_helpers(&dialers, true);
  listen_fd_.reset();
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& l : ready_) wipe(l.keys.data(), l.keys.size() * sizeof(FrameKeys));
  ready_.clear();
  for (auto& p : peers_) {
    for (auto& fd : p.fds) fd.reset();
    wipe(p.keys.data(), p.keys.size() * sizeof(FrameKeys));
  }
}

}  // namespace mccl
