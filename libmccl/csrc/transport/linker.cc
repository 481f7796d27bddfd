#include "transport/linker.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/errors.h"
#include "core/log.h"
#include "core/thread_name.h"

namespace mccl {

namespace {

// A real peer writes its hello right after connect() and its proof as soon as the
// challenge arrives: a stranger's silent connection is closed after these.
constexpr auto kHelloBudget = std::chrono::seconds(2);
constexpr auto kProofBudget = std::chrono::seconds(2);
// A connection whose proof is due is dropped for room only after this (see linker.h): a
// real dialer answers the challenge within a round trip.
constexpr auto kProofGrace = std::chrono::milliseconds(500);
// The verdict to a peer that proved the key: a few dozen bytes into an empty send buffer.
constexpr auto kVerdictBudget = std::chrono::seconds(2);
// How often the acceptor looks up from poll() to notice stop(): the longest stop() waits.
constexpr auto kSlice = std::chrono::milliseconds(100);
// Connections accepted in one turn of the acceptor's loop, so reads are not starved.
constexpr int kAcceptBatch = 64;
// A dial the peer closed before its challenge is tried again after this, doubling.
constexpr auto kRedialFirst = std::chrono::milliseconds(10);
constexpr auto kRedialMax = std::chrono::milliseconds(500);

std::string host_of(const std::string& addr) {
  if (!addr.empty() && addr[0] == '[') return addr.substr(0, addr.find(']') + 1);
  return addr.substr(0, addr.rfind(':'));
}

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
  int closed_early = 0;
  for (int s = 0; s < k; ++s) {
    FrameKeys got{};
    Fd fd;
    auto backoff = std::chrono::milliseconds(kRedialFirst);
    while (true) {
      fd = connect_tcp(hp, deadline, peer, &stop_);
      if (!fd.valid()) return;  // stopping
      bool declined = false;
      bool closed = false;
      if (handshake_dial(fd.get(), hello(peer, s), spec_.secret, hp.str(), deadline, &stop_,
                         &got, &declined, &closed)) {
        break;
      }
      // Declined: the lower rank is dialing us; its link lands at our acceptor, which
      // moved this peer out of kDialing when it took that link's first socket.
      if (!closed) return;
      // Closed before its challenge: its listener dropped us for room (a flood of
      // connections) or it is going away. Dial again until the deadline.
      fd.reset();
      ++closed_early;
      {
        std::lock_guard<std::mutex> lk(mu_);
        peers_[peer].closed_early++;
      }
      if (Clock::now() + backoff >= deadline) {
        throw_error(ErrorKind::kTimeout,
                    "[transport] peer=" + hp.str() + " (rank " + std::to_string(peer) +
                        ") closed our handshake " + std::to_string(closed_early) +
                        " time(s) before answering, until the link timeout (" +
                        std::to_string(static_cast<int>(link_timeout_s_)) +
                        " s) passed; likely cause: its listener was full of other "
                        "connections (a connection flood from a host without the job key: see "
                        "that rank's log for the source) or that rank is shutting down",
                    peer, hp.str());
      }
      for (auto slept = std::chrono::milliseconds(0); slept < backoff && !stop_.load();
           slept += std::chrono::milliseconds(10)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (stop_.load()) return;
      backoff = std::min(backoff * 2, std::chrono::milliseconds(kRedialMax));
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

struct Linker::Unproved {
  Fd fd;
  std::string from;  // "host:port"
  std::string host;
  Clock::time_point since;
  Clock::time_point due;         // the hello's or the proof's deadline
  bool proving = false;          // the challenge went out: reading the proof
  size_t got = 0;
  uint8_t buf[AcceptSteps::kHelloBytes] = {};
  std::unique_ptr<AcceptSteps> steps;
  bool done = false;             // finished or dropped: removed at the end of the turn
};

void Linker::drop_for_room(const std::string& host, const std::string& from) {
  uint64_t n = ++dropped_for_room_[host];
  if (dropped_for_room_.size() > 256) dropped_for_room_.erase(dropped_for_room_.begin());
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++dropped_for_room_total_;
  }
  if (n == 1) {
    // Once per host: a flood would otherwise write a line per connection.
    log_line(LogLevel::kWarning,
             "[transport] rank " + std::to_string(spec_.rank) + " dropped a connection from " +
                 from + " that had not proved the job key, to make room: more than " +
                 std::to_string(kMaxUnprovedPerHost) + " from its host or " +
                 std::to_string(kMaxUnproved) +
                 " in all were waiting for their handshake; likely a flood of connections from "
                 "a host without the job key (further drops from this host are not logged)");
  }
}

bool Linker::make_room(std::list<Unproved>* unproved, const std::string& host, bool any_host) {
  // The victim: the oldest droppable connection of `host`, or (any_host) of the busiest
  // host. A connection whose proof is due is droppable only once past kProofGrace.
  const auto now = Clock::now();
  std::map<std::string, int> per_host;
  if (any_host) {
    for (auto& u : *unproved) {
      if (!u.done) per_host[u.host]++;
    }
  }
  auto droppable = [&](const Unproved& u) {
    return !u.done && (!u.proving || now - u.since >= kProofGrace);
  };
  // The busiest host first; then one that never sent a hello before one that did (a real
  // peer sends its hello at once); then the oldest (the list is in order of arrival).
  std::list<Unproved>::iterator victim = unproved->end();
  int victim_load = -1;
  bool victim_proving = true;
  for (auto it = unproved->begin(); it != unproved->end(); ++it) {
    if (!droppable(*it)) continue;
    if (!any_host && it->host != host) continue;
    const int load = any_host ? per_host[it->host] : 0;
    if (load > victim_load || (load == victim_load && victim_proving && !it->proving)) {
      victim = it;
      victim_load = load;
      victim_proving = it->proving;
    }
  }
  if (victim == unproved->end()) return false;
  drop_for_room(victim->host, victim->from);
  victim->fd.reset();
  victim->done = true;
  return true;
}

void Linker::accept_new(std::list<Unproved>* unproved) {
  for (int i = 0; i < kAcceptBatch; ++i) {
    int live = 0;
    for (auto& u : *unproved) live += !u.done;
    if (live >= kMaxUnproved && !make_room(unproved, "", true)) return;  // left in the backlog
    int raw = ::accept(listen_fd_.get(), nullptr, nullptr);
    if (raw < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EMFILE || errno == ENFILE) {
        // Out of file descriptors: free one held by a stranger, if any, and try later.
        if (!make_room(unproved, "", true)) {
          throw_error(ErrorKind::kGeneric,
                      std::string("[transport] accept failed: ") + std::strerror(errno) +
                          "; out of file descriptors; raise ulimit -n");
        }
        continue;
      }
      throw_error(ErrorKind::kGeneric,
                  std::string("[transport] accept failed: ") + std::strerror(errno));
    }
    Fd fd(raw);
    ::fcntl(raw, F_SETFD, FD_CLOEXEC);
    set_nonblocking(raw, true);
    Unproved u;
    u.from = remote_address(raw);  // before the peer can hang up
    u.host = host_of(u.from);
    int from_host = 0;
    for (auto& o : *unproved) from_host += !o.done && o.host == u.host;
    if (from_host >= kMaxUnprovedPerHost && !make_room(unproved, u.host, false)) {
      // Every one of that host's connections is a proof still in its grace: this host
      // floods us. Refuse the newest; a real dialer dials again.
      drop_for_room(u.host, u.from);
      continue;
    }
    u.fd = std::move(fd);
    u.since = Clock::now();
    u.due = u.since + kHelloBudget;
    u.steps = std::make_unique<AcceptSteps>(hello(spec_.rank, 0), spec_.secret, rules_of(spec_));
    unproved->push_back(std::move(u));
  }
}

void Linker::read_some(Unproved* u) {
  const size_t want = u->proving ? AcceptSteps::kProofBytes : AcceptSteps::kHelloBytes;
  // Only what this step needs: anything after it stays in the socket.
  ssize_t r = ::recv(u->fd.get(), u->buf + u->got, want - u->got, 0);
  if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return;
  if (r <= 0) {
    rejects_.note(u->from, u->proving ? "closed the link before its proof of the job key"
                                      : "closed the link before a complete MCCL hello");
    u->done = true;
    return;
  }
  u->got += static_cast<size_t>(r);
  if (u->got < want) return;
  if (u->proving) {
    finish(u);
    return;
  }
  std::string why;
  const std::string answer = u->steps->on_hello(u->buf, &why);
  // Into an empty send buffer: a few dozen bytes always fit at once.
  const bool sent = !answer.empty() &&
                    ::send(u->fd.get(), answer.data(), answer.size(), nosignal_flag()) ==
                        static_cast<ssize_t>(answer.size());
  if (!why.empty() || !sent) {
    rejects_.note(u->from, why.empty() ? "closed the link before the challenge" : why);
    u->done = true;
    return;
  }
  u->proving = true;
  u->got = 0;
  u->due = Clock::now() + kProofBudget;
}

void Linker::accept_main() {
  std::list<Unproved> unproved;
  set_nonblocking(listen_fd_.get(), true);
  std::vector<pollfd> pfds;
  while (!stop_.load()) {
    const auto now = Clock::now();
    auto wake = now + kSlice;
    int live = 0;
    bool room_later = false;  // a proof past its grace can be dropped for room
    for (auto& u : unproved) {
      if (u.done) continue;
      if (now >= u.due) {
        rejects_.note(u.from, u.proving ? "sent no proof of the job key in time"
                                        : "sent no complete MCCL hello in time");
        u.fd.reset();
        u.done = true;
        continue;
      }
      ++live;
      wake = std::min(wake, u.due);
      if (u.proving) {
        if (now - u.since >= kProofGrace) room_later = true;
        else wake = std::min(wake, u.since + kProofGrace);
      } else {
        room_later = true;
      }
    }
    unproved.remove_if([](const Unproved& u) { return u.done; });
    const bool listening = live < kMaxUnproved || room_later;
    pfds.clear();
    if (listening) pfds.push_back({listen_fd_.get(), POLLIN, 0});
    for (auto& u : unproved) pfds.push_back({u.fd.get(), POLLIN, 0});
    const int ms = std::max<int>(
        1, static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                wake - Clock::now()).count()) + 1);
    int pr = ::poll(pfds.data(), pfds.size(), ms);
    if (pr < 0 && errno != EINTR) {
      std::lock_guard<std::mutex> lk(mu_);
      error_.set(Error(ErrorKind::kGeneric,
                       std::string("[transport] poll failed: ") + std::strerror(errno)));
      break;
    }
    if (pr <= 0) continue;
    size_t i = 0;
    if (listening) {
      if (pfds[0].revents) {
        try {
          accept_new(&unproved);
        } catch (const Error& e) {
          {
            std::lock_guard<std::mutex> lk(mu_);
            error_.set(e);
          }
          fire();
          break;  // no later link could be accepted either
        }
      }
      i = 1;
    }
    // The connections accepted just now were not polled: they come next turn.
    for (auto it = unproved.begin(); it != unproved.end() && i < pfds.size(); ++it, ++i) {
      if (it->done || it->fd.get() != pfds[i].fd || !pfds[i].revents) continue;
      read_some(&*it);
    }
  }
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

void Linker::finish(Unproved* u) {
  u->done = true;
  Fd fd = std::move(u->fd);
  int held = -1;
  uint32_t held_from = 0;
  auto slot = [&](uint32_t r, uint32_t s) {
    std::lock_guard<std::mutex> lk(mu_);
    held_from = r;
    return claim_slot(r, s, &held);
  };
  auto slot_fn = [](void* c, uint32_t r, uint32_t s) {
    return (*static_cast<decltype(slot)*>(c))(r, s);
  };
  try {
    std::string why;
    auto got = u->steps->on_proof(fd.get(), u->buf, Clock::now() + kVerdictBudget, slot_fn, &slot,
                                  &why, &stop_);
    if (!got) {
      if (held >= 0) {
        std::lock_guard<std::mutex> lk(mu_);
        peers_[held_from].reserved[held] = false;
      }
      if (!stop_.load() && why != kDeclinedWhy) rejects_.note(u->from, why);
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
  const int closed_early = peers_[r].closed_early;
  const uint64_t dropped_for_room = dropped_for_room_total_;
  lk.unlock();
  if (dialing && closed_early > 0) {
    throw_error(ErrorKind::kTimeout,
                "[transport] peer=" + addr + " (rank " + std::to_string(r) +
                    ") closed our handshake " + std::to_string(closed_early) +
                    " time(s) before answering, until the set-up timeout passed; likely cause: "
                    "its listener was full of other connections (a connection flood from a "
                    "host without the job key: see that rank's log for the source)",
                r, addr);
  }
  const auto waited = std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - started);
  if (rejects_.total() > 0 || dropped_for_room > 0) {
    // From here a peer with the wrong key and a stranger look alike: name both.
    const std::string flood =
        dropped_for_room > 0 ? std::to_string(dropped_for_room) +
                                   " unproved connection(s) dropped to make room (a flood of "
                                   "connections?)"
                             : std::string();
    const std::string rejected = rejects_.summary();
    throw_error(ErrorKind::kTimeout,
                "[transport] " + who + " never proved the job key to rank " +
                    std::to_string(spec_.rank) + " within " + std::to_string(waited.count()) +
                    " s; " + rejected + (rejected.empty() || flood.empty() ? "" : "; ") + flood +
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
  if (acceptor_.joinable()) acceptor_.join();  // closes the unproved connections too
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
