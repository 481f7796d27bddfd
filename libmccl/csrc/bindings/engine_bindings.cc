// _core.Listener, _core.Options, _core.Communicator, _core.DType, _core.ReduceOp and
// the translation of mccl::Error into mccl_common.errors classes. Thin: checks argument
// types, releases the GIL around everything that blocks, and nothing else.
#include "bindings/engine_bindings.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <thread>

#include "algorithms/cost_model.h"
#include "algorithms/partners.h"
#include "communicator/communicator.h"
#include "core/fd_limit.h"
#include "core/dtype.h"
#include "core/errors.h"
#include "core/log.h"
#include "integrity/link_crypto.h"
#include "transport/listener.h"
#include "core/options.h"
#include "core/ticket.h"

namespace py = pybind11;

namespace mccl {

namespace {

DType to_dtype(int v) {
  if (!dtype_is_valid(v)) {
    throw_error(ErrorKind::kConfig, "[engine] unknown dtype code " + std::to_string(v) +
                                        "; use the values of _core.DType");
  }
  return static_cast<DType>(v);
}

AlgoOp to_algo_op(const std::string& s) {
  AlgoOp op;
  if (!parse_algo_op(s, &op)) {
    throw_error(ErrorKind::kConfig, "[engine] no algorithm choice for op '" + s +
                                        "'; ops: allreduce, allgather, reduce_scatter, broadcast");
  }
  return op;
}

Algo to_algo(AlgoOp op, const std::string& s) {
  Algo a;
  // The compressed algorithms are never chosen or pinned, but the model predicts them.
  const bool compressed = (op == AlgoOp::kAllreduce || op == AlgoOp::kReduceScatter) && parse_algo(s, &a) &&
                          codec_of(a) != Codec::kOff;
  if (!compressed && (!parse_algo_for(op, s, &a) || a == Algo::kAuto)) {
    std::string names;
    for (Algo x : algos_of(op)) names += std::string(names.empty() ? "" : ", ") + algo_name(x);
    throw_error(ErrorKind::kConfig, "[engine] " + std::string(algo_op_name(op)) +
                                        " has no algorithm '" + s + "'; it has " + names);
  }
  return a;
}

// Sizes as nccl-tests (and the benchmarks) count them: all-gather's output and
// reduce-scatter's input are N blocks; the model takes one rank's block.
size_t model_bytes(AlgoOp op, int n, size_t nbytes) {
  const bool whole = op == AlgoOp::kAllgather || op == AlgoOp::kReduceScatter;
  return whole ? nbytes / static_cast<size_t>(std::max(n, 1)) : nbytes;
}

CostParams cost_of(double alpha, double beta, double gamma) {
  CostParams p;
  p.alpha_s = alpha;
  p.beta_s_per_byte = beta;
  p.gamma_s_per_byte = gamma;
  return p;
}

ReduceOp to_op(int v) {
  if (!reduce_op_is_valid(v)) {
    throw_error(ErrorKind::kConfig, "[engine] unknown reduce op code " + std::to_string(v) +
                                        "; use the values of _core.ReduceOp");
  }
  return static_cast<ReduceOp>(v);
}

void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// None: no secret (MCCL_WIRE_SECURITY=off); else the job secret as bytes.
std::string secret_bytes(const py::object& secret) {
  if (secret.is_none()) return {};
  if (!py::isinstance<py::bytes>(secret)) {
    throw_error(ErrorKind::kConfig, "[engine] the job secret must be bytes (or None with "
                                    "MCCL_WIRE_SECURITY=off); see mccl_common.jobkey");
  }
  return std::string(secret.cast<py::bytes>());
}

// Engine log lines go to Python's logging, logger "libmccl.engine" (core/log.h).
void log_to_python(LogLevel level, const std::string& line) {
  if (!Py_IsInitialized() || python_finalizing()) return;
  py::gil_scoped_acquire gil;
  try {
    py::module_::import("logging").attr("getLogger")("libmccl.engine")
        .attr("log")(static_cast<int>(level), line);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("libmccl engine log");
  }
}

py::object error_tuple(const Error& e) {
  return py::make_tuple(static_cast<int>(e.kind()), std::string(e.what()), e.peer_rank(),
                        e.peer_addr());
}

// Owns the engine and the Python callback. The engine is destroyed first, with the GIL
// released, because its completion thread may be waiting for the GIL to deliver.
class PyCommunicator {
 public:
  PyCommunicator(int rank, int size, uint64_t comm_id, Listener& listener,
                 std::vector<std::string> peer_addrs, const Options& opts, py::object on_complete,
                 const py::object& secret)
      : on_complete_(std::move(on_complete)) {
    if (listener.closed()) {
      throw_error(ErrorKind::kConfig,
                  "[engine] this Listener already served a communicator; create a new one");
    }
    std::string key = secret_bytes(secret);
    Communicator::Deliver deliver = make_deliver();
    build([&](std::atomic<bool>* cancel) {
      return std::make_unique<Communicator>(rank, size, comm_id, listener.fd(),
                                            std::move(peer_addrs), opts, key, std::move(deliver),
                                            cancel);
    });
    wipe(&key[0], key.size());
    listener.close();
  }

  // On sockets the caller connected: {peer rank: [fd, ...]}; the caller keeps its fds.
  // `want` (None or a callable(peer)): links on demand over sockets it hands in later.
  PyCommunicator(int rank, int size, uint64_t comm_id, std::map<int, std::vector<int>> sockets,
                 std::vector<std::string> peer_addrs, const Options& opts, py::object on_complete,
                 const py::object& secret, py::object want)
      : on_complete_(std::move(on_complete)), want_(std::move(want)) {
    if (!want_.is_none() && !PyCallable_Check(want_.ptr())) {
      throw_error(ErrorKind::kConfig, "[engine] `want` must be callable(peer) or None");
    }
    std::vector<std::vector<int>> fds(size > 0 ? size : 0);
    for (auto& kv : sockets) {
      if (kv.first < 0 || kv.first >= size) {
        throw_error(ErrorKind::kConfig, "[engine] sockets given for rank " +
                                            std::to_string(kv.first) + " in a world of size " +
                                            std::to_string(size));
      }
      fds[kv.first] = std::move(kv.second);
    }
    std::string key = secret_bytes(secret);
    Communicator::Deliver deliver = make_deliver();
    // The handshakes are bounded by the connect timeout and cannot be cancelled midway.
    HandedLinks::Ask ask = want_.is_none() ? nullptr : make_ask(want_.ptr());
    build([&](std::atomic<bool>*) {
      return std::make_unique<Communicator>(rank, size, comm_id, std::move(fds),
                                            std::move(peer_addrs), opts, key, std::move(deliver),
                                            std::move(ask));
    });
    wipe(&key[0], key.size());
  }

  ~PyCommunicator() {
    py::gil_scoped_release nogil;
    core_.reset();
  }

  Communicator& core() { return *core_; }

 private:
  Communicator::Deliver make_deliver() {
    if (on_complete_.is_none()) return nullptr;
    PyObject* cb = on_complete_.ptr();  // kept alive by on_complete_, which outlives core_
    return [cb](std::vector<Completion>& batch) { deliver_batch(cb, batch); };
  }

  // Runs `make` on a helper thread while this one watches for Ctrl-C: building the mesh
  // waits for every peer, up to the connect timeout.
  template <typename Make>
  void build(Make make) {
    std::atomic<bool> cancel{false};
    std::promise<void> built;
    std::future<void> done = built.get_future();
    std::thread builder([&] {
      try {
        core_ = make(&cancel);
        built.set_value();
      } catch (...) {
        built.set_exception(std::current_exception());
      }
    });
    bool interrupted = false;
    while (true) {
      std::future_status st;
      {
        py::gil_scoped_release nogil;
        st = done.wait_for(std::chrono::milliseconds(100));
      }
      if (st == std::future_status::ready) break;
      if (!interrupted && PyErr_CheckSignals() != 0) {
        interrupted = true;  // the KeyboardInterrupt stays pending; stop the builder
        cancel.store(true);
      }
    }
    {
      py::gil_scoped_release nogil;
      builder.join();
      if (interrupted) core_.reset();  // its threads may wait for the GIL: release it
    }
    if (interrupted) throw py::error_already_set();
    done.get();  // rethrows the builder's error
  }

  // Runs on the engine's asking thread, never its worker (handed_links.h); the callable
  // is kept alive by want_, which outlives core_.
  static HandedLinks::Ask make_ask(PyObject* cb) {
    return [cb](int peer) {
      if (!Py_IsInitialized() || python_finalizing()) return;
      py::gil_scoped_acquire gil;
      PyObject* res = PyObject_CallFunction(cb, "i", peer);
      if (res) {
        Py_DECREF(res);
        return;
      }
      py::error_already_set e;
      throw Error(ErrorKind::kGeneric, std::string("[engine] the link request for rank ") +
                                           std::to_string(peer) + " raised: " + e.what());
    };
  }

  static void deliver_batch(PyObject* cb, std::vector<Completion>& batch) {
    // Taking the GIL while the interpreter shuts down would hang or kill this thread.
    if (!Py_IsInitialized() || python_finalizing()) return;
    py::gil_scoped_acquire gil;
    try {
      py::list out(batch.size());
      for (size_t i = 0; i < batch.size(); ++i) {
        const Completion& c = batch[i];
        py::object err = c.error ? error_tuple(*c.error) : py::none();
        out[i] = py::make_tuple(c.op_id, err, c.info);
      }
      // One call per batch, whatever its size: the GIL round trip is the cost to amortise.
      PyObject* res = PyObject_CallOneArg(cb, out.ptr());
      if (!res) throw py::error_already_set();
      Py_DECREF(res);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("libmccl on_complete callback");
    }
  }

  py::object on_complete_;
  py::object want_;
  std::unique_ptr<Communicator> core_;
};

}  // namespace

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

Communicator* communicator_of(py::handle comm) {
  if (comm.is_none()) return nullptr;
  return &comm.cast<PyCommunicator&>().core();
}

void register_engine_bindings(py::module_& m) {
  set_log_sink(&log_to_python);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      py::object exc = py::module_::import("mccl_common.errors")
                           .attr("from_kind")(static_cast<int>(e.kind()), std::string(e.what()),
                                              e.peer_rank(), e.peer_addr());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::enum_<DType>(m, "DType", py::arithmetic())
      .value("float32", DType::kFloat32)
      .value("float64", DType::kFloat64)
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16)
      .value("int8", DType::kInt8)
      .value("uint8", DType::kUInt8)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64)
      .value("bool", DType::kBool);
  py::enum_<ReduceOp>(m, "ReduceOp", py::arithmetic())
      .value("SUM", ReduceOp::kSum)
      .value("AVG", ReduceOp::kAvg)
      .value("MIN", ReduceOp::kMin)
      .value("MAX", ReduceOp::kMax)
      .value("PRODUCT", ReduceOp::kProduct)
      .value("BAND", ReduceOp::kBand)
      .value("BOR", ReduceOp::kBor)
      .value("BXOR", ReduceOp::kBxor);

  py::class_<Listener>(m, "Listener")
      .def(py::init<const std::string&, int>(), py::arg("host"), py::arg("port") = 0)
      .def_property_readonly("address", &Listener::address)
      .def_property_readonly("port", &Listener::port)
      .def("close", &Listener::close);

  py::enum_<WireSecurity>(m, "WireSecurity")
      .value("off", WireSecurity::kOff)
      .value("mac", WireSecurity::kMac)
      .value("aead", WireSecurity::kAead);
  py::class_<Options>(m, "Options")
      .def(py::init<>())
      .def_readwrite("sockets_per_peer", &Options::sockets_per_peer)
      .def_readwrite("socket_buffer_bytes", &Options::socket_buffer_bytes)
      .def_readwrite("segment_bytes", &Options::segment_bytes)
      .def_readwrite("small_allreduce_bytes", &Options::small_allreduce_bytes)
      .def_readwrite("pipeline_bytes", &Options::pipeline_bytes)
      .def_readwrite("switch_of_rank", &Options::switch_of_rank)
      .def_readwrite("hierarchy_min_bytes", &Options::hierarchy_min_bytes)
      .def_readwrite("hierarchy_ring", &Options::hierarchy_ring)
      .def_readwrite("send_thread", &Options::send_thread)
      .def_readwrite("recv_threads", &Options::recv_threads)
      .def_readwrite("timeout_s", &Options::timeout_s)
      .def_readwrite("connect_timeout_s", &Options::connect_timeout_s)
      .def_readwrite("wire_security", &Options::wire_security)
      .def_readwrite("algo", &Options::algo)
      .def_readwrite("alpha_us", &Options::alpha_us)
      .def_readwrite("beta_gbps", &Options::beta_gbps)
      .def_property(
          "compression", [](const Options& o) { return std::string(codec_name(static_cast<Codec>(o.compression))); },
          [](Options& o, const std::string& s) {
            Codec k;
            if (!parse_codec(s, &k)) {
              throw_error(ErrorKind::kConfig, "[engine] MCCL_COMPRESSION=" + s + ": use off, bf16, fp16 or int8");
            }
            o.compression = static_cast<int>(k);
          })
      .def_readwrite("compression_min_bytes", &Options::compression_min_bytes)
      .def_readwrite("compression_feedback", &Options::compression_feedback)
      .def_readwrite("compression_threads", &Options::compression_threads)
      .def_readwrite("compression_feedback_max_bytes", &Options::compression_feedback_max_bytes);

  // The cost model (algorithms/cost_model.h), for benchmarks that print and plot it beside
  // what they measure. Seconds; beta in seconds per byte; `nbytes` as nccl-tests count
  // them (all-reduce and broadcast: the buffer; all-gather: the gathered output;
  // reduce-scatter: the input, N blocks). Algorithm names as MCCL_ALGO spells them.
  m.def("predict", [](const std::string& op, const std::string& algo, int n, size_t nbytes,
                      double alpha, double beta, double gamma) {
    const AlgoOp o = to_algo_op(op);
    return predict(o, to_algo(o, algo), n, model_bytes(o, n, nbytes), cost_of(alpha, beta, gamma));
  }, py::arg("op"), py::arg("algo"), py::arg("n"), py::arg("nbytes"), py::arg("alpha"),
     py::arg("beta"), py::arg("gamma") = 0.0);
  m.def("choose_algorithm", [](const std::string& op, int n, size_t nbytes, double alpha,
                               double beta, double gamma, std::optional<Options> opts) {
    const AlgoOp o = to_algo_op(op);
    return std::string(algo_name(choose(o, n, model_bytes(o, n, nbytes), cost_of(alpha, beta, gamma),
                                        opts ? *opts : Options{})));
  }, py::arg("op"), py::arg("n"), py::arg("nbytes"), py::arg("alpha"), py::arg("beta"),
     py::arg("gamma") = 0.0, py::arg("opts") = py::none());
  m.def("algorithms", [](const std::string& op) {
    std::vector<std::string> out;
    for (Algo a : algos_of(to_algo_op(op))) out.push_back(algo_name(a));
    return out;
  }, py::arg("op"));
  // The peers rank `rank` talks to in a hierarchical all-reduce (algorithms/hierarchical.cc).
  m.def("hierarchy_peers", [](const std::vector<int>& switch_of_rank, int rank, bool ring) {
    return Hierarchy::of(switch_of_rank, rank).peers(ring);
  }, py::arg("switch_of_rank"), py::arg("rank"), py::arg("ring") = false);

  // A ticket owns its word (Ticket()) or views one the caller keeps mapped (Ticket.at).
  py::class_<Ticket, std::shared_ptr<Ticket>>(m, "Ticket")
      .def(py::init<>())
      .def_static("at", [](uintptr_t addr) { return Ticket::at(ptr(addr)); }, py::arg("addr"))
      .def_property_readonly("value", &Ticket::value)
      .def_property_readonly("poisoned", &Ticket::poisoned)
      .def_property_readonly("address", &Ticket::address)
      .def_readonly_static("POISON", &Ticket::kPoison)
      // Address of mccl_ticket_wake(void* word), for a device's host callback.
      .def_property_readonly_static("WAKE_FN", [](py::object) {
        return reinterpret_cast<uintptr_t>(&mccl_ticket_wake);
      })
      .def("signal", &Ticket::signal, py::arg("value"))
      .def("poison", &Ticket::poison)
      // Raises CollectiveTimeout / AbortedError; in slices, so Ctrl-C is not held up.
      .def("wait", [](const Ticket& t, uint64_t value, double timeout_s, const std::string& what) {
        Deadline end = deadline_after(timeout_s);
        Ticket::Wait w;
        while (true) {
          {
            py::gil_scoped_release nogil;
            w = t.wait_until(value, std::min(end, Clock::now() + std::chrono::milliseconds(100)));
          }
          if (w != Ticket::Wait::kTimeout || Clock::now() >= end) break;
          if (PyErr_CheckSignals() != 0) throw py::error_already_set();
        }
        t.raise_unless_reached(w, value, timeout_s, what);
      }, py::arg("value"), py::arg("timeout_s"), py::arg("what") = "[ticket] wait")
      // False (no error) if not reached within timeout_s, for a caller that waits in slices
      // and looks at other things between; AbortedError once poisoned.
      .def("wait_for", [](const Ticket& t, uint64_t value, double timeout_s, const std::string& what) {
        Ticket::Wait w;
        {
          py::gil_scoped_release nogil;
          w = t.wait_until(value, deadline_after(std::max(timeout_s, 0.0)));
        }
        if (w == Ticket::Wait::kTimeout) return false;
        t.raise_unless_reached(w, value, timeout_s, what);
        return true;
      }, py::arg("value"), py::arg("timeout_s"), py::arg("what") = "[ticket] wait");

  using PC = PyCommunicator;
  py::class_<PC>(m, "Communicator")
      .def_static("own_error_bound_s", &Communicator::own_error_bound_s, py::arg("timeout_s"))
      .def_static("allreduce_piece_bytes", [](const Options& o, int size, size_t count, int dt) {
        return Communicator::allreduce_piece_bytes(o, size, count, to_dtype(dt));
      }, py::arg("opts"), py::arg("size"), py::arg("count"), py::arg("dtype"))
      .def(py::init<int, int, uint64_t, Listener&, std::vector<std::string>, const Options&,
                    py::object, const py::object&>(),
           py::arg("rank"), py::arg("size"), py::arg("comm_id"), py::arg("listener"),
           py::arg("peer_addrs"), py::arg("opts"), py::arg("on_complete") = py::none(),
           py::kw_only(), py::arg("secret") = py::none())
      .def(py::init<int, int, uint64_t, std::map<int, std::vector<int>>, std::vector<std::string>,
                    const Options&, py::object, const py::object&, py::object>(),
           py::arg("rank"), py::arg("size"), py::arg("comm_id"), py::arg("sockets"),
           py::arg("peer_addrs"), py::arg("opts"), py::arg("on_complete") = py::none(),
           py::kw_only(), py::arg("secret") = py::none(), py::arg("want") = py::none())
      .def("link_key_ids", [](PC& c) {
        py::dict out;
        const auto& ids = c.core().link_key_ids();
        for (size_t r = 0; r < ids.size(); ++r) {
          if (!ids[r].empty()) out[py::int_(r)] = py::cast(ids[r]);
        }
        return out;
      }, "{peer: [(send key id, recv key id), ...]}: one-way ids of the frame keys each "
         "socket's handshake derived (equal ids: equal keys); empty with MCCL_WIRE_SECURITY=off")
      .def("allreduce", [](PC& c, uintptr_t p, size_t count, int dt, int op,
                           std::shared_ptr<Ticket> ready, std::shared_ptr<Ticket> done, uint64_t base,
                           uintptr_t feedback_key) {
        return c.core().allreduce(ptr(p), count, to_dtype(dt), to_op(op),
                                  OpTickets{std::move(ready), std::move(done), base}, feedback_key);
      }, py::arg("ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::kw_only(),
         py::arg("ready") = py::none(), py::arg("done") = py::none(), py::arg("base") = 0,
         py::arg("feedback_key") = 0,
         "feedback_key: what keys a compressed op's error feedback instead of ptr (0: ptr), "
         "e.g. the client's tensor address when ptr is a reused shared-memory segment")
      .def("broadcast", [](PC& c, uintptr_t p, size_t nbytes, int root) {
        return c.core().broadcast(ptr(p), nbytes, root);
      }, py::arg("ptr"), py::arg("nbytes"), py::arg("root"))
      .def("allgather", [](PC& c, uintptr_t s, uintptr_t r, size_t nbytes) {
        return c.core().allgather(ptr(s), ptr(r), nbytes);
      }, py::arg("send_ptr"), py::arg("recv_ptr"), py::arg("nbytes"))
      .def("reduce_scatter", [](PC& c, uintptr_t s, uintptr_t r, size_t count, int dt, int op,
                                uintptr_t feedback_key) {
        return c.core().reduce_scatter(ptr(s), ptr(r), count, to_dtype(dt), to_op(op), feedback_key);
      }, py::arg("send_ptr"), py::arg("recv_ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"),
         py::kw_only(), py::arg("feedback_key") = 0)
      .def("reduce", [](PC& c, uintptr_t p, size_t count, int dt, int op, int root) {
        return c.core().reduce(ptr(p), count, to_dtype(dt), to_op(op), root);
      }, py::arg("ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("root"))
      .def("gather", [](PC& c, uintptr_t s, uintptr_t r, size_t nbytes, int root) {
        return c.core().gather(ptr(s), ptr(r), nbytes, root);
      }, py::arg("send_ptr"), py::arg("recv_ptr"), py::arg("nbytes"), py::arg("root"))
      .def("scatter", [](PC& c, uintptr_t s, uintptr_t r, size_t nbytes, int root) {
        return c.core().scatter(ptr(s), ptr(r), nbytes, root);
      }, py::arg("send_ptr"), py::arg("recv_ptr"), py::arg("nbytes"), py::arg("root"))
      .def("alltoall", [](PC& c, uintptr_t s, uintptr_t r, size_t nbytes) {
        return c.core().alltoall(ptr(s), ptr(r), nbytes);
      }, py::arg("send_ptr"), py::arg("recv_ptr"), py::arg("nbytes"))
      .def("alltoallv",
           [](PC& c, uintptr_t s, std::vector<size_t> ss, std::vector<size_t> so, uintptr_t r,
              std::vector<size_t> rs, std::vector<size_t> ro) {
             return c.core().alltoallv(ptr(s), std::move(ss), std::move(so), ptr(r),
                                       std::move(rs), std::move(ro));
           },
           py::arg("send_ptr"), py::arg("send_sizes"), py::arg("send_offsets"), py::arg("recv_ptr"),
           py::arg("recv_sizes"), py::arg("recv_offsets"))
      .def("barrier", [](PC& c) { return c.core().barrier(); })
      .def("gate", [](PC& c, std::shared_ptr<Ticket> ready, uint64_t base, size_t nbytes) {
        c.core().gate(std::move(ready), base, nbytes);
      }, py::arg("ready"), py::arg("base"), py::arg("nbytes"))
      .def("set_timeout", [](PC& c, double timeout_s) { c.core().set_timeout(timeout_s); },
           py::arg("timeout_s"))
      // timeout_s: None, the communicator's timeout; 0, no deadline; > 0, its own.
      .def("send", [](PC& c, uintptr_t p, size_t nbytes, int dst, int64_t tag,
                      std::optional<double> timeout_s) {
        return c.core().send(ptr(p), nbytes, dst, tag, timeout_s);
      }, py::arg("ptr"), py::arg("nbytes"), py::arg("dst"), py::arg("tag") = 0, py::kw_only(),
         py::arg("timeout_s") = py::none())
      .def("recv", [](PC& c, uintptr_t p, size_t nbytes, int src, int64_t tag,
                      std::optional<double> timeout_s) {
        return c.core().recv(ptr(p), nbytes, src, tag, timeout_s);
      }, py::arg("ptr"), py::arg("nbytes"), py::arg("src"), py::arg("tag") = 0, py::kw_only(),
         py::arg("timeout_s") = py::none())
      .def("wait", [](PC& c, uint64_t id, double timeout_s) {
        // In slices, so Ctrl-C (KeyboardInterrupt) is not held up until the op ends.
        Deadline end = deadline_after(timeout_s);
        while (true) {
          double left = std::chrono::duration<double>(end - Clock::now()).count();
          bool done;
          {
            py::gil_scoped_release nogil;
            done = c.core().wait_for(id, std::min(std::max(left, 0.0), 0.1));
          }
          if (done) return;
          if (PyErr_CheckSignals() != 0) throw py::error_already_set();
          if (left <= 0) c.core().throw_wait_timeout(id, timeout_s);
        }
      }, py::arg("op_id"), py::arg("timeout_s") = 1800.0)
      // Like wait, but False (no error) while the op is still pending after timeout_s: for
      // a caller that waits on a deadline-free op in slices, looking at its own state between.
      .def("wait_for", [](PC& c, uint64_t id, double timeout_s) {
        py::gil_scoped_release nogil;
        return c.core().wait_for(id, std::max(timeout_s, 0.0));
      }, py::arg("op_id"), py::arg("timeout_s"))
      .def("abort", [](PC& c, const std::string& reason) {
        py::gil_scoped_release nogil;
        c.core().abort(reason);
      }, py::arg("reason") = "")
      .def("shutdown", [](PC& c, double timeout_s) {
        py::gil_scoped_release nogil;
        c.core().shutdown(timeout_s);
        return c.core().released_clean();
      }, py::arg("timeout_s") = 10.0)
      .def("released_clean", [](PC& c) { return c.core().released_clean(); })
      // Links on demand over handed-in sockets (built with `want`): K connected sockets to
      // `peer`; the engine dups and proves them in the background (the caller keeps its fds).
      .def("hand_in", [](PC& c, int peer, std::vector<int> fds) {
        py::gil_scoped_release nogil;
        c.core().hand_in(peer, fds);
      }, py::arg("peer"), py::arg("fds"))
      // The caller cannot link `peer`: the communicator fails with this error (an
      // mccl_common.errors kind and a message naming the peer).
      .def("refuse_link", [](PC& c, int peer, int kind, const std::string& message) {
        if (kind < 0 || kind > static_cast<int>(ErrorKind::kAuth)) kind = 0;
        py::gil_scoped_release nogil;
        c.core().refuse_link(peer, static_cast<ErrorKind>(kind), message);
      }, py::arg("peer"), py::arg("kind"), py::arg("message"))
      // The cost model's parameters every rank agreed on at start: (alpha s, beta s/byte).
      .def("alpha_beta", [](PC& c, double timeout_s) {
        py::gil_scoped_release nogil;
        const CostParams p = c.core().cost_params(timeout_s);
        return std::make_pair(p.alpha_s, p.beta_s_per_byte);
      }, py::arg("timeout_s") = 60.0)
      .def("cost_params", [](PC& c, double timeout_s) {
        CostParams p;
        {
          py::gil_scoped_release nogil;
          p = c.core().cost_params(timeout_s);
        }
        py::dict d;
        d["alpha_s"] = p.alpha_s;
        d["beta_s_per_byte"] = p.beta_s_per_byte;
        d["gamma_s_per_byte"] = p.gamma_s_per_byte;
        return d;
      }, py::arg("timeout_s") = 60.0)
      // The algorithm the last op of `op` ran ("auto" before the first).
      .def("last_algorithm", [](PC& c, const std::string& op) {
        return std::string(algo_name(c.core().last_algorithm(to_algo_op(op))));
      }, py::arg("op"))
      .def_property_readonly("rank", [](PC& c) { return c.core().rank(); })
      .def_property_readonly("size", [](PC& c) { return c.core().size(); })
      .def_property_readonly("comm_id", [](PC& c) { return c.core().comm_id(); })
      .def("peer_address", [](PC& c, int r) { return c.core().peer_address(r); }, py::arg("r"))
      .def("stats", [](PC& c) {
        CommStats s = c.core().stats();
        py::dict per_peer;
        for (size_t r = 0; r < s.per_peer.size(); ++r) {
          if (static_cast<int>(r) == c.core().rank()) continue;
          py::dict d;
          d["sent"] = s.per_peer[r].first;
          d["received"] = s.per_peer[r].second;
          per_peer[py::int_(r)] = d;
        }
        py::dict out;
        out["ops_completed"] = s.ops_completed;
        out["bytes_sent"] = s.bytes_sent;
        out["bytes_received"] = s.bytes_received;
        out["unexpected_messages"] = s.unexpected_messages;
        out["unexpected_bytes"] = s.unexpected_bytes;
        out["per_peer"] = per_peer;
        out["linked_peers"] = s.linked_peers;
        out["link_sockets"] = s.link_sockets;
        return out;
      })
      .def("link_count", [](PC& c) { return c.core().stats().link_sockets; },
           "Sockets of the links this rank holds now (links open on demand).");
  m.def("collective_peers", &collective_peers, py::arg("r"), py::arg("n"),
        "The peers the whole-communicator collectives of rank r of n talk to (sorted).");
  m.def("open_file_count", &open_file_count, "Files this process has open (-1: unknown).");
}

}  // namespace mccl
