// Thin: argument checks, the GIL released around everything that blocks or joins, and the
// callbacks of the native threads taken to Python under the GIL (never while finalizing).
#include "bindings/opqueue_bindings.h"

#include <pybind11/stl.h>

#include <memory>

#include "bindings/engine_bindings.h"
#include "core/dtype.h"
#include "opqueue/client_queue.h"
#include "opqueue/dispatcher.h"

namespace py = pybind11;

namespace mccl {

namespace {

using opqueue::ClientQueue;
using opqueue::Dispatcher;
using opqueue::Kind;

// A submit that copies at least this much into the queue lets go of the GIL meanwhile.
constexpr size_t kReleaseGilBytes = size_t{64} << 10;

py::object error_or_none(const std::shared_ptr<const Error>& e) {
  if (!e) return py::none();
  return py::make_tuple(static_cast<int>(e->kind()), std::string(e->what()), e->peer_rank(),
                        e->peer_addr());
}

// Runs `call` (which touches Python) on a native thread under the GIL; a raised exception
// is reported as unraisable.
template <typename Call>
void with_gil(Call call) {
  if (!Py_IsInitialized() || python_finalizing()) return;
  py::gil_scoped_acquire gil;
  try {
    call();
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("libmccl fast-path callback");
  }
}

Kind to_kind(int k) {
  if (k != static_cast<int>(Kind::kAllreduce) && k != static_cast<int>(Kind::kBarrier)) {
    throw_error(ErrorKind::kConfig, "[opqueue] unknown op kind " + std::to_string(k));
  }
  return static_cast<Kind>(k);
}

// The Python callables are kept here, outliving the native object, which is destroyed
// with the GIL released: its thread may be waiting for the GIL to deliver.
class PyFastQueue {
 public:
  PyFastQueue(const std::string& name, size_t slot_bytes, int rank, py::object on_done)
      : on_done_(std::move(on_done)) {
    py::object* cb = &on_done_;
    q_ = std::make_unique<ClientQueue>(
        name, slot_bytes, rank, [cb](uint64_t id, std::shared_ptr<const Error> err) {
          with_gil([&] {
            py::object fn = *cb;  // a reference of our own: the call may drop the queue's
            fn(id, error_or_none(err));
          });
        });
  }
  ~PyFastQueue() {
    py::gil_scoped_release nogil;
    q_.reset();
  }
  ClientQueue& q() { return *q_; }

 private:
  py::object on_done_;
  std::unique_ptr<ClientQueue> q_;
};

class PyDispatcher {
 public:
  PyDispatcher(opqueue::DispatcherSpec spec, py::object engine, py::object on_fail)
      : engine_(std::move(engine)), on_fail_(std::move(on_fail)) {
    py::object* cb = &on_fail_;
    Communicator* core = communicator_of(engine_);
    d_ = std::make_unique<Dispatcher>(std::move(spec), core, [cb](const Error& e, bool from_engine) {
      with_gil([&] {
        (*cb)(static_cast<int>(e.kind()), std::string(e.what()), e.peer_rank(), e.peer_addr(),
              from_engine);
      });
    });
  }
  ~PyDispatcher() {
    py::gil_scoped_release nogil;
    d_.reset();
  }
  Dispatcher& d() { return *d_; }

 private:
  py::object engine_;  // keeps the engine alive while the thread may drive it
  py::object on_fail_;
  std::unique_ptr<Dispatcher> d_;
};

}  // namespace

void register_opqueue_bindings(py::module_& m) {
  m.attr("FAST_ALLREDUCE") = static_cast<int>(Kind::kAllreduce);
  m.attr("FAST_BARRIER") = static_cast<int>(Kind::kBarrier);
  m.attr("FAST_QUEUE_HEADER") = opqueue::kDataOff;

  py::class_<PyFastQueue>(m, "FastQueue")
      .def(py::init<const std::string&, size_t, int, py::object>(), py::arg("name"),
           py::arg("slot_bytes"), py::arg("rank"), py::arg("on_done"))
      .def("submit", [](PyFastQueue& f, uint64_t op_id, uint64_t seq, int kind, int dt, int op,
                        size_t count, uintptr_t buf) {
        if (!dtype_is_valid(dt) || !reduce_op_is_valid(op)) {
          throw_error(ErrorKind::kConfig, "[opqueue] unknown dtype/op code " + std::to_string(dt) +
                                              "/" + std::to_string(op));
        }
        auto submit = [&] {
          f.q().submit(op_id, seq, to_kind(kind), static_cast<DType>(dt), static_cast<ReduceOp>(op),
                       count, reinterpret_cast<void*>(buf));
        };
        // Copying a bucket of up to MCCL_DAEMON_FAST_BYTES in takes a while: let the other
        // threads (the completion of the previous op, the training loop) run meanwhile.
        if (count * dtype_size(static_cast<DType>(dt)) >= kReleaseGilBytes) {
          py::gil_scoped_release nogil;
          submit();
        } else {
          submit();
        }
      }, py::arg("op_id"), py::arg("seq"), py::arg("kind"), py::arg("dtype"), py::arg("op"),
         py::arg("count"), py::arg("ptr"))
      .def("close", [](PyFastQueue& f) {
        py::gil_scoped_release nogil;
        f.q().close();
      })
      .def("unlink", [](PyFastQueue& f) { f.q().unlink(); })
      .def_property_readonly("fd", [](PyFastQueue& f) { return f.q().fd(); })
      .def_property_readonly("name", [](PyFastQueue& f) { return f.q().name(); })
      .def_property_readonly("slot_bytes", [](PyFastQueue& f) { return f.q().slot_bytes(); });

  py::class_<PyDispatcher>(m, "FastDispatcher")
      .def(py::init([](std::string job, std::vector<int> ranks, std::vector<std::string> queues,
                       std::vector<int> queue_fds, size_t slot_bytes, int world, int hosts,
                       double timeout_s, py::object engine, py::object on_fail) {
             opqueue::DispatcherSpec spec{std::move(job), std::move(ranks), std::move(queues),
                                          std::move(queue_fds), slot_bytes, world, hosts, timeout_s};
             return std::make_unique<PyDispatcher>(std::move(spec), std::move(engine),
                                                   std::move(on_fail));
           }),
           py::arg("job"), py::arg("local_ranks"), py::arg("queues"), py::arg("queue_fds"), py::arg("slot_bytes"),
           py::arg("world"), py::arg("hosts"), py::arg("timeout_s"), py::arg("engine"),
           py::arg("on_fail"))
      .def_property_readonly("turn", [](PyDispatcher& p) { return p.d().turn(); })
      .def("fail", [](PyDispatcher& p, int kind, const std::string& msg, int peer_rank,
                      const std::string& peer_addr) {
        p.d().fail(Error(static_cast<ErrorKind>(kind >= 0 && kind <= opqueue::kLastKind ? kind : 0), msg, peer_rank,
                         peer_addr));
      }, py::arg("kind"), py::arg("message"), py::arg("peer_rank") = -1, py::arg("peer_addr") = "")
      .def("close", [](PyDispatcher& p) {
        py::gil_scoped_release nogil;
        p.d().close();
      })
      // [(kind, nbytes, seconds)] of the ops served since the last call, for the exporter.
      .def("take_records", [](PyDispatcher& p) {
        py::list out;
        for (const auto& r : p.d().take_records()) {
          out.append(py::make_tuple(static_cast<int>(r.kind), r.nbytes, r.seconds));
        }
        return out;
      });
}

}  // namespace mccl
