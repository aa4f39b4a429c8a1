// The `tpu` tensor: a plain PrivateUse1 tensor (docs/cxx-plan.md, docs/architecture.md).
//
// NOTE [plain tensor]: a tpu tensor is an ordinary c10::TensorImpl on
// the PrivateUse1 key (no Python subclass, no Python dispatch key). Its state is held where
// PyTorch keeps a backend's state:
//
// - the engine value: the storage's DataPtr context (a StorageCtx), which owns a reference to the
//   Python `deferfuse.tensor.Storage` (None until Python first reads it) and remembers the sizes,
//   strides and dtype the storage was made for (the base tensor). Every view shares the at::Storage,
//   so every view reaches the same StorageCtx, as every view of a TpuTensor shares `_s`;
// - the view chain: the TensorImpl's BackendMeta (a ViewMeta, PyTorch's slot for PrivateUse1
//   metadata, copied by shallow_copy_and_detach, so detach and autograd's saved tensors keep it).
//   A tensor with no ViewMeta is its storage's base; a tensor PyTorch itself aliased (a composite
//   kernel's alias_with_sizes_and_strides) without one, whose geometry is not the base's, reads as
//   one as_strided step of the storage.
//
// The data pointer is the StorageCtx's address: unique per storage, never dereferenced (no host
// memory is allocated). The kernels here are the allocator, empty/empty_strided, the core view ops
// and a boxed fallback that hands every other op to one Python router (deferfuse/plain.py), with a
// cache of output metadata for the floor measurement (`set_floor`).
#include <torch/extension.h>
#include <structmember.h>  // PyMemberDef types (Storage.val at its slot)

#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <ATen/InferSize.h>
#include <ATen/ops/alias_native.h>
#include <ATen/TensorUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/SmallVector.h>
#include <c10/util/strides.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#ifdef DEFERFUSE_HIT_TIMING
#include <x86intrin.h>
#endif
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace py = pybind11;

namespace {

using c10::IValue;
using IntVec = std::vector<int64_t>;

// The pending Python error, raised as PyTorch raises a Python error from C++ (python_error).
[[noreturn]] void rethrow_python() {
  python_error err;
  err.persist();
  throw std::move(err);
}


// NOTE [hit timing] in _fastpath.c: with -DDEFERFUSE_HIT_TIMING (a debug build in /tmp, made by
// bench/cxx_hit_parts.py; without the macro the marks compile to nothing), rdtsc marks between the
// sections of a kernel hit and around it: the gap from the last fallback's exit to this op's
// `empty_strided` (PyTorch's return to Python, the caller's loop, the next call's argument
// parsing, autograd, the structured op's meta function), the output's release (free_ctx), the
// output TensorImpl (`empty_strided`), the dispatch from there to the fallback (the `.out`
// call, boxing), then the fallback's own sections. One row of ticks per hit, read by hit_timing().
#ifdef DEFERFUSE_HIT_TIMING
enum { H_RET, H_FREE, H_CALL, H_EMPTY, H_OUT, H_FLOOR, H_GIL, H_KEY, H_FIND, H_FRESH, H_INS,
       H_SCALARS, H_FAKE, H_RECORD, H_OUTS, H_STACK, H_LOCALS, H_GIL_OUT, H_N };
const char* const H_NAMES[H_N] = {
    "gap: fallback exit to free_ctx (return to Python, wrap, the loop)", "free_ctx (the last output released)",
    "gap: to empty_strided (arg parsing, autograd, meta)", "empty_strided (the output TensorImpl)",
    "gap: empty_strided to the fallback (add.out dispatch, boxing)", "fallback entry, floor check",
    "GIL acquire", "plan lookup + build_key", "entries.find", "kernel_hit: fresh out checks",
    "ins: Storage.val per input", "scalars list", "fake-mode check, dev int", "record_c (_fastpath)",
    "outputs: tuple check, ctx->storage", "stack drop/push", "locals freed (Call, lists)", "GIL release"};
struct HitTiming {
  unsigned long long last = 0;
  uint32_t cur[H_N] = {};
  std::vector<std::array<uint32_t, H_N>> rows;
};
HitTiming& ht() {
  static HitTiming* h = new HitTiming();
  return *h;
}
inline void hit_mark(int i) {
  auto& h = ht();
  unsigned long long now = __rdtsc();
  h.cur[i] += static_cast<uint32_t>(now - h.last);
  h.last = now;
}
void hit_row(bool keep) {
  auto& h = ht();
  if (keep && h.rows.size() < (1u << 17)) {
    std::array<uint32_t, H_N> r;
    std::copy(std::begin(h.cur), std::end(h.cur), r.begin());
    h.rows.push_back(r);
  }
  std::fill(std::begin(h.cur), std::end(h.cur), 0);
}
struct HitExit {
  bool hit = false;
  ~HitExit() {
    hit_mark(H_GIL_OUT);
    hit_row(hit);
  }
};
struct HitLocals {
  ~HitLocals() { hit_mark(H_LOCALS); }
};
#define HIT_MARK(i) hit_mark(i)
#else
#define HIT_MARK(i) ((void)0)
#endif

// ---------------------------------------------------------------------------------------------
// storage: the engine value

// A storage's base sizes or strides: small vectors, so a new storage allocates its StorageCtx only
// (two heap vectors more per output were most of `empty_strided`'s own time).
using BaseInts = c10::SmallVector<int64_t, 5>;

struct StorageCtx {
  PyObject* storage = nullptr;  // deferfuse.tensor.Storage (owned), or null until Python reads it
  // NOTE [lazy storages]: a kernel hit's output Value (owned) while no reader has asked for its
  // Storage (then `storage` is null), and the device that Storage is made on
  PyObject* value = nullptr;
  StorageCtx *lazy_prev = nullptr, *lazy_next = nullptr;  // the lazy list, while `linked`
  bool linked = false;
  c10::DeviceIndex dev = 0;
  BaseInts size, stride;        // the base tensor the storage was made for
  c10::ScalarType dtype = c10::ScalarType::Float;
  bool known = false;           // size/stride/dtype set (by empty*, or by make_base)
  int64_t sig = -1;             // the base tensor's signature id (NOTE [C++ signatures]), or -1
  size_t cap = 0;               // the bytes allocated: what untyped_storage().resize_ may restore
};

// NOTE [lazy storages]: a kernel hit's new outputs are not given a Python `Storage` (and its weak
// reference in the trace's `storages`) when they are made: most never reach Python before the
// flush computes or drops them, and making and freeing the Storage was ~190 ns of a ~1.8 µs hit.
// The output's StorageCtx holds the output `Value` instead, and is linked into the lazy list
// below. Three rules keep this exactly the eager Storage's behaviour:
//
// - one maker: every reader of a context's Storage goes through `ctx_storage`, which makes it on
//   first ask (`Plain.lazy_storage`: the Storage record_storages would have made, registered in
//   the trace that holds its pending value) and turns the context into an ordinary one (unlinked,
//   its Value now the Storage's `val`). The Python accessors `storage` and `state` (so
//   Plain.storage, Plain.wrapper, compiled mode, checkpoints, the router), the hit's written
//   inputs, `resize_` and `untyped_storage().resize_` all ask. Only readers of the value itself
//   skip it: a hit's inputs read the context's Value as they would read the Storage's `val`
//   (nothing can have written it: a write needs the Storage); `storage_key` (the foreach overlap
//   check) and `is_fresh` need no Storage, and a lazy context is not fresh;
// - the flush sees every live output: `Trace.take` adds the pending Values of its trace that
//   linked contexts hold (`lazy_outputs`), as it adds those of live Storages (NOTE [read-back
//   outputs] in compiled.py: a value no flush outputs is never computed, and read later it came
//   back as zeros); a context stays linked while its Value may be pending (an interrupted flush
//   records the nodes again, with the same Values) and is unlinked by the first walk that finds
//   its Value no longer pending, by the maker, and when the storage dies;
// - a context holds its Value as a Storage would (one reference), so the flush's donation check
//   (who else holds an input value, NOTE [donation safety]) counts it as before.
//
// The list and its counts are the process's, as the allocator is, and change under the GIL only.
struct Lazy {
  StorageCtx* first = nullptr;
  int64_t linked = 0;             // contexts in the list now
  int64_t outputs = 0;            // hit outputs made lazy
  int64_t made = 0;               // Storages made by the maker
  PyObject* make_fn = nullptr;    // Plain.lazy_storage(value, dev, dtype, stride) -> Storage
};

Lazy& lazy() {
  static Lazy* l = new Lazy();  // never destroyed: storages may be freed while the process exits
  return *l;
}

void lazy_link(StorageCtx* c) {
  auto& L = lazy();
  c->lazy_prev = nullptr;
  c->lazy_next = L.first;
  if (L.first != nullptr) L.first->lazy_prev = c;
  L.first = c;
  c->linked = true;
  ++L.linked;
}

void lazy_unlink(StorageCtx* c) {
  auto& L = lazy();
  if (c->lazy_prev != nullptr) c->lazy_prev->lazy_next = c->lazy_next;
  else L.first = c->lazy_next;
  if (c->lazy_next != nullptr) c->lazy_next->lazy_prev = c->lazy_prev;
  c->lazy_prev = c->lazy_next = nullptr;
  c->linked = false;
  --L.linked;
}

// Drops what a context holds (its Storage or its lazy Value); the GIL held.
void ctx_clear(StorageCtx* c) {
  if (c->linked) lazy_unlink(c);
  Py_CLEAR(c->value);
  Py_CLEAR(c->storage);
}

void free_ctx(void* p) {
  HIT_MARK(H_RET);
  auto* ctx = static_cast<StorageCtx*>(p);
  if (ctx->storage != nullptr || ctx->value != nullptr) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      ctx_clear(ctx);
    } else if (ctx->linked) {
      lazy_unlink(ctx);  // the interpreter is gone: its objects are not ours to release
    }
  }
  delete ctx;
  HIT_MARK(H_FREE);
}

// NOTE [lazy storages]: the one maker. The context's Storage (borrowed), made now from its lazy
// Value if it has one; null when it holds none (no value yet: an `empty` tensor's), or null with
// the Python error set. Holds the GIL.
PyObject* ctx_storage(StorageCtx* ctx) {
  if (ctx->value == nullptr) return ctx->storage;
  auto& L = lazy();
  // the Storage's stride: None for a contiguous base, as Entry.fast and Plain.storage give it
  bool contiguous = true;
  int64_t acc = 1;
  for (size_t i = ctx->size.size(); i-- > 0;) {
    if (ctx->stride[i] != acc) contiguous = false;
    acc *= std::max<int64_t>(ctx->size[i], 1);
  }
  PyObject* stride = Py_None;
  Py_INCREF(stride);
  if (!contiguous) {
    Py_DECREF(stride);
    stride = PyTuple_New(static_cast<Py_ssize_t>(ctx->stride.size()));
    if (stride == nullptr) return nullptr;
    for (size_t i = 0; i < ctx->stride.size(); ++i) {
      PyObject* o = PyLong_FromLongLong(ctx->stride[i]);
      if (o == nullptr) {
        Py_DECREF(stride);
        return nullptr;
      }
      PyTuple_SET_ITEM(stride, static_cast<Py_ssize_t>(i), o);
    }
  }
  PyObject* dev = PyLong_FromLong(ctx->dev);
  if (dev == nullptr) {
    Py_DECREF(stride);
    return nullptr;
  }
  PyObject* value = Py_NewRef(ctx->value);  // the call may run other threads' Python
  PyObject* argv[4] = {value, dev, reinterpret_cast<PyObject*>(torch::getTHPDtype(ctx->dtype)), stride};
  PyObject* st = L.make_fn == nullptr
      ? (PyErr_SetString(PyExc_RuntimeError, "deferfuse: the lazy storage maker is not installed"), nullptr)
      : PyObject_Vectorcall(L.make_fn, argv, 4, nullptr);
  Py_DECREF(value);
  Py_DECREF(dev);
  Py_DECREF(stride);
  if (st == nullptr) return nullptr;
  if (ctx->value == nullptr) {  // another thread made it while the maker ran: that one stands
    Py_DECREF(st);
    return ctx->storage;
  }
  if (ctx->linked) lazy_unlink(ctx);
  Py_CLEAR(ctx->value);
  Py_XSETREF(ctx->storage, st);
  ++L.made;
  return st;
}

// A kernel hit's output `v` (a Value) becomes the context's lazy value (NOTE [lazy storages]).
void set_lazy(StorageCtx* ctx, PyObject* v, c10::DeviceIndex dev) {
  ctx_clear(ctx);
  ctx->value = Py_NewRef(v);
  ctx->dev = dev;
  lazy_link(ctx);
  ++lazy().outputs;
}

// NOTE [plain device guard]: PrivateUse1's device guard in C++. PyTorch's guard for a Python
// backend calls Python for every device query, and a device guard runs around every structured op
// (the CompositeExplicitAutogradNonFunctional wrappers) and every factory: measured, a C++ `empty`
// cost 8.7 µs with it. The current device is per thread, as torch.tpu.set_device's is (device.py
// keeps both in step); there is one stream per device (the engine orders work itself).
thread_local c10::DeviceIndex tls_device = 0;
c10::DeviceIndex n_devices = 1;

struct TpuGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(c10::DeviceType::PrivateUse1, tls_device); }
  void setDevice(c10::Device d) const override {
    if (d.has_index()) {
      TORCH_CHECK(d.index() < n_devices, "tpu:", static_cast<int>(d.index()), " does not exist (",
                  static_cast<int>(n_devices), " devices)");
      tls_device = d.index();
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) tls_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d.has_index() ? d : getDevice());
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override { return n_devices; }
  // NOTE [one stream] in streams.py: every stream is the device's one stream, events are true at
  // once (torch.tpu.Stream()/Event().record() reach these: FSDP2's streams); a synchronize waits
  // for the engine (streams._synchronize), as torch.tpu.Stream.synchronize does.
  c10::Stream getNewStream(c10::Device d, int) const override {
    return c10::Stream(c10::Stream::DEFAULT, d.has_index() ? d : getDevice());
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, d.has_index() ? d : getDevice());
  }
  void record(void** event, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    if (*event == nullptr) *event = reinterpret_cast<void*>(1);  // recorded: nothing to free
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override { synchronize_engine(); }
  void synchronizeEvent(void*) const override { synchronize_engine(); }
  void synchronizeDevice(const c10::DeviceIndex) const override { synchronize_engine(); }

  static void synchronize_engine() {
    py::gil_scoped_acquire gil;
    try {
      py::module_::import("deferfuse.streams").attr("_synchronize")();
    } catch (py::error_already_set& e) {
      e.restore();
      rethrow_python();
    }
  }
};

c10::DeviceIndex current_device() { return tls_device; }

// Allocates no host memory: its DataPtr names a StorageCtx (NOTE [plain tensor]).
struct TpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    auto* ctx = new StorageCtx();
    ctx->cap = n;
    return {ctx, ctx, &free_ctx, c10::Device(c10::DeviceType::PrivateUse1, current_device())};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void*, const void*, std::size_t) const override {
    TORCH_CHECK(false, "tpu storages hold no host memory: copy tpu tensors with .copy_() or .to()");
  }
};

TpuAllocator& allocator() {
  static TpuAllocator a;
  return a;
}

StorageCtx* ctx_of(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == c10::DeviceType::PrivateUse1 && t.has_storage(),
              "expected a plain tpu tensor, got one on ", t.device());
  auto* ctx = static_cast<StorageCtx*>(t.storage().data_ptr().get_context());
  TORCH_CHECK(ctx != nullptr && t.storage().data_ptr().get_deleter() == &free_ctx,
              "this tpu tensor's storage was not made by deferfuse's allocator");
  return ctx;
}

bool is_plain_tensor(const at::Tensor& t) {
  return t.device().type() == c10::DeviceType::PrivateUse1 && t.has_storage() &&
         t.storage().data_ptr().get_deleter() == &free_ctx;
}

// ---------------------------------------------------------------------------------------------
// the view chain

// One view step: the aten op (an index into kOps) and its arguments after self, as the view
// kernel received them. Python reads it as (OpOverload, args, ()), the step the Python view path
// records (deferfuse/views.py).
enum Op : int8_t { AS_STRIDED, VIEW, RESHAPE_ALIAS, T, TRANSPOSE, PERMUTE, SLICE, SELECT, EXPAND,
                   UNSQUEEZE, SQUEEZE, SQUEEZE_DIM, SQUEEZE_DIMS, CONJ, N_OPS };
const char* const kOps[N_OPS] = {"as_strided.default", "view.default", "_reshape_alias.default",
                                 "t.default", "transpose.int", "permute.default", "slice.Tensor",
                                 "select.int", "expand.default", "unsqueeze.default",
                                 "squeeze.default", "squeeze.dim", "squeeze.dims", "_conj.default"};

struct Step {
  Op op;
  std::vector<IValue> args;
  // NOTE [C++ moving windows]: a slice or select that moves a window (the op path's DSLICE /
  // DSELECT rule, views._moving_view): its normalised start, else -1; a slice's length
  int64_t win = -1;
  int64_t len = -1;
};

struct ViewMeta final : c10::BackendMeta {
  std::vector<Step> steps;
  PyObject* py_chain = nullptr;  // the chain's first steps, set from Python (a router output
                                 // that is a view), as a tuple of Python steps; `steps` follow
  // the signature id of the tensor this meta was last read on, and that tensor's geometry (a
  // meta is shared by detach()'s copies; checked before use) (NOTE [C++ signatures])
  mutable int64_t sig = -1;
  mutable IntVec sig_geom;
  ~ViewMeta() override {
    if (py_chain != nullptr && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(py_chain);
    }
  }
};

const ViewMeta* meta_of(const at::Tensor& t) {
  return dynamic_cast<const ViewMeta*>(t.unsafeGetTensorImpl()->get_backend_meta());
}

// A view of `self` over the same storage with one more step (or, for as_strided, one step).
at::Tensor make_view(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                     int64_t offset, std::optional<Step> step) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW,
                                                   c10::Storage(self.storage()), self.key_set(),
                                                   self.dtype());
  impl->set_sizes_and_strides(size, stride, offset);
  const ViewMeta* old = meta_of(self);
  if (step.has_value() || old != nullptr) {
    auto m = c10::make_intrusive<ViewMeta>();
    if (step.has_value() && step->op == AS_STRIDED) {
      m->steps.push_back(std::move(*step));
    } else {
      if (old != nullptr) {
        m->steps = old->steps;
        if (old->py_chain != nullptr) {
          py::gil_scoped_acquire gil;
          Py_INCREF(old->py_chain);
          m->py_chain = old->py_chain;
        }
      }
      if (step.has_value()) m->steps.push_back(std::move(*step));
    }
    impl->set_backend_meta(m);
  }
  return at::Tensor(std::move(impl));
}

int64_t wrap_dim(int64_t d, int64_t n) { return c10::maybe_wrap_dim(d, n); }

// ---------------------------------------------------------------------------------------------
// kernels: factories

void remember_base(const at::Tensor& t) {
  auto* ctx = ctx_of(t);
  ctx->size.assign(t.sizes().begin(), t.sizes().end());
  ctx->stride.assign(t.strides().begin(), t.strides().end());
  ctx->dtype = t.scalar_type();
  ctx->known = true;
  ctx->sig = -1;
}

c10::DispatchKeySet tpu_keys() { return c10::DispatchKeySet(c10::DispatchKey::PrivateUse1); }

// A device index that does not exist raises device_info.check's error (CUDA's kind: "invalid device
// ordinal", naming the devices there are) at the call, as the Python factories do.
void check_device(c10::DeviceIndex i) {
  if (i >= 0 && i < n_devices) return;
  py::gil_scoped_acquire gil;
  try {
    py::module_::import("deferfuse.device_info").attr("check")(static_cast<int>(i));
  } catch (py::error_already_set& e) {
    e.restore();
    rethrow_python();
  }
  TORCH_CHECK(false, "tpu:", static_cast<int>(i), " does not exist");
}

// The device a factory allocates on (the allocator reads the current device), for its scope.
struct DeviceScope {
  c10::DeviceIndex old;
  explicit DeviceScope(std::optional<c10::Device> d) : old(tls_device) {
    if (d.has_value() && d->has_index()) {
      check_device(d->index());
      tls_device = d->index();
    }
  }
  ~DeviceScope() { tls_device = old; }
};

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout>,
                         std::optional<c10::Device> device, std::optional<bool>) {
  HIT_MARK(H_CALL);
  DeviceScope g(device);
  at::Tensor t = at::detail::empty_strided_generic(size, stride, &allocator(), tpu_keys(),
                                             dtype.value_or(c10::get_default_dtype_as_scalartype()));
  remember_base(t);
  HIT_MARK(H_EMPTY);
  return t;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device> device,
                               std::optional<bool>, std::optional<c10::MemoryFormat> mf) {
  HIT_MARK(H_CALL);
  DeviceScope g(device);
  at::Tensor t = at::detail::empty_generic(size, &allocator(), tpu_keys(),
                                     dtype.value_or(c10::get_default_dtype_as_scalartype()), mf);
  remember_base(t);
  HIT_MARK(H_EMPTY);
  return t;
}

// ---------------------------------------------------------------------------------------------
// kernels: views (PyTorch's own size and stride rules, CPU's error words)

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> offset) {
  int64_t off = offset.value_or(self.storage_offset());
  TORCH_CHECK(size.size() == stride.size(), "mismatch in length of strides and shape");
  for (auto s : stride) TORCH_CHECK(s >= 0, "as_strided: Negative strides are not supported at the moment, got strides: ", stride);
  TORCH_CHECK(off >= 0, "Tensor: invalid storage offset ", off);
  auto* ctx = ctx_of(self);
  // the storage's bounds, as setStorage checks them on CPU
  bool empty = false;
  int64_t extent = off;
  for (size_t i = 0; i < size.size(); ++i) {
    if (size[i] == 0) empty = true;
    extent += (size[i] - 1) * stride[i];
  }
  int64_t item = self.element_size();
  int64_t have = self.storage().nbytes();
  TORCH_CHECK(empty || (extent + 1) * item <= have, "setStorage: sizes ", size, ", strides ", stride,
              ", storage offset ", off, ", and itemsize ", item, " requiring a storage size of ",
              (extent + 1) * item, " are out of bounds for storage of size ", have);
  IntVec base_size(ctx->size.begin(), ctx->size.end()), base_stride(ctx->stride.begin(), ctx->stride.end());
  Step s{AS_STRIDED, {IValue(size.vec()), IValue(stride.vec()), IValue(off), IValue(base_size),
                      IValue(base_stride)}};
  return make_view(self, size, stride, off, std::move(s));
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  auto shape = at::infer_size_dv(size, self.numel());
  auto st = at::detail::computeStride(self.sizes(), self.strides(), shape);
  TORCH_CHECK(st.has_value(),
              "view size is not compatible with input tensor's size and stride (at least one "
              "dimension spans across two contiguous subspaces). Use .reshape(...) instead.");
  return make_view(self, shape, *st, self.storage_offset(), Step{VIEW, {IValue(size.vec())}});
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return make_view(self, size, stride, self.storage_offset(),
                   Step{RESHAPE_ALIAS, {IValue(size.vec()), IValue(stride.vec())}});
}

at::Tensor transpose_(const at::Tensor& self, int64_t d0, int64_t d1, Step step) {
  int64_t n = self.dim();
  if (n == 0) return make_view(self, self.sizes(), self.strides(), self.storage_offset(), std::move(step));
  d0 = wrap_dim(d0, n);
  d1 = wrap_dim(d1, n);
  IntVec size = self.sizes().vec(), stride = self.strides().vec();
  std::swap(size[d0], size[d1]);
  std::swap(stride[d0], stride[d1]);
  return make_view(self, size, stride, self.storage_offset(), std::move(step));
}

at::Tensor transpose(const at::Tensor& self, int64_t d0, int64_t d1) {
  return transpose_(self, d0, d1, Step{TRANSPOSE, {IValue(d0), IValue(d1)}});
}

at::Tensor t(const at::Tensor& self) {
  TORCH_CHECK(self.dim() <= 2, "t() expects a tensor with <= 2 dimensions, but self is ", self.dim(), "D");
  return transpose_(self, 0, self.dim() < 2 ? 0 : 1, Step{T, {}});
}

at::Tensor permute(const at::Tensor& self, c10::IntArrayRef dims) {
  int64_t n = self.dim();
  TORCH_CHECK(static_cast<int64_t>(dims.size()) == n,
              "permute(sparse_coo): number of dimensions in the tensor input does not match the "
              "length of the desired ordering of dimensions i.e. input.dim() = ", n,
              " is not equal to len(dims) = ", dims.size());
  IntVec size(n), stride(n);
  std::vector<bool> seen(n, false);
  for (int64_t i = 0; i < n; ++i) {
    int64_t d = wrap_dim(dims[i], n);
    TORCH_CHECK(!seen[d], "permute(): duplicate dims are not allowed.");
    seen[d] = true;
    size[i] = self.size(d);
    stride[i] = self.stride(d);
  }
  return make_view(self, size, stride, self.storage_offset(), Step{PERMUTE, {IValue(dims.vec())}});
}

at::Tensor slice(const at::Tensor& self, int64_t dim, std::optional<int64_t> start,
                 std::optional<int64_t> end, int64_t step) {
  int64_t n = self.dim();
  TORCH_CHECK(n > 0, "slice() cannot be applied to a 0-dim tensor.");
  dim = wrap_dim(dim, n);
  TORCH_CHECK(step > 0, "slice step must be positive");
  int64_t len = self.size(dim);
  int64_t s = start.value_or(0), e = end.value_or(INT64_MAX);
  if (s < 0) s += len;
  if (e < 0) e += len;
  s = std::min(std::max<int64_t>(s, 0), len);
  e = std::min(std::max(e, s), len);
  IntVec size = self.sizes().vec(), stride = self.strides().vec();
  size[dim] = (e - s + step - 1) / step;
  stride[dim] *= step;
  Step st{SLICE, {IValue(dim), start.has_value() ? IValue(*start) : IValue(),
                  end.has_value() ? IValue(*end) : IValue(), IValue(step)}};
  st.len = size[dim];
  if (st.len != 0 && !(s == 0 && e == len)) st.win = s;  // NOTE [C++ moving windows]
  return make_view(self, size, stride, self.storage_offset() + s * self.stride(dim), std::move(st));
}

at::Tensor select(const at::Tensor& self, int64_t dim, int64_t index) {
  int64_t n = self.dim();
  TORCH_CHECK_INDEX(n > 0, "select() cannot be applied to a 0-dim tensor.");
  dim = wrap_dim(dim, n);
  int64_t len = self.size(dim);
  TORCH_CHECK_INDEX(index >= -len && index < len, "select(): index ", index,
                    " out of range for tensor of size ", self.sizes(), " at dimension ", dim);
  int64_t i = index < 0 ? index + len : index;
  IntVec size = self.sizes().vec(), stride = self.strides().vec();
  size.erase(size.begin() + dim);
  stride.erase(stride.begin() + dim);
  Step st{SELECT, {IValue(dim), IValue(index)}};
  if (len > 1) st.win = i;  // NOTE [C++ moving windows]
  return make_view(self, size, stride, self.storage_offset() + i * self.stride(dim), std::move(st));
}

at::Tensor expand(const at::Tensor& self, c10::IntArrayRef size, bool implicit) {
  TORCH_CHECK(static_cast<int64_t>(size.size()) >= self.dim(),
              "expand(", self.toString(), "{", self.sizes(), "}, size=", size,
              "): the number of sizes provided (", size.size(), ") ",
              "must be greater or equal to the number of dimensions in the tensor (", self.dim(), ")");
  auto [sz, st] = at::inferExpandGeometry_dimvector(self.sizes(), self.strides(), size);
  return make_view(self, sz, st, self.storage_offset(), Step{EXPAND, {IValue(size.vec())}});
}

at::Tensor unsqueeze(const at::Tensor& self, int64_t dim) {
  int64_t n = self.dim();
  dim = c10::maybe_wrap_dim(dim, n + 1);
  IntVec size = self.sizes().vec(), stride = self.strides().vec();
  int64_t st = dim >= n ? 1 : size[dim] * stride[dim];
  size.insert(size.begin() + dim, 1);
  stride.insert(stride.begin() + dim, st);
  return make_view(self, size, stride, self.storage_offset(), Step{UNSQUEEZE, {IValue(dim)}});
}

at::Tensor squeeze_(const at::Tensor& self, std::vector<bool> drop, Step step) {
  IntVec size, stride;
  for (int64_t i = 0; i < self.dim(); ++i) {
    if (drop[i] && self.size(i) == 1) continue;
    size.push_back(self.size(i));
    stride.push_back(self.stride(i));
  }
  return make_view(self, size, stride, self.storage_offset(), std::move(step));
}

at::Tensor squeeze(const at::Tensor& self) {
  return squeeze_(self, std::vector<bool>(self.dim(), true), Step{SQUEEZE, {}});
}

at::Tensor squeeze_dim(const at::Tensor& self, int64_t dim) {
  std::vector<bool> drop(self.dim(), false);
  if (self.dim() > 0) drop[wrap_dim(dim, self.dim())] = true;
  else wrap_dim(dim, 0);
  return squeeze_(self, drop, Step{SQUEEZE_DIM, {IValue(dim)}});
}

at::Tensor squeeze_dims(const at::Tensor& self, c10::IntArrayRef dims) {
  std::vector<bool> drop(self.dim(), false);
  for (auto d : dims) {
    if (self.dim() > 0) drop[wrap_dim(d, self.dim())] = true;
    else wrap_dim(d, 0);
  }
  return squeeze_(self, drop, Step{SQUEEZE_DIMS, {IValue(dims.vec())}});
}

// A conjugate view is a step of the chain, its conj bit off, as the Python view path makes it:
// with the bit on, PyTorch's Conjugate fallback materialised it by a copy that reached the same
// fallback again, without end.
at::Tensor conj_view(const at::Tensor& self) {
  return make_view(self, self.sizes(), self.strides(), self.storage_offset(), Step{CONJ, {}});
}

// NOTE [fake plain tensors]: Dynamo and AOTAutograd trace plain tensors as fake tensors whose
// dispatch keys are tpu's (FakeTensor: `_make_subclass(..., dispatch_device=True)`), and that
// constructor detaches its meta element outside the fake mode, so the detach reaches this kernel.
// With dynamic shapes its sizes are symbolic, which `storage_offset()` refuses: such a tensor is
// aliased by PyTorch's own kernel (symbolic sizes and strides, as CUDA's detach does it).
at::Tensor alias(const at::Tensor& self) {
  if (self.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return at::native::alias(self);
  return make_view(self, self.sizes(), self.strides(), self.storage_offset(), std::nullopt);
}

// NOTE [in-place views]: `squeeze_`, `unsqueeze_`, `t_`, `transpose_`, `as_strided_` change the
// tensor itself (at::matmul ends a vector-matrix product with `squeeze_(0)`). Each is the out-of-
// place view kernel's result moved into `self`: its sizes, strides, offset and chain (a fresh
// ViewMeta; one a detach() copy shares is not touched). Through the router they changed only the
// op path's wrapper and the plain tensor kept its old shape.
void become(const at::Tensor& self, const at::Tensor& v) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(v.sizes(), v.strides(), v.storage_offset());
  impl->set_backend_meta(v.unsafeGetTensorImpl()->get_backend_meta_intrusive_ptr());
}

at::Tensor& squeeze_inplace(at::Tensor& self) { become(self, ::squeeze(self)); return self; }
at::Tensor& squeeze_dim_inplace(at::Tensor& self, int64_t dim) {
  become(self, ::squeeze_dim(self, dim));
  return self;
}
at::Tensor& squeeze_dims_inplace(at::Tensor& self, c10::IntArrayRef dims) {
  become(self, ::squeeze_dims(self, dims));
  return self;
}
at::Tensor& unsqueeze_inplace(at::Tensor& self, int64_t dim) {
  become(self, ::unsqueeze(self, dim));
  return self;
}
at::Tensor& t_inplace(at::Tensor& self) { become(self, ::t(self)); return self; }
at::Tensor& transpose_inplace(at::Tensor& self, int64_t d0, int64_t d1) {
  become(self, ::transpose(self, d0, d1));
  return self;
}
const at::Tensor& as_strided_inplace(const at::Tensor& self, c10::IntArrayRef size,
                                     c10::IntArrayRef stride, std::optional<int64_t> offset) {
  become(self, ::as_strided(self, size, stride, offset));
  return self;
}

// NOTE [plain storage hooks]: what the storage kernels ask of Python (deferfuse/plain.py sets them
// at install): `grow(Storage, n)`, a new Storage of n elements holding the old one's first (the
// op path's cat, as specials.resize grows a TpuTensor's), and `freed(Storage, bool)`, which drops
// or re-creates the value when untyped_storage().resize_ frees or restores the storage (FSDP2;
// NOTE [storage resize] in storage.py).
struct StorageHooks {
  PyObject* grow = nullptr;
  PyObject* freed = nullptr;
};

StorageHooks& storage_hooks() {
  static StorageHooks* h = new StorageHooks();
  return *h;
}

// Calls a Python hook; its exception is raised as it was (type and message), as the fallback's.
py::object call_hook(PyObject* fn, py::object a, py::object b) {
  TORCH_CHECK(fn != nullptr, "deferfuse's plain tpu tensor is not installed");
  try {
    return py::reinterpret_borrow<py::object>(fn)(a, b);
  } catch (py::error_already_set& e) {
    e.restore();
    rethrow_python();
  }
}

// A new storage holding Storage `st` (a Python object), base of `bytes` bytes, 1-D of `n` elements.
void replace_storage(const c10::Storage& storage, StorageCtx* old, py::object st, int64_t n, size_t bytes) {
  c10::DataPtr dp = allocator().allocate(bytes);
  auto* ctx = static_cast<StorageCtx*>(dp.get_context());
  ctx->size.assign({n});
  ctx->stride.assign({1});
  ctx->dtype = old->dtype;
  ctx->known = true;
  ctx->storage = st.release().ptr();
  auto* impl = storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(std::move(dp));
  impl->set_nbytes(bytes);
}

// After a tensor's geometry was set over its storage: its storage's base (no ViewMeta), or one
// as_strided step of it.
void set_strided_meta(const at::Tensor& self, const StorageCtx* ctx) {
  auto* impl = self.unsafeGetTensorImpl();
  int64_t off = self.storage_offset();
  bool base = ctx->known && off == 0 && self.sizes() == c10::IntArrayRef(ctx->size) &&
              self.strides() == c10::IntArrayRef(ctx->stride);
  if (base) {
    impl->set_backend_meta(c10::intrusive_ptr<c10::BackendMeta>());
    return;
  }
  auto m = c10::make_intrusive<ViewMeta>();
  m->steps.push_back(Step{AS_STRIDED, {IValue(self.sizes().vec()), IValue(self.strides().vec()),
                                       IValue(off), IValue(c10::IntArrayRef(ctx->size).vec()),
                                       IValue(c10::IntArrayRef(ctx->stride).vec())}});
  impl->set_backend_meta(m);
}

// set_ (PyTorch's Tensor.set_ overloads): the tensor takes a storage of a plain tpu tensor with a
// geometry over it, its view chain that geometry's (the source tensor's own chain, for
// set_(tensor)). A storage holds values of one dtype here: set_ to another dtype raises.
const StorageCtx* set_checks(const at::Tensor& self, const c10::Storage& source) {
  TORCH_CHECK(source.device_type() == c10::DeviceType::PrivateUse1 &&
              source.data_ptr().get_deleter() == &free_ctx,
              "Attempted to set the storage of a tensor on device \"", self.device(),
              "\" to a storage on different device \"", source.device(),
              "\".  This is no longer allowed; the devices must match.");
  auto* ctx = static_cast<const StorageCtx*>(source.data_ptr().get_context());
  TORCH_CHECK(!ctx->known || ctx->dtype == self.scalar_type(), "set_: a tpu storage holds ",
              c10::toString(ctx->dtype), " values; viewing them as ", self.scalar_type(),
              " is not supported (use .view(dtype) on a tensor instead)");
  return ctx;
}

at::Tensor& set_storage_geometry(at::Tensor& self, c10::Storage source, int64_t off,
                                       c10::IntArrayRef size, c10::IntArrayRef stride) {
  auto* ctx = set_checks(self, source);
  IntVec st;
  if (stride.empty()) {
    auto c = c10::contiguous_strides(size);
    st.assign(c.begin(), c.end());
  } else {
    st = stride.vec();
  }
  TORCH_CHECK(st.size() == size.size(), "mismatch in length of strides and shape");
  int64_t extent = off;
  bool empty = false;
  for (size_t i = 0; i < size.size(); ++i) {
    if (size[i] == 0) empty = true;
    extent += (size[i] - 1) * st[i];
  }
  int64_t item = self.element_size();
  TORCH_CHECK(empty || (extent + 1) * item <= static_cast<int64_t>(source.nbytes()),
              "setStorage: sizes ", size, ", strides ", c10::IntArrayRef(st), ", storage offset ", off,
              ", and itemsize ", item, " requiring a storage size of ", (extent + 1) * item,
              " are out of bounds for storage of size ", source.nbytes());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_sizes_and_strides(size, st, off);
  set_strided_meta(self, ctx);
  return self;
}

at::Tensor& set_storage_whole(at::Tensor& self, c10::Storage source) {
  int64_t n = static_cast<int64_t>(source.nbytes()) / static_cast<int64_t>(self.element_size());
  return set_storage_geometry(self, std::move(source), 0, {n}, {1});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& src) {
  if (self.unsafeGetTensorImpl() == src.unsafeGetTensorImpl()) return self;
  set_checks(self, src.storage());
  TORCH_CHECK(self.scalar_type() == src.scalar_type(), "Could not set tensor of type ",
              self.scalar_type(), " to a tensor of type ", src.scalar_type());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(src.storage());
  impl->set_sizes_and_strides(src.sizes(), src.strides(), src.storage_offset());
  // the source's chain (a ViewMeta is never changed once set: sharing it is safe)
  impl->set_backend_meta(src.unsafeGetTensorImpl()->get_backend_meta_intrusive_ptr());
  return self;
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage st(c10::Storage::use_byte_size_t(), 0, allocator().allocate(0), &allocator(), true);
  auto* ctx = static_cast<StorageCtx*>(st.data_ptr().get_context());
  ctx->size.assign({0});
  ctx->stride.assign({1});
  ctx->dtype = self.scalar_type();
  ctx->known = true;
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(st));
  impl->set_sizes_and_strides(c10::IntArrayRef{0}, c10::IntArrayRef{1}, 0);
  impl->set_backend_meta(c10::intrusive_ptr<c10::BackendMeta>());
  return self;
}

// resize_ (an out= tensor made by `empty({0})`, `x.resize_(n)`), NOTE [resize] in specials.py: a
// size that fits in the storage from the tensor's offset makes it a contiguous as_strided view of
// the same storage (every other view sees the same elements, as on CPU); a larger one takes a new
// storage: empty when the old one holds no value yet (the out= case), else a 1-D base holding the
// old elements first and zeros after (the storage hooks' grow), which only this tensor may hold.
const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> mf) {
  auto* impl = self.unsafeGetTensorImpl();
  auto* ctx = ctx_of(self);
  int64_t off = self.storage_offset();
  IntVec old_size = self.sizes().vec(), old_stride = self.strides().vec();
  impl->set_sizes_contiguous(size);
  if (mf.has_value()) {
    TORCH_CHECK(*mf != c10::MemoryFormat::Preserve, "Unsupported memory format. Preserve");
    impl->empty_tensor_restride(*mf);
  }
  int64_t need = off;
  bool empty = false;
  for (int64_t i = 0; i < self.dim(); ++i) {
    if (self.size(i) == 0) empty = true;
    need += (self.size(i) - 1) * self.stride(i);
  }
  const int64_t item = static_cast<int64_t>(self.element_size());
  need = empty ? 0 : (need + 1) * item;
  const c10::Storage& st = self.storage();  // a reference: a copy would count as a holder
  if (need > static_cast<int64_t>(st.nbytes()) && (ctx->storage != nullptr || ctx->value != nullptr)) {
    if (st.use_count() != 1 || ctx->dtype != self.scalar_type()) {
      impl->set_sizes_and_strides(old_size, old_stride, off);
      TORCH_CHECK(false, "cannot resize a tpu tensor to ", size, ": that needs ", need / item,
                  " elements and its storage holds ", st.nbytes() / item, ", and other tensors "
                  "(views) share that storage; CPU would grow the storage under all of them. "
                  "Allocate a new tensor (torch.empty(size, device='tpu')) instead");
    }
    py::gil_scoped_acquire gil;
    py::object grown;
    try {
      PyObject* have = ctx_storage(ctx);  // NOTE [lazy storages]
      if (have == nullptr) rethrow_python();
      grown = call_hook(storage_hooks().grow, py::reinterpret_borrow<py::object>(have),
                        py::int_(need / item));
    } catch (...) {
      impl->set_sizes_and_strides(old_size, old_stride, off);
      throw;
    }
    replace_storage(st, ctx, std::move(grown), need / item, need);
    ctx = ctx_of(self);
  }
  if (need <= static_cast<int64_t>(st.nbytes())) {
    set_strided_meta(self, ctx);
    return self;
  }
  TORCH_CHECK(off == 0, "cannot resize a tpu tensor at storage offset ", off, " past its storage's "
              "end: it holds no value yet; allocate a new tensor instead");
  st.set_data_ptr_noswap(allocator().allocate(need));
  st.set_nbytes(need);
  impl->set_backend_meta(c10::intrusive_ptr<c10::BackendMeta>());
  remember_base(self);
  return self;
}

// untyped_storage().resize_(n) (the PrivateUse1 hooks' resizePrivateUse1Bytes, _tpu_hooks.cpp):
// NOTE [storage resize] in storage.py: 0 frees the value, the bytes allocated restore an empty one.
void storage_resize(const c10::Storage& storage, size_t n) {
  TORCH_CHECK(storage.data_ptr().get_deleter() == &free_ctx,
              "this tpu storage was not made by deferfuse's allocator");
  auto* ctx = static_cast<StorageCtx*>(storage.data_ptr().get_context());
  if (n == storage.nbytes()) return;
  TORCH_CHECK(n == 0 || n == ctx->cap, "a tpu storage holds one whole tensor of ", ctx->cap,
              " bytes: it can be resized to 0 (freed) or back to ", ctx->cap, " bytes, not ", n);
  if (ctx->storage != nullptr || ctx->value != nullptr) {
    py::gil_scoped_acquire gil;
    PyObject* have = ctx_storage(ctx);  // NOTE [lazy storages]
    if (have == nullptr) rethrow_python();
    call_hook(storage_hooks().freed, py::reinterpret_borrow<py::object>(have), py::bool_(n == 0));
  }
  // a freed storage's data_ptr() is 0, as CPU's and CUDA's (test_distributed's storage resize);
  // the same context stays (it holds the Storage; the DataPtr frees it)
  auto* impl = storage.unsafeGetStorageImpl();
  c10::DataPtr& old = impl->mutable_data_ptr();
  c10::Device dev = old.device();
  old.release_context();  // ownership passes to the DataPtr made next
  impl->set_data_ptr_noswap(c10::DataPtr(n == 0 ? nullptr : static_cast<void*>(ctx), ctx,
                                         &free_ctx, dev));
  impl->set_nbytes(n);
}

// ---------------------------------------------------------------------------------------------
// the boxed fallback: every other op goes to the Python router (deferfuse/plain.py)

struct Router {
  PyObject* route = nullptr;    // route(op, args, kwargs) -> result
  PyObject* resolve = nullptr;  // resolve(qualified name, overload name) -> OpOverload
  std::unordered_map<const void*, PyObject*> ops;  // &schema -> OpOverload (never freed)
  // calls routed per op (&schema -> count; bounded by the op set): `route_stats()`
  std::unordered_map<const c10::FunctionSchema*, int64_t> routed;
};

Router& router() {
  static Router* r = new Router();  // never destroyed: kernels may run while the process exits
  return *r;
}

// NOTE [floor cache]: the floor measurement's C++ path (set_floor(true)): an op whose structure
// (op, each tensor's dtype, sizes and strides, every non-float argument) was seen once returns
// outputs built here from the cached metadata, without calling Python; a miss calls the router
// and caches what it returned. It records nothing: it measures what building outputs in C++
// costs, the floor a C++ recording kernel starts from (bench/cxx_floor.py).
struct OutMeta {
  int input = -1;  // the output is this stack argument (out=, in-place), or -1: a new tensor
  IntVec size, stride;
  c10::ScalarType dtype;
  size_t nbytes = 0;  // the kernel's outputs (NOTE [hit outputs]): the storage's bytes
};

// NOTE [hit outputs]: a kernel hit's new output, made from its Entry's cached metadata as
// `empty_strided` would make it (a StorageCtx through the allocator's DataPtr, a StorageImpl, a
// TensorImpl on the PrivateUse1 key), without what the generic path redoes per call for
// metadata learnt once: the byte count's overflow checks, the sizes' sign check, the device
// scope, remember_base's storage checks and copies from the new tensor; the StorageCtx is filled
// from the metadata, with the output's Storage (`st`, a new reference taken) already in it, or
// (`lazy_value`) its Value, the Storage made on first ask (NOTE [lazy storages]).
at::Tensor new_output(const OutMeta& m, c10::DeviceIndex dev, PyObject* st, bool lazy_value) {
  auto* ctx = new StorageCtx();
  ctx->cap = m.nbytes;
  ctx->size.assign(m.size.begin(), m.size.end());
  ctx->stride.assign(m.stride.begin(), m.stride.end());
  ctx->dtype = m.dtype;
  ctx->known = true;
  if (lazy_value) {
    set_lazy(ctx, st, dev);  // `st` is the output's Value (NOTE [lazy storages])
  } else {
    ctx->storage = Py_NewRef(st);
  }
  const c10::Device d(c10::DeviceType::PrivateUse1, dev);
  auto storage = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), m.nbytes, c10::DataPtr(ctx, ctx, &free_ctx, d),
      &allocator(), /*resizable=*/true);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(std::move(storage)), tpu_keys(),
                                                   c10::scalarTypeToTypeMeta(m.dtype));
  impl->set_sizes_and_strides(m.size, m.stride);
  return at::Tensor(std::move(impl));
}

using FloorKey = std::vector<int64_t>;

struct FloorKeyHash {
  size_t operator()(const FloorKey& k) const {
    size_t h = k.size();
    for (auto v : k) h ^= static_cast<size_t>(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
  }
};

struct FloorCache {
  bool on = false;
  std::mutex mu;
  std::unordered_map<FloorKey, std::vector<OutMeta>, FloorKeyHash> entries;
  int64_t hits = 0, misses = 0;
};

FloorCache& floor_cache() {
  static FloorCache* f = new FloorCache();
  return *f;
}

void key_tensor(FloorKey& k, const at::Tensor& t) {
  if (!t.defined()) { k.push_back(2); return; }
  k.push_back(1);
  k.push_back(static_cast<int64_t>(t.scalar_type()));
  k.push_back(t.device().type() == c10::DeviceType::PrivateUse1 ? t.device().index() : -1);
  k.push_back(t.dim());
  for (auto s : t.sizes()) k.push_back(s);
  for (auto s : t.strides()) k.push_back(s);
}

// Appends one argument's part of the key; false: an argument the floor does not key (not cached).
bool key_add(FloorKey& k, const IValue& v) {
  if (v.isTensor()) {
    key_tensor(k, v.toTensor());
  } else if (v.isNone()) {
    k.push_back(3);
  } else if (v.isDouble()) {
    k.push_back(4);  // a runtime input: its value is never part of a structure
  } else if (v.isInt()) {
    k.push_back(5);
    k.push_back(v.toInt());
  } else if (v.isBool()) {
    k.push_back(6);
    k.push_back(v.toBool());
  } else if (v.isIntList()) {
    k.push_back(7);
    auto l = v.toIntList();
    k.push_back(static_cast<int64_t>(l.size()));
    for (int64_t x : l) k.push_back(x);
  } else if (v.isTensorList()) {
    k.push_back(8);
    auto l = v.toTensorList();
    k.push_back(static_cast<int64_t>(l.size()));
    for (const at::Tensor& t : l) key_tensor(k, t);
  } else if (v.isDevice()) {
    k.push_back(9);
    k.push_back(static_cast<int64_t>(v.toDevice().type()));
    k.push_back(v.toDevice().index());
  } else {
    return false;
  }
  return true;
}

// Builds `key`; true when the op was found and its outputs are on the stack.
bool floor_hit(const c10::OperatorHandle& op, torch::jit::Stack* stack, FloorKey& key) {
  auto& fc = floor_cache();
  const auto n = op.schema().arguments().size();
  key.push_back(reinterpret_cast<int64_t>(&op.schema()));
  for (size_t i = stack->size() - n; i < stack->size(); ++i) {
    if (!key_add(key, (*stack)[i])) {
      key.clear();
      return false;
    }
  }
  const std::vector<OutMeta>* e = nullptr;
  {
    std::lock_guard<std::mutex> g(fc.mu);
    auto it = fc.entries.find(key);
    if (it == fc.entries.end()) { ++fc.misses; return false; }
    e = &it->second;  // entries are never erased while the floor is on
    ++fc.hits;
  }
  const size_t first = stack->size() - n;
  std::vector<IValue> outs;
  outs.reserve(e->size());
  for (const auto& m : *e) {
    if (m.input >= 0) {
      outs.push_back((*stack)[first + m.input]);
    } else {
      at::Tensor t = at::detail::empty_strided_generic(m.size, m.stride, &allocator(), tpu_keys(), m.dtype);
      remember_base(t);
      outs.push_back(std::move(t));
    }
  }
  torch::jit::drop(*stack, n);
  for (auto& o : outs) stack->push_back(std::move(o));
  return true;
}

void floor_store(const FloorKey& key, const std::vector<IValue>& args, const torch::jit::Stack& stack,
                 size_t nret) {
  std::vector<OutMeta> metas;
  for (size_t r = stack.size() - nret; r < stack.size(); ++r) {
    const auto& v = stack[r];
    if (!v.isTensor()) return;  // lists, scalars: not cached
    const auto& t = v.toTensor();
    OutMeta m;
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].isTensor() && args[i].toTensor().defined() &&
          args[i].toTensor().unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
        m.input = static_cast<int>(i);
        break;
      }
    }
    if (m.input < 0) {
      if (t.device().type() != c10::DeviceType::PrivateUse1 || meta_of(t) != nullptr ||
          t.storage_offset() != 0)
        return;  // views and CPU results: not cached
      m.size = t.sizes().vec();
      m.stride = t.strides().vec();
      m.dtype = t.scalar_type();
    }
    metas.push_back(std::move(m));
  }
  auto& fc = floor_cache();
  std::lock_guard<std::mutex> g(fc.mu);
  fc.entries.emplace(key, std::move(metas));
}

// ---------------------------------------------------------------------------------------------
// NOTE [C++ signatures]: a plain tensor's signature (what of it shapes compiled code: its
// storage's base sizes, strides and dtype, its C++ view steps, its own sizes, strides, offset and
// dtype) is an int, interned in one table (`sigs()`; Python reads a description back with
// `sig_desc`, and the router maps it to the op path's `_sig` with one dict lookup, never hashing
// a tuple per op). A base tensor's id is cached in its StorageCtx (reset when the base geometry
// is set again); a view's is looked up from its description. A tensor with Python view steps
// (`py_chain`) or PyTorch's own alias of a storage has none (-1): the kernel leaves its ops to the
// router. Ids are never reused: the table is bounded, and a full table starts a new generation of
// ids (old ids stay unique, their descriptions are forgotten).
using Key = std::vector<int64_t>;

struct SigTable {
  std::unordered_map<Key, int64_t, FloorKeyHash> ids;
  std::vector<Key> descs;  // descs[id - first]
  int64_t first = 0;
  size_t limit = 1 << 18;
  int64_t generations = 0;
};

SigTable& sigs() {
  static SigTable* t = new SigTable();  // guarded by the GIL (every caller holds it)
  return *t;
}

int64_t intern_sig(Key&& d) {
  auto& t = sigs();
  auto it = t.ids.find(d);
  if (it != t.ids.end()) return it->second;
  if (t.descs.size() >= t.limit) {
    t.first += static_cast<int64_t>(t.descs.size());
    t.ids.clear();
    t.descs.clear();
    ++t.generations;
  }
  int64_t id = t.first + static_cast<int64_t>(t.descs.size());
  t.descs.push_back(d);
  t.ids.emplace(std::move(d), id);
  return id;
}

// An int, None, bool or int list (a view step's argument); false for anything else. K: a Key or a
// call's CallKey.
template <class K>
bool key_static(K& k, const IValue& v) {
  if (v.isNone()) {
    k.push_back(-101);
  } else if (v.isInt()) {
    k.push_back(-102);
    k.push_back(v.toInt());
  } else if (v.isBool()) {
    k.push_back(-103);
    k.push_back(v.toBool());
  } else if (v.isIntList()) {
    auto l = v.toIntList();
    k.push_back(-104);
    k.push_back(static_cast<int64_t>(l.size()));
    for (int64_t x : l) k.push_back(x);
  } else {
    return false;
  }
  return true;
}

template <class K>
void key_geom(K& k, c10::ScalarType dtype, c10::IntArrayRef size, c10::IntArrayRef stride) {
  k.push_back(static_cast<int64_t>(dtype));
  k.push_back(static_cast<int64_t>(size.size()));
  k.insert(k.end(), size.begin(), size.end());
  k.insert(k.end(), stride.begin(), stride.end());
}

// The signature id of a plain tensor, or -1, from its StorageCtx and ViewMeta (the caller checked
// is_plain and read both).
int64_t sig_of(const at::Tensor& t, StorageCtx* ctx, const ViewMeta* m) {
  if (!ctx->known) return -1;
  if (m == nullptr) {
    if (t.storage_offset() != 0 || t.scalar_type() != ctx->dtype ||
        t.sizes() != c10::IntArrayRef(ctx->size) || t.strides() != c10::IntArrayRef(ctx->stride))
      return -1;  // PyTorch's own alias of the storage
    if (ctx->sig < 0) {
      Key d;
      key_geom(d, ctx->dtype, ctx->size, ctx->stride);
      d.push_back(0);  // no steps
      key_geom(d, t.scalar_type(), t.sizes(), t.strides());
      d.push_back(0);
      ctx->sig = intern_sig(std::move(d));
    }
    return ctx->sig;
  }
  if (m->py_chain != nullptr) return -1;
  Key d;
  key_geom(d, ctx->dtype, ctx->size, ctx->stride);
  d.push_back(static_cast<int64_t>(m->steps.size()));
  for (const auto& s : m->steps) {
    d.push_back(s.op);
    d.push_back(static_cast<int64_t>(s.args.size()));
    for (const auto& a : s.args)
      if (!key_static(d, a)) return -1;
  }
  key_geom(d, t.scalar_type(), t.sizes(), t.strides());
  d.push_back(t.storage_offset());
  return intern_sig(std::move(d));
}

// The signature id of a plain tensor, or -1 (the caller checked is_plain).
int64_t sig_of(const at::Tensor& t) {
  return sig_of(t, static_cast<StorageCtx*>(t.storage().data_ptr().get_context()), meta_of(t));
}

// NOTE [C++ moving windows]: a view whose chain moves a window over its input (a slice that is
// not the whole dimension, a select of a dimension longer than 1, an as_strided with its storage
// offset: the op path's DSLICE / DSELECT / DSTRIDED rule, views._moving_view, which
// plain.Plain._moving replays for the router) has a second id for the kernel's key: its
// description with each moving step's start (and the tensor's own storage offset) left out, the
// starts appended to `offs` in chain order instead. The kernel keys an op on such a view by that
// id, so `buf[i]`, `t[i:i + 5]` at every `i` are one key, and hands the starts to the C record
// path as int inputs after the op's own scalars, as dispatch._run does with a TpuTensor's `_dyn`
// (NOTE [dynamic offsets] in runtime/viewchain.py). `Plain.learn` returns the op path's `_dyn` of
// each input, which must equal these starts, or the key is refused. -1 (nothing appended): no
// step moves, or a step cannot be keyed.
int64_t window_sig_of(const at::Tensor& t, const StorageCtx* ctx, const ViewMeta& m,
                      std::vector<int64_t>& offs) {
  if (!ctx->known || m.py_chain != nullptr) return -1;
  const size_t n0 = offs.size();
  Key d;
  d.reserve(48);
  d.push_back(-400);  // never a full description's first item (a dtype)
  key_geom(d, ctx->dtype, ctx->size, ctx->stride);
  d.push_back(static_cast<int64_t>(m.steps.size()));
  for (const auto& s : m.steps) {
    d.push_back(s.op);
    int64_t w = s.win;
    if (s.op == AS_STRIDED && s.args.size() == 5 && s.args[0].isIntList() && s.args[2].isInt()) {
      // views._moving_strided: an explicit offset (the C++ step always has one), no empty size
      w = s.args[2].toInt();
      for (int64_t x : s.args[0].toIntList())
        if (x == 0) w = -1;
    }
    bool ok = true;
    if (w >= 0) {
      offs.push_back(w);
      d.push_back(-300);
      if (s.op == SLICE) {
        ok = key_static(d, s.args[0]) && key_static(d, s.args[3]);
        d.push_back(s.len);
      } else if (s.op == SELECT) {
        ok = key_static(d, s.args[0]);
      } else {
        ok = key_static(d, s.args[0]) && key_static(d, s.args[1]) && key_static(d, s.args[3]) &&
             key_static(d, s.args[4]);
      }
    } else {
      d.push_back(static_cast<int64_t>(s.args.size()));
      for (const auto& a : s.args) ok = ok && key_static(d, a);
    }
    if (!ok) {
      offs.resize(n0);
      return -1;
    }
  }
  if (offs.size() == n0) return -1;
  key_geom(d, t.scalar_type(), t.sizes(), t.strides());
  d.push_back(-301);  // its storage offset: a function of the starts
  return intern_sig(std::move(d));
}

// ---------------------------------------------------------------------------------------------
// NOTE [C++ recording kernel]: the boxed fallback's fast path. For an op call it can key, it
// builds the op's key in C++ over the stack (the op's schema address; each tensor's signature id
// and the device; every argument but the Python numbers that are runtime inputs, whose type only
// is in the key, as dispatch.op_key makes them (SS); a structured op's fresh out= tensor as a
// marker), finds the op cache's Entry in its own table, hands the inputs' Values and the scalars
// to the C record path (`_fastpath.record_storages`: Trace.record's node, no Python frame) and
// makes the outputs here: new plain tensors from the cached metadata, or the fresh out= tensor,
// whose storage takes the new Storage (NOTE [fresh out] in plain.py).
//
// The table is filled from Python: on an op's first call `Plain.plan` says whether the kernel
// may take it at all (its route is dispatch._run; no write but a fresh out=; no random draw) and
// which arguments' numbers are runtime inputs (OpInfo.scalar_pos/scalar_kw, none for a static
// lowering); on a key's first call the router runs the op and `Plain.learn` finds the Entry the
// op path used for the same arguments (dispatch.op_key over the wrappers) and checks its output
// metadata against what the router returned (or refuses: the key then always goes to the router).
// The C++ key is at least as fine as dispatch.op_key (it keeps every int, bool, list and string,
// each tensor's whole geometry and view steps), so two calls with one C++ key have one Python key:
// the learnt Entry is the one the Python path would find. Anything else goes to the router
// unchanged: a key it cannot build (a CPU tensor, a Python view step, a device other than the
// call's tpu, a generator, complex numbers ...; a list of numbers at a scalar position is keyed
// as its numbers), an
// in-place foreach call whose written storages are read elsewhere (NOTE [C++ foreach]), debug
// mode, a cut due, an input pending in another trace, an op writing its inputs in strict mode.
//
// NOTE [C++ strict hits]: in strict mode a hit of an op with new outputs is run now, not recorded:
// `Plain.run_hit` runs the learnt Entry (`engine.run_node`, what dispatch._run does in strict
// mode) and returns the outputs' Storages, which the kernel gives to the tensors it makes, as
// for a recorded hit. No router, no TpuTensor: on the router, strict mode paid the wrapping of
// every argument and result on top of the wrapper subclass's op path. Any error (a failed input)
// makes it return NotImplemented before anything is bound, and the router runs the op again, so
// errors are raised by the op path as before; debug mode and ops writing their inputs are routed. All of it runs under the GIL, which guards
// the tables. Bounded: a full table is cleared (counted); the engine's eviction of per-op programs
// clears it too (plain.install).
struct Plan {
  bool ok = false;
  size_t h0 = 0;             // the key's hash after its first word, the op (NOTE [call keys])
  int out = -1;              // the stack index of a written `out` (a fresh one is taken), or -1
  std::vector<char> scalar;  // per argument: a Python number there is a runtime input
  // NOTE [C++ foreach]: an in-place foreach op (route._foreach): each call is checked for
  // written storages read elsewhere (foreach_overlaps) before its key is used
  bool foreach = false;
  // NOTE [fresh outs] in plain.py: the stack indexes of a structured op's several out= tensors
  // (nll_loss_forward.output), taken as fresh when every one is
  std::vector<int> outs;
  // NOTE [C++ value checks]: a meta check of a runtime number's value, made per call
  int check = 0, check_a = -1, check_b = -1;
};

// NOTE [C++ value checks]: a structured op's C++ meta function may check a Python number's value,
// and numbers at scalar positions are runtime inputs (their type in the key, never their value),
// so a hit learnt with one value would record another unchecked. `Plain.plan` names such a check
// (plain._VALUE_CHECKS) and the kernel makes it on every call, before the key: a call it refuses
// goes to the router, which raises PyTorch's error. 1: pow.Tensor_Scalar's "Integers to negative
// integer powers" (an integral base, `check_a` the exponent); 2: the in-place backward of
// leaky_relu/elu with a negative slope (`check_a` the number, `check_b` the bool that says the
// saved tensor is the result).
bool value_refused(const Plan& p, const torch::jit::Stack& stack, size_t n) {
  const size_t first = stack.size() - n;
  if (p.check == 1) {
    const IValue& b = stack[first];
    const IValue& e = stack[first + p.check_a];
    return b.isTensor() && b.toTensor().defined() &&
           c10::isIntegralType(b.toTensor().scalar_type(), /*includeBool=*/true) && e.isInt() &&
           e.toInt() < 0;
  }
  if (p.check == 2) {
    const IValue& v = stack[first + p.check_a];
    const IValue& f = stack[first + p.check_b];
    const double d = v.isDouble() ? v.toDouble() : v.isInt() ? static_cast<double>(v.toInt()) : 0.0;
    return f.isBool() && f.toBool() && d < 0.0;
  }
  return false;
}

// NOTE [call keys]: a call's key is built per call in a small vector on the stack (CallKey: no
// allocation for keys of up to 32 words; a Key is made of it only when the table learns it), and
// hashed once, in one pass from its op's precomputed start (Plan::h0), where the table would
// hash it again; the table finds it by that hash and compares the words (a hash is a bucket,
// equality decides). The stack, not one scratch key per Kernel: a hit's record and a miss's
// router run Python, which may call another op (a finaliser, a hook) through this kernel.
using CallKey = c10::SmallVector<int64_t, 32>;

constexpr size_t kKeySeed = 0x243f6a8885a308d3ULL;
inline size_t key_mix(size_t h, int64_t v) {
  h ^= static_cast<size_t>(v);
  h *= 0x9e3779b97f4a7c15ULL;
  return h ^ (h >> 29);
}
inline size_t key_hash(const int64_t* p, size_t n, size_t h = kKeySeed) {
  for (size_t i = 0; i < n; ++i) h = key_mix(h, p[i]);
  return h;
}

struct KeyView {
  const int64_t* p;
  size_t n, h;
};

struct CallKeyHash {
  using is_transparent = void;
  size_t operator()(const Key& k) const { return key_hash(k.data(), k.size()); }
  size_t operator()(const KeyView& k) const { return k.h; }
};

struct CallKeyEq {
  using is_transparent = void;
  static bool same(const int64_t* a, size_t na, const int64_t* b, size_t nb) {
    return na == nb && std::equal(a, a + na, b);
  }
  bool operator()(const Key& a, const Key& b) const { return a == b; }
  bool operator()(const KeyView& a, const Key& b) const { return same(a.p, a.n, b.data(), b.size()); }
  bool operator()(const Key& a, const KeyView& b) const { return same(a.data(), a.size(), b.p, b.n); }
};

struct KEntry {
  PyObject* entry = nullptr;  // dispatch.Entry (owned), or null: refused, the router always
  std::vector<OutMeta> outs;  // new outputs (Entry.fast), or none: an op writing its inputs
  std::vector<char> undefined;  // per new output: None (an output_mask False), an undefined tensor
  bool list_out = false;      // the op returns one Tensor[] (_foreach_sqrt): the outputs as a list
  size_t n_tensors = 0, n_scalars = 0;
  PyObject* mut = nullptr;    // an op writing its inputs: Entry.out[1] (owned), the written inputs
  std::vector<int> mut_idx;   // the same, as ints
  bool overwrites = false;    // OpInfo.overwrites: a written base input is not read
  int ret = -1;               // the stack index of the argument it returns
};

struct Kernel {
  bool on = true;
  PyObject* plan_fn = nullptr;    // Plain.plan(op) -> (out index, [runtime number?]) or None
  PyObject* learn_fn = nullptr;   // Plain.learn(op, args, kwargs, fresh, result) -> tuple or None
  PyObject* record_fn = nullptr;  // _fastpath.record_storages(entry, ins, scalars, dev)
  // NOTE [C++ node hand-over] in _fastpath.c: record_storages' body without its Python call, or
  // null (then record_fn)
  PyObject* (*record_c)(PyObject*, PyObject*, PyObject*, long, PyObject*, PyObject*, int) = nullptr;
  PyObject* record_capi = nullptr;  // the capsule, owned: keeps _fastpath's table alive
  PyObject* val_str = nullptr;    // "val"
  // Storage.val read at its slot (val_slot's note): the Storage class and the slot's offset
  PyTypeObject* val_type = nullptr;
  Py_ssize_t val_off = -1;
  PyObject* storage_fn = nullptr; // Plain.storage(p): an `empty` tensor's Storage, made on first use
  PyObject* strict_fn = nullptr;  // Plain.run_hit(entry, ins, scalars, dev), NOTE [C++ strict hits]
  std::unordered_map<const void*, Plan> plans;  // bounded by the op set
  std::unordered_map<Key, KEntry, CallKeyHash, CallKeyEq> entries;  // NOTE [call keys]
  size_t limit = 1 << 16;
  int64_t hits = 0, misses = 0, learned = 0, refused = 0, passed = 0, unkeyed = 0, clears = 0;
  int64_t why[3] = {0, 0, 0};
  int64_t overlaps = 0;           // foreach calls routed for a written storage read elsewhere
  int64_t strict_hits = 0;        // hits run now, in strict mode (NOTE [C++ strict hits]), of `hits`
  int64_t value_refused = 0;      // calls routed by NOTE [C++ value checks], of `unkeyed`
  bool debug = std::getenv("DEFERFUSE_KERNEL_DEBUG") != nullptr;  // refusals to stderr  // passed because: out= geometry, no Storage, the C record path said no
};

Kernel& kernel() {
  static Kernel* k = new Kernel();  // never destroyed (kernels may run while the process exits)
  return *k;
}

void kernel_clear() {
  auto& K = kernel();
  for (auto& kv : K.entries) {
    Py_XDECREF(kv.second.entry);
    Py_XDECREF(kv.second.mut);
  }
  K.entries.clear();
}

// One call's key and what a hit needs of it. Small vectors: a hit's few inputs, scalars and fresh
// outputs allocate nothing (bench/results/cxx-hit-parts-1207.md: the key and its vectors were
// ~10% of a hit).
struct Call {
  CallKey key;                      // NOTE [call keys]
  size_t hash = 0;                  // its hash, set by build_key
  KeyView view() const { return {key.data(), key.size(), hash}; }
  Key owned() const { return Key(key.begin(), key.end()); }
  // NOTE [call tensors]: the tensor inputs, in dispatch.op_key's order, and the fresh out=
  // tensors, as addresses of the tensors in the call's stack (or in a list there): no reference
  // count taken and dropped per tensor. They are valid until the stack's arguments are dropped:
  // a hit reads them before it drops them; a miss's router drops them, so the learn reads its
  // own Call built over the copied arguments (kernel_learn), and of this one its key only.
  c10::SmallVector<const at::Tensor*, 4> tensors;
  c10::SmallVector<IValue, 4> scalars;      // runtime numbers (double or int), in its order
  std::vector<int64_t> offs;        // moving windows' starts, in tensor order (NOTE [C++ moving windows])
  std::vector<std::pair<size_t, size_t>> moving;  // (tensor input, how many starts): empty, so
                                                  // allocating nothing, for calls without windows
  int64_t dev = -1;
  c10::SmallVector<const at::Tensor*, 2> fresh;  // the fresh out= tensors (NOTE [fresh out], [fresh outs]), or none
};

bool special_double(double d) { return d == 0 || d == 1 || d == -1 || d == 2 || d == 0.5; }
bool special_int(int64_t i) { return i == 0 || i == 1 || i == -1 || i == 2; }

// `t` is a tensor of the call's stack (or of a list there): the Call keeps its address (NOTE
// [call tensors]). Its storage and StorageCtx are read once, for the plain check and the signature.
bool key_tensor_sig(Call& c, const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->device_type() != c10::DeviceType::PrivateUse1 || !impl->has_storage()) return false;
  const c10::DataPtr& dp = impl->unsafe_storage().data_ptr();
  if (dp.get_deleter() != &free_ctx) return false;
  auto* ctx = static_cast<StorageCtx*>(dp.get_context());
  const ViewMeta* m = meta_of(t);
  const size_t n0 = c.offs.size();
  int64_t s = m == nullptr ? -1 : window_sig_of(t, ctx, *m, c.offs);
  const bool moves = s >= 0;
  if (!moves) s = sig_of(t, ctx, m);
  if (s < 0) return false;
  int64_t d = t.device().index();
  if (c.dev < 0) c.dev = d;
  else if (c.dev != d) return false;  // the router raises PyTorch's device error
  c.key.push_back(moves ? -2 : -1);
  c.key.push_back(s);
  if (moves) c.moving.emplace_back(c.tensors.size(), c.offs.size() - n0);
  c.tensors.push_back(&t);
  return true;
}

// A number: a runtime input (its type only in the key) at a scalar position unless it is one of
// opkey._SPECIAL_SCALARS, else a constant (its bits in the key).
void key_number(Call& c, const IValue& v, bool scalar) {
  if (v.isDouble()) {
    double d = v.toDouble();
    if (scalar && !special_double(d)) {
      c.key.push_back(-10);
      c.scalars.push_back(v);
    } else {
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      c.key.push_back(-11);
      c.key.push_back(bits);
    }
  } else {
    int64_t i = v.toInt();
    if (scalar && !special_int(i)) {
      c.key.push_back(-12);
      c.scalars.push_back(v);
    } else {
      c.key.push_back(-13);
      c.key.push_back(i);
    }
  }
}

bool key_arg(Call& c, const IValue& v, bool scalar) {
  auto& k = c.key;
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {
      k.push_back(-3);
      return true;
    }
    if (t.unsafeGetTensorImpl()->is_wrapped_number() && t.device().is_cpu()) {
      // the router sees a Python number (torch::jit::toPyObject)
      switch (t.scalar_type()) {
        case c10::ScalarType::Double: key_number(c, IValue(*t.const_data_ptr<double>()), scalar); return true;
        case c10::ScalarType::Long: key_number(c, IValue(*t.const_data_ptr<int64_t>()), scalar); return true;
        case c10::ScalarType::Bool: k.push_back(-14); k.push_back(*t.const_data_ptr<bool>()); return true;
        default: return false;
      }
    }
    return key_tensor_sig(c, t);
  }
  if (v.isDouble() || v.isInt()) {
    key_number(c, v, scalar);
    return true;
  }
  if (v.isBool()) {
    k.push_back(-14);
    k.push_back(v.toBool());
    return true;
  }
  if (v.isNone()) {
    k.push_back(-3);
    return true;
  }
  if (v.isDevice()) {
    // NOTE [C++ factories]: a `device=` argument (a factory's `torch.full(..., device=d)`, a
    // cast's `x.to(dtype, device=x.device)`): a tpu device with its index is the call's device;
    // any other (cpu, another tpu than the tensor inputs', a tpu without an index, which the op
    // path reads as the thread's device) goes to the router
    const c10::Device d = v.toDevice();
    if (d.type() != c10::DeviceType::PrivateUse1 || !d.has_index()) return false;
    if (c.dev < 0) c.dev = d.index();
    else if (c.dev != d.index()) return false;
    k.push_back(-18);
    k.push_back(d.index());
    return true;
  }
  if (scalar && v.isList() && !v.isTensorList()) {
    // a list of numbers at a scalar position (the per-tensor step sizes of foreach optimizers,
    // `Scalar[]`): each number as opkey._encode makes it, a runtime input unless special
    auto l = v.toListRef();
    k.push_back(-17);
    k.push_back(static_cast<int64_t>(l.size()));
    for (const IValue& x : l) {
      if (x.isDouble() || x.isInt()) {
        key_number(c, x, true);
      } else if (x.isBool()) {
        k.push_back(-14);
        k.push_back(x.toBool());
      } else {
        return false;  // complex, tensors ...: the router
      }
    }
    return true;
  }
  if (v.isIntList()) return key_static(k, v);
  if (v.isBoolList()) {
    // a static mask (linear_backward's and native_layer_norm_backward's output_mask, run every
    // training step): Python bools, constants in dispatch.op_key
    if (scalar) return false;
    auto l = v.toBoolList();
    k.push_back(-16);
    k.push_back(static_cast<int64_t>(l.size()));
    for (size_t i = 0; i < l.size(); ++i) k.push_back(l.get(i) ? 1 : 0);
    return true;
  }
  if (v.isTensorList()) {
    // the list's own IValues: their tensors live as long as the stack's list (a List's get()
    // returns a copy, whose address the Call must not keep)
    auto l = v.toListRef();
    k.push_back(-8);
    k.push_back(static_cast<int64_t>(l.size()));
    for (const IValue& x : l)
      if (!key_tensor_sig(c, x.toTensor())) return false;
    return true;
  }
  if (v.isString()) {
    const auto& s = v.toStringRef();
    k.push_back(-15);
    k.push_back(static_cast<int64_t>(s.size()));
    for (char ch : s) k.push_back(ch);
    return true;
  }
  return false;  // a generator, a list of numbers, complex ...: the router
}

// `stack`'s last n values are the call's arguments; `fresh`: the out= tensor is taken as fresh
// whatever it holds now (the key of a call the router just ran, NOTE [C++ recording kernel]).
// A structured op's out= tensor no Python code has seen (NOTE [fresh out]): its storage's base
// itself, as Plain.route asks (a view of a bucket is not fresh), holding no Storage yet.
bool is_fresh(const at::Tensor& o) {
  if (!o.defined() || !is_plain_tensor(o) || meta_of(o) != nullptr || o.storage_offset() != 0)
    return false;
  const StorageCtx* ctx = ctx_of(o);
  return ctx->storage == nullptr && ctx->value == nullptr && ctx->known &&
         o.sizes() == c10::IntArrayRef(ctx->size) &&
         o.strides() == c10::IntArrayRef(ctx->stride);
}

bool build_key(const c10::OperatorHandle& op, const Plan& plan, const torch::jit::Stack& stack,
               size_t n, Call& c, bool fresh = false) {
  c.key.push_back(reinterpret_cast<int64_t>(&op.schema()));
  const size_t first = stack.size() - n;
  // NOTE [fresh outs] in plain.py: several out= tensors are fresh when every one is
  bool all_fresh = !plan.outs.empty();
  for (int i : plan.outs) {
    const IValue& v = stack[first + i];
    if (!v.isTensor() || !v.toTensor().defined() || !is_plain_tensor(v.toTensor())) return false;
    all_fresh = all_fresh && (fresh || is_fresh(v.toTensor()));
  }
  for (size_t i = 0; i < n; ++i) {
    const IValue& v = stack[first + i];
    if (all_fresh && std::find(plan.outs.begin(), plan.outs.end(), static_cast<int>(i)) != plan.outs.end()) {
      c.fresh.push_back(&v.toTensor());
      c.key.push_back(-20);
      continue;
    }
    if (static_cast<int>(i) == plan.out) {
      // a structured op's out= tensor no Python code has seen (NOTE [fresh out])
      if (!v.isTensor()) return false;
      const at::Tensor& o = v.toTensor();
      if (!o.defined() || !is_plain_tensor(o)) return false;
      if (fresh || is_fresh(o)) {
        c.fresh.push_back(&o);
        c.key.push_back(-20);
        continue;
      }
      // an out= tensor with a value (in-place structured ops: `x.add_(y)` arrives as add.out with
      // out=x): an input written, after the other arguments as dispatch.op_key puts it
      c.key.push_back(-21);
      if (!key_tensor_sig(c, o)) return false;
      continue;
    }
    if (!key_arg(c, v, plan.scalar[i])) return false;
  }
  if (c.dev < 0) return false;  // no tensor input and no device=: the thread's device (the router)
  c.key.push_back(c.dev);
  c.hash = key_hash(c.key.data() + 1, c.key.size() - 1, plan.h0);  // NOTE [call keys]
  return true;
}

// NOTE [C++ foreach]: an in-place foreach op (`_foreach_add_(xs, ys)`, an optimizer's updates) is
// one op writing every tensor of its first list from the values they held before it
// (specials._h_foreach_inplace). That holds unless two written tensors share a storage (slices of
// one flat buffer), or another argument reads a written storage at another index of its list, or
// as a single tensor (`_foreach_add_(xs, xs[::-1])`): PyTorch's CPU kernel writes element by
// element, so a later element reads what an earlier one wrote, and the router runs such a call
// one element at a time. This is specials._reads_written's test (and _fastpath.c's
// foreach_fast), made per call on the storages: the Storage a context holds, or the context
// itself before Python made one (one context per storage, shared by its views; a lazy context,
// NOTE [lazy storages], is a hit's new output, in no other context). True: the router.
const void* storage_key(const at::Tensor& t) {
  const StorageCtx* ctx = ctx_of(t);
  return ctx->storage != nullptr ? static_cast<const void*>(ctx->storage) : static_cast<const void*>(ctx);
}

bool foreach_overlaps(const torch::jit::Stack& stack, size_t n) {
  const size_t first = stack.size() - n;
  if (n == 0 || !stack[first].isTensorList()) return true;
  auto dsts = stack[first].toTensorList();
  std::unordered_map<const void*, size_t> written;
  written.reserve(dsts.size() * 2);
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& t = dsts.get(i);
    if (!t.defined() || !is_plain_tensor(t)) return true;
    if (!written.emplace(storage_key(t), i).second) return true;
  }
  if (dsts.size() == 1) return false;  // one written tensor: one op whatever it reads (specials.py)
  for (size_t a = 1; a < n; ++a) {
    const IValue& v = stack[first + a];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.defined() && is_plain_tensor(t) && written.count(storage_key(t))) return true;
    } else if (v.isTensorList()) {
      auto l = v.toTensorList();
      for (size_t j = 0; j < l.size(); ++j) {
        const at::Tensor& t = l.get(j);
        if (!t.defined() || !is_plain_tensor(t)) continue;
        auto it = written.find(storage_key(t));
        if (it != written.end() && it->second != j) return true;
      }
    } else if (v.isList()) {
      for (const IValue& x : v.toListRef())
        if (x.isTensor()) return true;  // an optional tensor list: not a foreach op's
    }
  }
  return false;
}

// A Storage's `val` (a new reference), or null with the error set. Storage is a slotted class
// (deferfuse/tensor.py): its `val` slot is read at its offset, found once from the class's member
// descriptor, when the object's class is exactly that one; anything else is a generic getattr
// (which also raises the AttributeError of an unset slot). A generic getattr walks the class's MRO
// for the descriptor first: ~45 ns an input of a hit.
PyObject* storage_val(PyObject* st) {
  auto& K = kernel();
  if (K.val_type == nullptr) {
    PyTypeObject* type = Py_TYPE(st);
    PyObject* d = _PyType_Lookup(type, K.val_str);  // borrowed
    if (d != nullptr && Py_IS_TYPE(d, &PyMemberDescr_Type)) {
      PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
      if (m->type == T_OBJECT_EX && !(m->flags & READ_RESTRICTED)) {
        Py_INCREF(type);  // held for the process's life, as the kernel's other Python objects
        K.val_type = type;
        K.val_off = m->offset;
      }
    }
  }
  if (Py_IS_TYPE(st, K.val_type)) {
    PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(st) + K.val_off);
    if (v != nullptr) return Py_NewRef(v);
  }
  return PyObject_GetAttr(st, K.val_str);
}

// The hit: true when the op was recorded and its outputs are on the stack; false (nothing
// changed) when the router must take it. Holds the GIL.
bool kernel_hit(const KEntry& e, Call& c, torch::jit::Stack* stack, size_t n) {
  auto& K = kernel();
  for (size_t k = 0; k < c.fresh.size(); ++k) {
    const at::Tensor& o = *c.fresh[k];
    if (k >= e.outs.size() || e.undefined[k]) {
      ++K.why[0];
      return false;
    }
    const auto& m = e.outs[k];
    if (o.scalar_type() != m.dtype || o.sizes() != c10::IntArrayRef(m.size) ||
        o.strides() != c10::IntArrayRef(m.stride) || o.device().index() != c.dev) {
      ++K.why[0];
      return false;
    }
  }
  HIT_MARK(H_FRESH);
  py::list ins(c.tensors.size());
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    auto* ctx = static_cast<StorageCtx*>(c.tensors[i]->storage().data_ptr().get_context());
    if (ctx->value != nullptr) {
      // NOTE [lazy storages]: a hit's output no reader asked for: its Value, which is what its
      // Storage's `val` would be (a write would have made the Storage)
      PyList_SET_ITEM(ins.ptr(), i, Py_NewRef(ctx->value));
      continue;
    }
    if (ctx->storage == nullptr) {
      // never read by Python (an `empty` tensor): its Storage, an empty value, as the router
      // makes it (Plain.storage)
      PyObject* w = THPVariable_Wrap(*c.tensors[i]);
      if (w == nullptr) rethrow_python();
      PyObject* r = PyObject_CallOneArg(K.storage_fn, w);
      Py_DECREF(w);
      if (r == nullptr) rethrow_python();
      Py_DECREF(r);
      if (ctx->storage == nullptr) {
        ++K.why[1];
        return false;
      }
    }
    PyObject* v = storage_val(ctx->storage);
    if (v == nullptr) rethrow_python();
    PyList_SET_ITEM(ins.ptr(), i, v);
  }
  HIT_MARK(H_INS);
  py::list scalars(c.scalars.size());
  for (size_t i = 0; i < c.scalars.size(); ++i) {
    const auto& s = c.scalars[i];
    PyObject* o = s.isDouble() ? PyFloat_FromDouble(s.toDouble()) : PyLong_FromLongLong(s.toInt());
    if (o == nullptr) rethrow_python();
    PyList_SET_ITEM(scalars.ptr(), i, o);
  }
  for (int64_t off : c.offs) {
    // NOTE [C++ moving windows]: the starts, int inputs after the op's own scalars
    PyObject* o = PyLong_FromLongLong(off);
    if (o == nullptr || PyList_Append(scalars.ptr(), o) < 0) rethrow_python();
    Py_DECREF(o);
  }
  HIT_MARK(H_SCALARS);
  if (K.record_c != nullptr &&
      c10::impl::TorchDispatchModeTLS::get_mode(c10::impl::TorchDispatchModeKey::FAKE).has_value()) {
    // record_storages' fake mode check, made here (NOTE [C++ node hand-over])
    ++K.why[2];
    return false;
  }
  py::int_ dev(c.dev);
  if (e.mut != nullptr) {
    // an op writing its inputs (dispatch._bind): each written storage takes its new value
    py::list writes(e.mut_idx.size());
    for (size_t k = 0; k < e.mut_idx.size(); ++k) {
      const at::Tensor& t = *c.tensors[e.mut_idx[k]];
      // NOTE [lazy storages]: a written storage takes its new value in its Storage
      PyObject* st = ctx_storage(static_cast<StorageCtx*>(t.storage().data_ptr().get_context()));
      if (st == nullptr) rethrow_python();
      Py_INCREF(st);
      PyList_SET_ITEM(writes.ptr(), k, st);
      if (e.overwrites && meta_of(t) == nullptr) {
        // overwritten whole, not through a view: not read (dispatch._run)
        Py_INCREF(Py_None);
        PyList_SetItem(ins.ptr(), e.mut_idx[k], Py_None);
      }
    }
    PyObject* argv[6] = {e.entry, ins.ptr(), scalars.ptr(), dev.ptr(), writes.ptr(), e.mut};
    PyObject* r = K.record_c != nullptr
        ? K.record_c(e.entry, ins.ptr(), scalars.ptr(), static_cast<long>(c.dev), writes.ptr(), e.mut, 0)
        : PyObject_Vectorcall(K.record_fn, argv, 6, nullptr);
    if (r == nullptr) rethrow_python();
    py::object res = py::reinterpret_steal<py::object>(r);
    if (r == Py_NotImplemented) {
      ++K.why[2];
      return false;
    }
    if (e.ret < 0) {  // an op returning nothing (in-place foreach ops: "-> ()")
      torch::jit::drop(*stack, n);
      return true;
    }
    IValue out = (*stack)[stack->size() - n + e.ret];
    torch::jit::drop(*stack, n);
    stack->push_back(std::move(out));
    return true;
  }
  PyObject* argv[4] = {e.entry, ins.ptr(), scalars.ptr(), dev.ptr()};
  HIT_MARK(H_FAKE);
  // NOTE [lazy storages]: the C record path returns the output Values, each held by its context
  // until a reader asks for its Storage; record_storages' and strict mode's return Storages
  bool values = K.record_c != nullptr && lazy().make_fn != nullptr;
  PyObject* r = K.record_c != nullptr
      ? K.record_c(e.entry, ins.ptr(), scalars.ptr(), static_cast<long>(c.dev), nullptr, nullptr, values)
      : PyObject_Vectorcall(K.record_fn, argv, 4, nullptr);
  HIT_MARK(H_RECORD);
  if (r == nullptr) rethrow_python();
  py::object res = py::reinterpret_steal<py::object>(r);
  if (r == Py_NotImplemented && K.strict_fn != nullptr) {
    // NOTE [C++ strict hits]: not recorded (strict mode, or any other refusal): in strict mode
    // Plain.run_hit runs the learnt Entry now, as dispatch._run does, and returns the outputs'
    // Storages; NotImplemented otherwise (another mode, an error: the router runs the op again
    // and raises as the op path does)
    r = PyObject_Vectorcall(K.strict_fn, argv, 4, nullptr);
    if (r == nullptr) rethrow_python();
    res = py::reinterpret_steal<py::object>(r);
    if (r != Py_NotImplemented) ++K.strict_hits;
    values = false;
  }
  if (r == Py_NotImplemented) {
    ++K.why[2];
    return false;
  }
  TORCH_INTERNAL_ASSERT(PyTuple_CheckExact(r) && static_cast<size_t>(PyTuple_GET_SIZE(r)) == e.outs.size(),
                        "deferfuse: record_storages returned ", py::repr(res).cast<std::string>());
  c10::SmallVector<IValue, 4> outs;
  for (size_t k = 0; k < e.outs.size(); ++k) {
    PyObject* st = PyTuple_GET_ITEM(r, k);
    if (e.undefined[k]) {  // a None output (an output_mask False): an undefined tensor
      outs.emplace_back(at::Tensor());
      continue;
    }
    if (!c.fresh.empty()) {
      const at::Tensor& t = *c.fresh[k];
      auto* ctx = ctx_of(t);
      if (values) {
        set_lazy(ctx, st, static_cast<c10::DeviceIndex>(c.dev));
      } else {
        ctx_clear(ctx);
        ctx->storage = Py_NewRef(st);
      }
      outs.emplace_back(t);
    } else {
      outs.emplace_back(new_output(e.outs[k], static_cast<c10::DeviceIndex>(c.dev), st, values));
    }
  }
  HIT_MARK(H_OUTS);
  torch::jit::drop(*stack, n);
  if (e.list_out) {  // one Tensor[] (_foreach_sqrt)
    c10::List<at::Tensor> l;
    l.reserve(outs.size());
    for (auto& o : outs) l.push_back(o.toTensor());
    stack->push_back(std::move(l));
    return true;
  }
  for (auto& o : outs) stack->push_back(std::move(o));
  HIT_MARK(H_STACK);
  return true;
}

// After the router ran a key's first call: the Entry it used, or a refusal.
void kernel_learn(const c10::OperatorHandle& op, const Plan& plan, Call& c, py::handle func,
                  const py::tuple& positional, const py::dict& kwargs, const py::object& result,
                  const std::vector<IValue>& args, const torch::jit::Stack& stack, size_t nret) {
  auto& K = kernel();
  // the arguments' key after the router ran: an out= tensor it resized has another signature
  // now, and the Entry Python finds is that one's, not the call's. The router dropped the stack
  // `c`'s tensors point into (NOTE [call tensors]): from here, tensors are `after`'s, over `args`.
  Call after;
  if (!build_key(op, plan, args, args.size(), after, !c.fresh.empty()) || after.key != c.key) {
    if (K.debug) std::cerr << "[deferfuse kernel] refused " << op.schema().name() << "."
                           << op.schema().overload_name() << ": its key changed in the router\n";
    ++K.refused;
    K.entries.emplace(c.owned(), KEntry());
    return;
  }
  if (K.entries.size() >= K.limit) {
    kernel_clear();
    ++K.clears;
  }
  KEntry e;
  py::object got = py::reinterpret_borrow<py::object>(K.learn_fn)(
      func, positional, kwargs, py::bool_(!after.fresh.empty()), result);
  bool ok = !got.is_none();
  py::tuple g;
  if (ok) {
    g = got.cast<py::tuple>();
    e.n_tensors = g[1].cast<size_t>();
    e.n_scalars = g[2].cast<size_t>();
    ok = e.n_tensors == after.tensors.size() && e.n_scalars == c.scalars.size() &&
         (after.fresh.empty() || nret == after.fresh.size());
    // NOTE [C++ moving windows]: the op path's `_dyn` of each input, the starts the key left out
    py::tuple dyn = g[g.size() - 1].cast<py::tuple>();
    ok = ok && dyn.size() == after.tensors.size();
    size_t k = 0, w = 0;
    for (size_t i = 0; ok && i < dyn.size(); ++i) {
      py::tuple di = dyn[i].cast<py::tuple>();
      size_t want = 0;
      if (w < c.moving.size() && c.moving[w].first == i) want = c.moving[w++].second;
      ok = di.size() == want;
      for (size_t j = 0; ok && j < di.size(); ++j, ++k) ok = di[j].cast<int64_t>() == c.offs[k];
    }
  }
  if (ok && g.size() == 7) {
    // an op writing its inputs: (Entry, tensors, scalars, Entry.out[1], overwrites, returned
    // or -1: it returns nothing, as the in-place foreach ops)
    ok = nret <= 1 && after.fresh.empty();
    for (auto m : g[3]) {
      int mi = m.cast<int>();
      ok = ok && mi >= 0 && static_cast<size_t>(mi) < after.tensors.size();
      e.mut_idx.push_back(mi);
    }
    e.overwrites = g[4].cast<bool>();
    e.ret = g[5].cast<int>();
    if (e.ret < 0) {
      ok = ok && !e.mut_idx.empty() && nret == 0;
    } else {
      ok = ok && !e.mut_idx.empty() && nret == 1 && static_cast<size_t>(e.ret) < args.size() &&
           args[e.ret].isTensor() && stack.back().isTensor() &&
           stack.back().toTensor().unsafeGetTensorImpl() == args[e.ret].toTensor().unsafeGetTensorImpl();
    }
    if (ok) {
      e.mut = py::object(g[3]).release().ptr();
      e.entry = py::object(g[0]).release().ptr();
    }
  } else if (ok && nret >= 1) {
    // the new outputs: each returned tensor, or the items of one returned Tensor[]
    std::vector<IValue> vals;
    const auto& rets = op.schema().returns();
    e.list_out = nret == 1 && rets[0].type()->kind() == c10::TypeKind::ListType;
    if (e.list_out) {
      ok = stack.back().isTensorList() && after.fresh.empty();
      if (ok)
        for (const at::Tensor& t : stack.back().toTensorList()) vals.emplace_back(t);
    } else {
      vals.assign(stack.end() - nret, stack.end());
    }
    for (size_t r = 0; ok && r < vals.size(); ++r) {
      const auto& v = vals[r];
      OutMeta m;
      // an undefined tensor is a None output (Plain.learn checked that the Entry has None there)
      const bool none = v.isNone() || (v.isTensor() && !v.toTensor().defined());
      ok = none ? (r >= after.fresh.size())
                : v.isTensor() && is_plain_tensor(v.toTensor());
      if (!ok) break;
      if (!none) {
        const auto& t = v.toTensor();
        m.size = t.sizes().vec();
        m.stride = t.strides().vec();
        m.dtype = t.scalar_type();
        m.nbytes = at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.element_size());
      }
      e.outs.push_back(std::move(m));
      e.undefined.push_back(none ? 1 : 0);
    }
    if (ok) e.entry = py::object(g[0]).release().ptr();
  }
  if (e.entry != nullptr) {
    ++K.learned;
  } else {
    ++K.refused;
    if (K.debug) std::cerr << "[deferfuse kernel] refused " << op.schema().name() << "."
                           << op.schema().overload_name() << ": " << (got.is_none() ? "Plain.learn said no" : "the learnt entry does not fit the call") << "\n";
  }
  K.entries.emplace(c.owned(), std::move(e));
}

void kernel_plan(const c10::OperatorHandle& op, py::handle func) {
  auto& K = kernel();
  Plan p;
  py::object got = py::reinterpret_borrow<py::object>(K.plan_fn)(func);
  if (!got.is_none()) {
    py::tuple g = got.cast<py::tuple>();
    p.out = g[0].cast<int>();
    for (auto f : g[1]) p.scalar.push_back(f.cast<bool>());
    p.ok = p.scalar.size() == op.schema().arguments().size();
    if (g.size() >= 4) {
      p.foreach = g[2].cast<bool>();  // NOTE [C++ foreach]
      for (auto i : g[3]) {           // NOTE [fresh outs]
        int k = i.cast<int>();
        p.ok = p.ok && k >= 0 && static_cast<size_t>(k) < p.scalar.size() && p.out < 0;
        p.outs.push_back(k);
      }
    }
    if (g.size() >= 5 && !g[4].is_none()) {  // NOTE [C++ value checks]
      py::tuple c = g[4].cast<py::tuple>();
      p.check = c[0].cast<int>();
      p.check_a = c[1].cast<int>();
      p.check_b = c[2].cast<int>();
      const int m = static_cast<int>(p.scalar.size());
      p.ok = p.ok && (p.check == 1 || p.check == 2) && p.check_a >= 0 && p.check_a < m &&
             p.check_b < m && (p.check == 1 || p.check_b >= 0);
    }
  }
  p.h0 = key_mix(kKeySeed, reinterpret_cast<int64_t>(&op.schema()));
  K.plans.emplace(&op.schema(), std::move(p));
}

PyObject* py_op(const c10::OperatorHandle& op) {
  auto& r = router();
  const void* id = &op.schema();
  auto it = r.ops.find(id);
  if (it != r.ops.end()) return it->second;
  py::object o = py::reinterpret_borrow<py::object>(r.resolve)(op.schema().name(),
                                                                op.schema().overload_name());
  PyObject* p = o.release().ptr();
  r.ops.emplace(id, p);
  return p;
}

// An IValue as the Python object __torch_dispatch__ would see (dtype, layout and memory format
// arguments arrive as ints on the stack).
py::object to_py(const IValue& v, const c10::Argument& a) {
  if (v.isInt()) {
    auto ty = a.real_type();
    if (ty->kind() == c10::TypeKind::OptionalType) ty = ty->castRaw<c10::OptionalType>()->getElementType();
    switch (ty->kind()) {
      case c10::TypeKind::ScalarTypeType:
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt()))));
      case c10::TypeKind::LayoutType:
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(v.toInt()))));
      case c10::TypeKind::MemoryFormatType:
        return py::reinterpret_borrow<py::object>(
            torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(v.toInt())));
      default:
        break;
    }
  }
  return torch::jit::toPyObject(v);
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t n = arguments.size(), nret = schema.returns().size();
#ifdef DEFERFUSE_HIT_TIMING
  HIT_MARK(H_OUT);
  HitExit hit_exit;
#endif
  FloorKey key;
  auto& fc = floor_cache();
  if (fc.on && floor_hit(op, stack, key)) return;
  HIT_MARK(H_FLOOR);
  py::gil_scoped_acquire gil;
  HIT_MARK(H_GIL);
#ifdef DEFERFUSE_HIT_TIMING
  HitLocals hit_locals;
#endif
  // NOTE [C++ recording kernel]
  auto& K = kernel();
  const bool kernel_on = K.on && K.learn_fn != nullptr && !fc.on;
  const Plan* plan = nullptr;
  Call call;
  bool learn = false;
  if (kernel_on) {
    auto pit = K.plans.find(&schema);
    if (pit != K.plans.end()) {
      plan = &pit->second;
      const bool refused = plan->check != 0 && value_refused(*plan, *stack, n);
      if (refused) ++K.value_refused;  // NOTE [C++ value checks]
      if (plan->ok && !refused && build_key(op, *plan, *stack, n, call)) {
        HIT_MARK(H_KEY);
        const bool overlaps = plan->foreach && foreach_overlaps(*stack, n);
        auto it = overlaps ? K.entries.end() : K.entries.find(call.view());
        HIT_MARK(H_FIND);
        if (overlaps) {
          ++K.overlaps;  // NOTE [C++ foreach]: the router, one element at a time; nothing learnt
        } else if (it == K.entries.end()) {
          ++K.misses;
          learn = true;
        } else if (it->second.entry != nullptr && kernel_hit(it->second, call, stack, n)) {
          ++K.hits;
#ifdef DEFERFUSE_HIT_TIMING
          hit_exit.hit = true;
#endif
          return;
        } else {
          ++K.passed;
        }
      } else {
        ++K.unkeyed;
      }
    }
  }
  std::vector<IValue> args(stack->end() - n, stack->end());
  py::list positional;
  py::dict kwargs;
  for (size_t i = 0; i < n; ++i) {
    const auto& a = arguments[i];
    if (a.kwarg_only()) {
      if (!args[i].isNone() || !a.default_value().has_value()) kwargs[py::str(a.name())] = to_py(args[i], a);
    } else {
      positional.append(to_py(args[i], a));
    }
  }
  PyObject* func = py_op(op);
  ++router().routed[&schema];
  py::tuple pos(positional);
  py::object out;
  try {
    out = py::reinterpret_borrow<py::object>(router().route)(py::handle(func), pos, kwargs);
    torch::jit::drop(*stack, n);
    const auto& rets = schema.returns();
    if (nret == 1) {
      stack->push_back(torch::jit::toIValue(out, rets[0].real_type()));
    } else if (nret > 1) {
      py::tuple tup = py::reinterpret_borrow<py::tuple>(out);
      for (size_t i = 0; i < nret; ++i) stack->push_back(torch::jit::toIValue(tup[i], rets[i].real_type()));
    }
    if (kernel_on) {
      if (plan == nullptr) kernel_plan(op, py::handle(func));
      else if (learn) kernel_learn(op, *plan, call, py::handle(func), pos, kwargs, out, args, *stack, nret);
    }
  } catch (py::error_already_set& e) {
    // PyTorch's Python binding re-raises it as it was (its type and message, as on CPU)
    e.restore();
    rethrow_python();
  }
  if (fc.on && !key.empty()) floor_store(key, args, *stack, nret);
}

// ---------------------------------------------------------------------------------------------
// installation (once, from deferfuse/plain.py; never at library load, so that importing this
// module changes nothing)

struct Installed {
  std::unique_ptr<torch::Library> aten, fallback;
};

Installed& installed() {
  static Installed* i = new Installed();
  return *i;
}

void install(py::object route, py::object resolve, int devices) {
  auto& r = router();
  TORCH_CHECK(r.route == nullptr, "deferfuse._tpu_tensor is installed already");
  r.route = route.release().ptr();
  r.resolve = resolve.release().ptr();
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &allocator());
  n_devices = static_cast<c10::DeviceIndex>(devices);
  static TpuGuardImpl guard;  // replaces PyTorch's Python guard (NOTE [plain device guard])
  static c10::impl::DeviceGuardImplRegistrar reg(c10::DeviceType::PrivateUse1, &guard);
  auto& in = installed();
  in.aten = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                             c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& m = *in.aten;
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("as_strided", TORCH_FN(as_strided));
  m.impl("view", TORCH_FN(view));
  m.impl("_reshape_alias", TORCH_FN(reshape_alias));
  m.impl("t", TORCH_FN(t));
  m.impl("transpose.int", TORCH_FN(transpose));
  m.impl("permute", TORCH_FN(permute));
  m.impl("slice.Tensor", TORCH_FN(slice));
  m.impl("select.int", TORCH_FN(select));
  m.impl("expand", TORCH_FN(expand));
  m.impl("unsqueeze", TORCH_FN(unsqueeze));
  m.impl("squeeze", TORCH_FN(squeeze));
  m.impl("squeeze.dim", TORCH_FN(squeeze_dim));
  m.impl("squeeze.dims", TORCH_FN(squeeze_dims));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage_geometry));
  m.impl("set_.source_Storage", TORCH_FN(set_storage_whole));
  m.impl("set_.source_Tensor", TORCH_FN(set_tensor));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("_conj", TORCH_FN(conj_view));
  m.impl("detach", TORCH_FN(alias));
  m.impl("alias", TORCH_FN(alias));
  m.impl("squeeze_", TORCH_FN(squeeze_inplace));
  m.impl("squeeze_.dim", TORCH_FN(squeeze_dim_inplace));
  m.impl("squeeze_.dims", TORCH_FN(squeeze_dims_inplace));
  m.impl("unsqueeze_", TORCH_FN(unsqueeze_inplace));
  m.impl("t_", TORCH_FN(t_inplace));
  m.impl("transpose_", TORCH_FN(transpose_inplace));
  m.impl("as_strided_", TORCH_FN(as_strided_inplace));
  in.fallback = std::make_unique<torch::Library>(torch::Library::IMPL, "_",
                                                 c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  in.fallback->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// ---------------------------------------------------------------------------------------------
// Python accessors (NOTE [plain tensor])

// The tensor's Storage, made now if it is a lazy one (NOTE [lazy storages]), or None (no value yet).
py::object storage(const at::Tensor& t) {
  PyObject* st = ctx_storage(ctx_of(t));
  if (st == nullptr) {
    if (PyErr_Occurred()) rethrow_python();
    return py::none();
  }
  return py::reinterpret_borrow<py::object>(st);
}

void set_storage(const at::Tensor& t, py::object st) {
  auto* ctx = ctx_of(t);
  PyObject* old = ctx->storage;
  PyObject* old_value = ctx->value;  // a lazy Value the new Storage replaces (NOTE [lazy storages])
  if (ctx->linked) lazy_unlink(ctx);
  ctx->value = nullptr;
  ctx->storage = st.is_none() ? nullptr : st.release().ptr();
  Py_XDECREF(old);
  Py_XDECREF(old_value);
}

// (sizes, strides, dtype) of the tensor the storage was made for, or None when unknown.
py::object base(const at::Tensor& t) {
  auto* ctx = ctx_of(t);
  if (!ctx->known) return py::none();
  return py::make_tuple(py::tuple(py::cast(c10::IntArrayRef(ctx->size).vec())),
                        py::tuple(py::cast(c10::IntArrayRef(ctx->stride).vec())),
                        py::reinterpret_borrow<py::object>(
                            reinterpret_cast<PyObject*>(torch::getTHPDtype(ctx->dtype))));
}

// The view chain: a tuple of Python steps set from Python, or a list of [(op name, args)] of the C++
// view kernels (after that tuple, as the list's first item, when both), or None for a tensor with
// no ViewMeta (its storage's base, or PyTorch's own alias of one).
py::object chain(const at::Tensor& t) {
  const ViewMeta* m = meta_of(t);
  if (m == nullptr) return py::none();
  py::list out;
  if (m->py_chain != nullptr) {
    if (m->steps.empty()) return py::reinterpret_borrow<py::object>(m->py_chain);
    out.append(py::reinterpret_borrow<py::object>(m->py_chain));  // a tuple: steps as they are
  }
  for (const auto& s : m->steps) {
    py::list a;
    for (const auto& v : s.args) a.append(torch::jit::toPyObject(v));
    out.append(py::make_tuple(kOps[s.op], py::tuple(a)));
  }
  return out;
}

// (Storage or None, chain as `chain` gives it, whether the tensor is its storage's base): what the
// router reads of every argument, in one call.
py::tuple state(const at::Tensor& t) {
  auto* ctx = ctx_of(t);
  const ViewMeta* m = meta_of(t);
  bool base = m == nullptr && t.storage_offset() == 0 && ctx->known &&
              t.sizes() == c10::IntArrayRef(ctx->size) && t.strides() == c10::IntArrayRef(ctx->stride);
  return py::make_tuple(storage(t), m == nullptr ? py::none() : chain(t), base);
}

// A new base tensor on tpu:device whose storage holds `st` (a router output).
at::Tensor make_base(c10::IntArrayRef size, c10::IntArrayRef stride, c10::ScalarType dtype,
                     int64_t device, py::object st) {
  DeviceScope g(c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device)));
  at::Tensor t = at::detail::empty_strided_generic(size, stride, &allocator(), tpu_keys(), dtype);
  remember_base(t);
  set_storage(t, std::move(st));
  return t;
}

// A view of `of`'s storage with the given geometry and a chain set from Python; `dtype`: the
// view's own when its chain changes it (view_as_real, view(dtype)), else `of`'s.
at::Tensor make_view_py(const at::Tensor& of, c10::IntArrayRef size, c10::IntArrayRef stride,
                        int64_t offset, py::object py_chain,
                        std::optional<c10::ScalarType> dtype) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(of.storage()), of.key_set(),
      dtype.has_value() ? caffe2::TypeMeta::fromScalarType(*dtype) : of.dtype());
  impl->set_sizes_and_strides(size, stride, offset);
  auto m = c10::make_intrusive<ViewMeta>();
  m->py_chain = py_chain.release().ptr();
  impl->set_backend_meta(m);
  return at::Tensor(std::move(impl));
}

bool is_plain(const at::Tensor& t) { return is_plain_tensor(t); }

// NOTE [lazy storages]: the pending Values of `trace` that linked contexts hold (Trace.take's
// outputs beside those of live Storages). A context whose Value is no longer pending (ready,
// failed, or never was) is unlinked; one pending in another trace, or in a region call in flight,
// stays. The first pass only reads slots (no allocation, so no collection can free a context
// under the walk); the list is built after it.
py::list lazy_outputs(py::handle trace) {
  static PyObject* node_s = PyUnicode_InternFromString("node");
  static PyObject* trace_s = PyUnicode_InternFromString("trace");
  std::vector<PyObject*> got;  // new references
  auto fail = [&]() {
    for (PyObject* v : got) Py_DECREF(v);
    rethrow_python();
  };
  StorageCtx* c = lazy().first;
  while (c != nullptr) {
    StorageCtx* next = c->lazy_next;
    PyObject* n = PyObject_GetAttr(c->value, node_s);
    if (n == nullptr) fail();
    if (n == Py_None) {
      Py_DECREF(n);
      lazy_unlink(c);
    } else {
      PyObject* tr = PyObject_GetAttr(n, trace_s);
      Py_DECREF(n);
      if (tr == nullptr) fail();
      if (tr == trace.ptr()) got.push_back(Py_NewRef(c->value));
      Py_DECREF(tr);
    }
    c = next;
  }
  py::list out(got.size());
  for (size_t i = 0; i < got.size(); ++i) PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), got[i]);
  return out;
}

}  // namespace

// NOTE [extension build] in setup.py: the torch this library is built for, which deferfuse/cxxext.py
// reads from the file before loading it, so a library built for another torch (another C++ ABI) is
// refused with the fix, never loaded.
extern "C" __attribute__((visibility("default"), used))
const char deferfuse_built_for_torch[] = "deferfuse-built-for-torch:" DEFERFUSE_TORCH_VERSION;

PYBIND11_MODULE(_tpu_tensor, m) {
  m.doc() = "deferfuse's plain PrivateUse1 tpu tensor (NOTE [plain tensor] in _tpu_tensor.cpp)";
  m.def("install", &install, "register the kernels, the allocator and the fallback (once)");
#ifdef DEFERFUSE_HIT_TIMING
  m.def("hit_timing", []() {
    // NOTE [hit timing]: (section names, rows as bytes of uint32 ticks, one row per hit); clears
    auto& h = ht();
    py::tuple names(static_cast<size_t>(H_N));
    for (int i = 0; i < H_N; ++i) names[i] = py::str(H_NAMES[i]);
    py::bytes b(reinterpret_cast<const char*>(h.rows.data()), h.rows.size() * sizeof(h.rows[0]));
    h.rows.clear();
    return py::make_tuple(names, b);
  });
  m.def("ticks", []() { return __rdtsc(); }, "NOTE [hit timing]: the time stamp counter");
  m.def("gil_pair_ticks", [](int n) {
    // NOTE [hit timing]: one release and re-acquire of the GIL, uncontended, as a hit pays it
    unsigned long long t0 = __rdtsc();
    for (int i = 0; i < n; ++i) {
      py::gil_scoped_release r;
    }
    return static_cast<double>(__rdtsc() - t0) / n;
  });
#endif
  m.def("storage", &storage);
  m.def("set_storage", &set_storage);
  m.def("base", &base);
  m.def("chain", &chain);
  m.def("state", &state);
  m.def("make_base", &make_base);
  m.def("make_view", &make_view_py, py::arg("of"), py::arg("size"), py::arg("stride"),
        py::arg("offset"), py::arg("py_chain"), py::arg("dtype") = py::none());
  m.def("is_plain", &is_plain);
  m.def("route_whole", [](const std::vector<std::string>& names) {
    auto& in = installed();
    TORCH_CHECK(in.aten != nullptr, "deferfuse._tpu_tensor is not installed");
    for (const auto& n : names) in.aten->impl(n.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  }, "NOTE [whole ops]: these ops reach the router whole, as they reach TpuTensor's "
     "__torch_dispatch__, not through their CompositeExplicitAutograd kernel");
  m.def("set_storage_hooks", [](py::object grow, py::object freed) {
    auto& h = storage_hooks();
    TORCH_CHECK(h.grow == nullptr, "the storage hooks are set already");
    h.grow = grow.release().ptr();
    h.freed = freed.release().ptr();
  }, "NOTE [plain storage hooks]: grow(Storage, n) -> Storage; freed(Storage, bool)");
  m.def("storage_resize_address", []() { return reinterpret_cast<uintptr_t>(&storage_resize); },
        "the address of storage_resize, for the hooks' resizePrivateUse1Bytes (_tpu_hooks.cpp)");
  m.def("set_device", [](int i) { tls_device = static_cast<c10::DeviceIndex>(i); },
        "the calling thread's current tpu device (NOTE [plain device guard])");
  m.def("set_floor", [](bool on) {
    auto& fc = floor_cache();
    std::lock_guard<std::mutex> g(fc.mu);
    fc.on = on;
  }, "NOTE [floor cache]: on, plain ops whose structure was seen return outputs built in C++");
  m.def("clear_floor", []() {
    auto& fc = floor_cache();
    std::lock_guard<std::mutex> g(fc.mu);
    fc.entries.clear();
    fc.hits = fc.misses = 0;
  });
  m.def("floor_stats", []() {
    auto& fc = floor_cache();
    std::lock_guard<std::mutex> g(fc.mu);
    return py::make_tuple(fc.hits, fc.misses, fc.entries.size());
  });
  m.def("install_kernel", [](py::object plan, py::object learn, py::object record, py::object storage) {
    auto& K = kernel();
    TORCH_CHECK(K.learn_fn == nullptr, "the C++ recording kernel is installed already");
    K.storage_fn = storage.release().ptr();
    K.plan_fn = plan.release().ptr();
    K.learn_fn = learn.release().ptr();
    K.record_fn = record.release().ptr();
    K.val_str = PyUnicode_InternFromString("val");
  }, "NOTE [C++ recording kernel]: Plain.plan, Plain.learn, _fastpath.record_storages, Plain.storage");
  m.def("install_strict", [](py::object run) {
    auto& K = kernel();
    Py_XSETREF(K.strict_fn, run.is_none() ? nullptr : run.release().ptr());
  }, "NOTE [C++ strict hits]: Plain.run_hit, or None (strict mode's hits go to the router)");
  m.def("install_record_capi", [](py::object cap) {
    // NOTE [C++ node hand-over]: _fastpath.record_capi, or None to call record_storages again
    auto& K = kernel();
    struct Capi {
      long version;
      PyObject* (*record)(PyObject*, PyObject*, PyObject*, long, PyObject*, PyObject*, int);
    };
    if (cap.is_none()) {
      K.record_c = nullptr;
      return;
    }
    auto* api = static_cast<Capi*>(PyCapsule_GetPointer(cap.ptr(), "deferfuse._fastpath.record_capi"));
    if (api == nullptr) rethrow_python();
    TORCH_CHECK(api->version == 2, "deferfuse: _fastpath.record_capi version ", api->version,
                ", expected 2: rebuild the extensions");
    Py_XSETREF(K.record_capi, cap.release().ptr());
    K.record_c = api->record;
  }, "NOTE [C++ node hand-over]: _fastpath.record_capi (record_storages without a Python call), or None");
  m.def("install_lazy", [](py::object make) {
    auto& L = lazy();
    Py_XSETREF(L.make_fn, make.is_none() ? nullptr : make.release().ptr());
  }, "NOTE [lazy storages]: Plain.lazy_storage(value, dev, dtype, stride) -> Storage, or None "
     "(hits' outputs get their Storage when made, as before)");
  m.def("lazy_outputs", &lazy_outputs,
        "NOTE [lazy storages]: the pending Values of a trace that lazy storage contexts hold");
  m.def("lazy_stats", []() {
    auto& L = lazy();
    py::dict d;
    d["linked"] = L.linked; d["outputs"] = L.outputs; d["made"] = L.made;
    return d;
  }, "NOTE [lazy storages]: contexts linked now, hit outputs made lazy, Storages made on ask");
  m.def("lazy_state", [](const at::Tensor& t) {
    auto* ctx = ctx_of(t);
    return py::make_tuple(ctx->value != nullptr, ctx->linked);
  }, "NOTE [lazy storages]: (whether the tensor's storage holds a lazy Value, whether it is linked)");
  m.def("set_kernel", [](bool on) { kernel().on = on; },
        "the C++ recording kernel on or off (off: every op through the router; the table is kept)");
  // the plans stay: they hold no Python object, are bounded by the op set, and a fallback running
  // the router (which may flush and evict) holds a reference to its op's plan
  m.def("kernel_clear", []() { kernel_clear(); ++kernel().clears; },
        "forget every learnt key (the engine's per-op programs were evicted)");
  m.def("kernel_stats", []() {
    auto& K = kernel();
    py::dict d;
    d["hits"] = K.hits; d["misses"] = K.misses; d["learned"] = K.learned;
    d["refused"] = K.refused; d["passed"] = K.passed; d["unkeyed"] = K.unkeyed;
    d["entries"] = K.entries.size(); d["plans"] = K.plans.size(); d["clears"] = K.clears;
    d["passed_out_geometry"] = K.why[0]; d["passed_no_storage"] = K.why[1];
    d["passed_record_refused"] = K.why[2];
    d["passed_overlap"] = K.overlaps;
    d["strict_hits"] = K.strict_hits;
    d["value_refused"] = K.value_refused;
    return d;
  });
  m.def("reset_kernel_stats", []() {
    auto& K = kernel();
    K.hits = K.misses = K.learned = K.refused = K.passed = K.unkeyed = 0;
    K.why[0] = K.why[1] = K.why[2] = 0;
    K.overlaps = 0;
    K.strict_hits = 0;
    K.value_refused = 0;
  });
  m.def("route_stats", []() {
    py::dict d;
    for (const auto& kv : router().routed) {
      const auto& s = *kv.first;
      d[py::str(s.overload_name().empty() ? s.name() : s.name() + "." + s.overload_name())] = kv.second;
    }
    return d;
  }, "calls the fallback handed to the Python router, per op ('aten::name.overload' -> count)");
  m.def("reset_route_stats", []() { router().routed.clear(); });
  m.def("sig", [](const at::Tensor& t) { return is_plain_tensor(t) ? sig_of(t) : -1; },
        "NOTE [C++ signatures]: the tensor's signature id, or -1");
  m.def("sig_desc", [](int64_t id) -> py::object {
    auto& t = sigs();
    if (id < t.first || id >= t.first + static_cast<int64_t>(t.descs.size())) return py::none();
    return py::tuple(py::cast(t.descs[id - t.first]));
  }, "the description a signature id was interned for (ints), or None when forgotten");
  m.attr("TORCH_VERSION") = DEFERFUSE_TORCH_VERSION;
}
