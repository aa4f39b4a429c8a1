// The tpu device's PrivateUse1 hooks, in C++: NOTE [pinned memory].
//
// PyTorch asks a device's hooks for a pinned-memory allocator whenever a CPU tensor is made with
// pin_memory=True while that device is the accelerator. DDP's reducer does so in backward with
// static_graph=True (its first iteration) or find_unused_parameters=True: it stages its map of
// used parameters in pinned memory before copying it to the device, and asserts is_pinned() on
// the staging tensor. The hooks a Python backend registers (torch._C._acc.PrivateUse1Hooks)
// implement is_available, is_built and has_primary_context only; every other hook keeps the
// interface's default, and getPinnedMemoryAllocator's raises. The hooks can be registered once
// per process, so deferfuse_autoload registers these first, when this library was built for the
// torch that runs (the version is compared: the interface's layout is torch's), and PyTorch's
// Python hooks otherwise.
//
// Pinned memory here is ordinary CPU memory (a transfer to JAX needs no page-locked buffer), from
// an allocator that remembers its blocks so that is_pinned() is true for them and only them.
//
// Loaded with ctypes (deferfuse_autoload runs at import torch and must not import deferfuse): two
// C functions, no Python module.

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <mutex>
#include <unordered_set>

#ifndef DEFERFUSE_TORCH_VERSION
#error "build with -DDEFERFUSE_TORCH_VERSION=\"<torch.__version__>\" (setup.py does)"
#endif

namespace {

struct Blocks {
  std::mutex mu;
  std::unordered_set<const void*> live;
};

// Never destroyed: a pinned tensor may be freed while the process exits.
Blocks& blocks() {
  static Blocks* b = new Blocks();
  return *b;
}

void free_pinned(void* p) {
  {
    std::lock_guard<std::mutex> g(blocks().mu);
    blocks().live.erase(p);
  }
  c10::free_cpu(p);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n == 0 ? nullptr : c10::alloc_cpu(n);
    if (p != nullptr) {
      std::lock_guard<std::mutex> g(blocks().mu);
      blocks().live.insert(p);
    }
    return {p, p, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_pinned;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// untyped_storage().resize_ on a plain tpu tensor's storage (FSDP2): the plain tensor's library
// (_tpu_tensor.cpp, storage_resize) owns the storage's context, and gives its address when it is
// installed (deferfuse/plain.py); until then PyTorch's error stands.
using StorageResize = void (*)(const c10::Storage&, size_t);
std::atomic<StorageResize> storage_resize{nullptr};

struct TpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;   // JAX always has a device (its CPU backend at least)
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true;
  }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> g(blocks().mu);
    return blocks().live.count(data) != 0;
  }
  at::Allocator* getPinnedMemoryAllocator() const override {
    static PinnedAllocator* a = new PinnedAllocator();
    return a;
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t n) const override {
    StorageResize f = storage_resize.load();
    TORCH_CHECK(f != nullptr, "untyped_storage().resize_() on the tpu device needs deferfuse's "
                "C++ tensor extension, installed by `import deferfuse` (NOTE [storage resize])");
    f(storage, n);
  }
};

}  // namespace

extern "C" {

__attribute__((visibility("default"))) const char* deferfuse_hooks_torch_version() {
  return DEFERFUSE_TORCH_VERSION;
}

// 1: registered; 0: another PrivateUse1 hooks object was registered first (nothing changed).
__attribute__((visibility("default"))) int deferfuse_register_hooks() {
  if (at::isPrivateUse1HooksRegistered()) {
    return 0;
  }
  at::RegisterPrivateUse1HooksInterface(new TpuHooks());
  return 1;
}

// The plain tensor's storage_resize (NOTE [plain storage hooks] in _tpu_tensor.cpp).
__attribute__((visibility("default"))) void deferfuse_set_storage_resize(void* f) {
  storage_resize.store(reinterpret_cast<StorageResize>(f));
}

}  // extern "C"
