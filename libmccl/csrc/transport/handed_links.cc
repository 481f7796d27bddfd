#include "transport/handed_links.h"

#include "core/thread_name.h"

namespace mccl {

HandedLinks::HandedLinks(MeshSpec spec, Ask ask, double link_timeout_s)
    : spec_(std::move(spec)), ask_(std::move(ask)), link_timeout_s_(link_timeout_s) {
  state_.assign(spec_.size, State::kNone);
}

HandedLinks::~HandedLinks() { stop(); }

void HandedLinks::linked(int peer) {
  std::lock_guard<std::mutex> lk(mu_);
  if (peer >= 0 && peer < spec_.size) state_[peer] = State::kUp;
}

void HandedLinks::on_event(std::function<void()> fn) {
  std::lock_guard<std::mutex> lk(mu_);
  on_event_ = std::move(fn);
}

void HandedLinks::fire() {
  std::function<void()> fn;
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn = on_event_;
  }
  if (fn) fn();
}

void HandedLinks::fail_locked(const Error& e) {
  error_.set(e);
}

// ---------------------------------------------------------------- asking the owner

void HandedLinks::want(int peer) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_.load() || peer < 0 || peer >= spec_.size || state_[peer] != State::kNone) return;
  state_[peer] = State::kAsked;
  asks_.push_back(peer);
  if (!asker_running_) {
    // Started at the first want, so a communicator that never needs one has no extra thread.
    asker_running_ = true;
    asker_ = std::thread([this] {
      name_this_thread("mccl-ask");
      ask_main();
    });
  }
  ask_cv_.notify_one();
}

void HandedLinks::ask_main() {
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    ask_cv_.wait(lk, [&] { return stop_.load() || !asks_.empty(); });
    if (stop_.load()) return;
    const int peer = asks_.front();
    asks_.pop_front();
    lk.unlock();
    try {
      ask_(peer);
    } catch (const Error& e) {
      lk.lock();
      fail_locked(e);
      lk.unlock();
      fire();
    } catch (const std::exception& e) {
      lk.lock();
      fail_locked(Error(ErrorKind::kGeneric,
                        "[transport] asking for a link to peer=" + spec_.peer_addrs[peer] +
                            " (rank " + std::to_string(peer) + ") failed: " + e.what(),
                        peer, spec_.peer_addrs[peer]));
      lk.unlock();
      fire();
    }
    lk.lock();
  }
}

// ---------------------------------------------------------------- the owner's answers

void HandedLinks::hand_in(int peer, const std::vector<int>& fds) {
  // Checked and dup()ed on the caller's thread: a bad list is the caller's error.
  std::vector<Fd> dups = dup_link(spec_, peer, fds);
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_.load()) {
    throw_error(ErrorKind::kAborted, "[transport] sockets handed in for rank " +
                                         std::to_string(peer) +
                                         " after the communicator stopped linking");
  }
  if (state_[peer] != State::kNone && state_[peer] != State::kAsked) {
    throw_error(ErrorKind::kConfig, "[transport] sockets handed in twice for peer=" +
                                        spec_.peer_addrs[peer] + " (rank " +
                                        std::to_string(peer) + "); hand each peer's in once",
                peer, spec_.peer_addrs[peer]);
  }
  state_[peer] = State::kProving;
  start_helper(&provers_, "mccl-handshake",
               [this, peer, dups = std::move(dups)]() mutable { prove(peer, std::move(dups)); });
}

void HandedLinks::prove(int peer, std::vector<Fd> fds) {
  try {
    NewLink link = prove_link(spec_, peer, std::move(fds), deadline_after(link_timeout_s_), &stop_);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_.load()) {
        wipe(link.keys.data(), link.keys.size() * sizeof(FrameKeys));
        return;  // closed with `link`
      }
      state_[peer] = State::kReady;
      ready_.push_back(std::move(link));
    }
  } catch (const Error& e) {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_.load()) return;
    fail_locked(e);
  }
  fire();
}

void HandedLinks::refuse(int peer, ErrorKind kind, const std::string& message) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_.load()) return;
    const bool in_range = peer >= 0 && peer < spec_.size;
    if (in_range && state_[peer] == State::kUp) return;  // linked after all: nothing failed
    fail_locked(Error(kind, message, in_range ? peer : -1,
                      in_range ? spec_.peer_addrs[peer] : std::string()));
  }
  fire();
}

// ---------------------------------------------------------------- the transport's side

void HandedLinks::take_ready(std::vector<NewLink>* out) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& l : ready_) {
    state_[l.peer] = State::kUp;
    out->push_back(std::move(l));
  }
  ready_.clear();
}

std::shared_ptr<const Error> HandedLinks::take_error() {
  std::lock_guard<std::mutex> lk(mu_);
  return error_.take();
}

bool HandedLinks::linking(int peer) const {
  std::lock_guard<std::mutex> lk(mu_);
  return peer >= 0 && peer < spec_.size && state_[peer] != State::kNone &&
         state_[peer] != State::kUp;
}

bool HandedLinks::settled() const {
  std::lock_guard<std::mutex> lk(mu_);
  for (State s : state_) {
    if (s == State::kProving || s == State::kReady) return false;
  }
  return !error_.failed();
}

void HandedLinks::stop() {
  std::lock_guard<std::mutex> guard(stop_mu_);
  if (stopped_) return;
  stopped_ = true;
  HelperThreads provers;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
    asks_.clear();
    provers.swap(provers_);
  }
  ask_cv_.notify_all();
  if (asker_.joinable()) asker_.join();  // an ask_ in progress returns at once (its contract)
  reap_helpers(&provers, true);                  // the handshakes look at stop_ every ~0.2 s
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& l : ready_) wipe(l.keys.data(), l.keys.size() * sizeof(FrameKeys));
  ready_.clear();
}

}  // namespace mccl
