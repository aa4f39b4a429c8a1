// The plain PrivateUse1 `tpu` tensor (issue 34, first stage; docs/cxx-plan.md).
//
// NOTE [plain tensor]: with DEFERFUSE_TENSOR=plain a tpu tensor is an ordinary c10::TensorImpl on
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

#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <ATen/InferSize.h>
#include <ATen/TensorUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/strides.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <unordered_map>

namespace py = pybind11;

namespace {

using c10::IValue;
using IntVec = std::vector<int64_t>;

// ---------------------------------------------------------------------------------------------
// storage: the engine value

struct StorageCtx {
  PyObject* storage = nullptr;  // deferfuse.tensor.Storage (owned), or null until Python reads it
  IntVec size, stride;          // the base tensor the storage was made for
  c10::ScalarType dtype = c10::ScalarType::Float;
  bool known = false;           // size/stride/dtype set (by empty*, or by make_base)
  size_t cap = 0;               // the bytes allocated: what untyped_storage().resize_ may restore
};

void free_ctx(void* p) {
  auto* ctx = static_cast<StorageCtx*>(p);
  if (ctx->storage != nullptr && Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    Py_DECREF(ctx->storage);
  }
  delete ctx;
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
};

struct ViewMeta final : c10::BackendMeta {
  std::vector<Step> steps;
  PyObject* py_chain = nullptr;  // the chain's first steps, set from Python (a router output
                                 // that is a view), as a tuple of Python steps; `steps` follow
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
  ctx->size = t.sizes().vec();
  ctx->stride = t.strides().vec();
  ctx->dtype = t.scalar_type();
  ctx->known = true;
}

c10::DispatchKeySet tpu_keys() { return c10::DispatchKeySet(c10::DispatchKey::PrivateUse1); }

// The device a factory allocates on (the allocator reads the current device), for its scope.
struct DeviceScope {
  c10::DeviceIndex old;
  explicit DeviceScope(std::optional<c10::Device> d) : old(tls_device) {
    if (d.has_value() && d->has_index()) tls_device = d->index();
  }
  ~DeviceScope() { tls_device = old; }
};

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout>,
                         std::optional<c10::Device> device, std::optional<bool>) {
  DeviceScope g(device);
  at::Tensor t = at::detail::empty_strided_generic(size, stride, &allocator(), tpu_keys(),
                                             dtype.value_or(c10::get_default_dtype_as_scalartype()));
  remember_base(t);
  return t;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device> device,
                               std::optional<bool>, std::optional<c10::MemoryFormat> mf) {
  DeviceScope g(device);
  at::Tensor t = at::detail::empty_generic(size, &allocator(), tpu_keys(),
                                     dtype.value_or(c10::get_default_dtype_as_scalartype()), mf);
  remember_base(t);
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
  IntVec base_size = ctx->size, base_stride = ctx->stride;
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
  return make_view(self, size, stride, self.storage_offset() + i * self.stride(dim),
                   Step{SELECT, {IValue(dim), IValue(index)}});
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

at::Tensor alias(const at::Tensor& self) {
  return make_view(self, self.sizes(), self.strides(), self.storage_offset(), std::nullopt);
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
    python_error err;
    err.persist();
    throw std::move(err);
  }
}

// A new storage holding Storage `st` (a Python object), base of `bytes` bytes, 1-D of `n` elements.
void replace_storage(const c10::Storage& storage, StorageCtx* old, py::object st, int64_t n, size_t bytes) {
  c10::DataPtr dp = allocator().allocate(bytes);
  auto* ctx = static_cast<StorageCtx*>(dp.get_context());
  ctx->size = {n};
  ctx->stride = {1};
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
  bool base = ctx->known && off == 0 && self.sizes().vec() == ctx->size &&
              self.strides().vec() == ctx->stride;
  if (base) {
    impl->set_backend_meta(c10::intrusive_ptr<c10::BackendMeta>());
    return;
  }
  auto m = c10::make_intrusive<ViewMeta>();
  m->steps.push_back(Step{AS_STRIDED, {IValue(self.sizes().vec()), IValue(self.strides().vec()),
                                       IValue(off), IValue(ctx->size), IValue(ctx->stride)}});
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
  ctx->size = {0};
  ctx->stride = {1};
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
  if (need > static_cast<int64_t>(st.nbytes()) && ctx->storage != nullptr) {
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
      grown = call_hook(storage_hooks().grow, py::reinterpret_borrow<py::object>(ctx->storage),
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
  if (ctx->storage != nullptr) {
    py::gil_scoped_acquire gil;
    call_hook(storage_hooks().freed, py::reinterpret_borrow<py::object>(ctx->storage),
              py::bool_(n == 0));
  }
  storage.unsafeGetStorageImpl()->set_nbytes(n);
}

// ---------------------------------------------------------------------------------------------
// the boxed fallback: every other op goes to the Python router (deferfuse/plain.py)

struct Router {
  PyObject* route = nullptr;    // route(op, args, kwargs) -> result
  PyObject* resolve = nullptr;  // resolve(qualified name, overload name) -> OpOverload
  std::unordered_map<const void*, PyObject*> ops;  // &schema -> OpOverload (never freed)
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
};

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
  FloorKey key;
  auto& fc = floor_cache();
  if (fc.on && floor_hit(op, stack, key)) return;
  std::vector<IValue> args(stack->end() - n, stack->end());
  {
    py::gil_scoped_acquire gil;
    py::tuple pargs(0);
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
    py::object out;
    try {
      out = py::reinterpret_borrow<py::object>(router().route)(
          py::handle(func), py::tuple(positional), kwargs);
    } catch (py::error_already_set& e) {
      // PyTorch's Python binding re-raises it as it was (its type and message, as on CPU)
      e.restore();
      python_error err;
      err.persist();
      throw std::move(err);
    }
    torch::jit::drop(*stack, n);
    const auto& rets = schema.returns();
    if (nret == 1) {
      stack->push_back(torch::jit::toIValue(out, rets[0].real_type()));
    } else if (nret > 1) {
      py::tuple tup = py::reinterpret_borrow<py::tuple>(out);
      for (size_t i = 0; i < nret; ++i) stack->push_back(torch::jit::toIValue(tup[i], rets[i].real_type()));
    }
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
  in.fallback = std::make_unique<torch::Library>(torch::Library::IMPL, "_",
                                                 c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  in.fallback->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// ---------------------------------------------------------------------------------------------
// Python accessors (NOTE [plain tensor])

py::object storage(const at::Tensor& t) {
  auto* ctx = ctx_of(t);
  if (ctx->storage == nullptr) return py::none();
  return py::reinterpret_borrow<py::object>(ctx->storage);
}

void set_storage(const at::Tensor& t, py::object st) {
  auto* ctx = ctx_of(t);
  PyObject* old = ctx->storage;
  ctx->storage = st.is_none() ? nullptr : st.release().ptr();
  Py_XDECREF(old);
}

// (sizes, strides, dtype) of the tensor the storage was made for, or None when unknown.
py::object base(const at::Tensor& t) {
  auto* ctx = ctx_of(t);
  if (!ctx->known) return py::none();
  return py::make_tuple(py::tuple(py::cast(ctx->size)), py::tuple(py::cast(ctx->stride)),
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
  return py::make_tuple(ctx->storage == nullptr ? py::none()
                                                : py::reinterpret_borrow<py::object>(ctx->storage),
                        m == nullptr ? py::none() : chain(t), base);
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

// A view of `of`'s storage with the given geometry and a chain set from Python.
at::Tensor make_view_py(const at::Tensor& of, c10::IntArrayRef size, c10::IntArrayRef stride,
                        int64_t offset, py::object py_chain) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(of.storage()),
                                                   of.key_set(), of.dtype());
  impl->set_sizes_and_strides(size, stride, offset);
  auto m = c10::make_intrusive<ViewMeta>();
  m->py_chain = py_chain.release().ptr();
  impl->set_backend_meta(m);
  return at::Tensor(std::move(impl));
}

bool is_plain(const at::Tensor& t) {
  return t.device().type() == c10::DeviceType::PrivateUse1 && t.has_storage() &&
         t.storage().data_ptr().get_deleter() == &free_ctx;
}

}  // namespace

PYBIND11_MODULE(_tpu_tensor, m) {
  m.doc() = "deferfuse's plain PrivateUse1 tpu tensor (NOTE [plain tensor] in _tpu_tensor.cpp)";
  m.def("install", &install, "register the kernels, the allocator and the fallback (once)");
  m.def("storage", &storage);
  m.def("set_storage", &set_storage);
  m.def("base", &base);
  m.def("chain", &chain);
  m.def("state", &state);
  m.def("make_base", &make_base);
  m.def("make_view", &make_view_py);
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
  m.attr("TORCH_VERSION") = DEFERFUSE_TORCH_VERSION;
}
