// A tensor's metadata in one call through torch's C++ API, for the dump's capture (capture.cpp).
//
// A first capture reads seven things of a tensor (its version counter, whether it is on the CPU
// and contiguous, its element count, data pointer and sizes, whether it requires grad); a tensor
// dump four more (its byte count; whether it is strided, a lazy negation or a lazy conjugate,
// whose memory is not its values). Through torch's Python bindings each is a separate code path
// (is_contiguous() goes through torch's argument parser), and inside a forward pass every module
// call finds those paths evicted from the caches by the layer's weights: ~6 us a tensor cold
// against ~1.5 us warm (docs/benchmarks.md). Here they are read from the at::Tensor in a few loads.
//
// Built against the headers and libraries of the torch this process imports (llmflow.native's
// TENSOR_META: the build key covers torch's version and path), so it never reads a tensor laid
// out by another torch. Anything unusual (an inference tensor has no version counter, sizes that
// are symbolic, more than MAX_DIMS dimensions, a tensor without storage, any C++ exception)
// returns 0 and the capture reads through Python as before, or leaves the leaf to Python.

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

namespace {
constexpr int MAX_DIMS = 8;
}

// capture.cpp's TensorMeta, field for field (tensor_meta.py mirrors it for the check)
struct TensorMeta {
    int64_t version, numel, nbytes;
    void *data;  // null unless on the CPU with elements
    int64_t sizes[MAX_DIMS];
    int32_t ndim;
    int8_t has_version, is_cpu, contiguous, requires_grad, strided, is_neg, is_conj;
};
static_assert(sizeof(TensorMeta) == 112, "TensorMeta changed: change capture.cpp and tensor_meta.py too");

// obj: a torch.Tensor (its exact type; the caller checks). 1 read, 0 not read (no error set).
extern "C" int llmflow_tensor_meta(PyObject *obj, TensorMeta *m) noexcept {
    try {
        const at::Tensor &t = THPVariable_Unpack(obj);
        if (!t.defined() || t.is_inference()) return 0;  // (an inference tensor: no version counter)
        const int64_t ndim = t.dim();
        if (ndim > MAX_DIMS) return 0;
        const c10::IntArrayRef sizes = t.sizes();
        for (int64_t i = 0; i < ndim; i++) m->sizes[i] = sizes[i];
        m->ndim = static_cast<int32_t>(ndim);
        m->has_version = 1;
        m->version = static_cast<int64_t>(t._version());
        m->is_cpu = t.is_cpu();
        m->numel = t.numel();
        m->contiguous = t.is_contiguous();
        m->requires_grad = t.requires_grad();
        m->nbytes = static_cast<int64_t>(t.nbytes());
        m->strided = t.layout() == c10::kStrided;
        m->is_neg = t.is_neg();
        m->is_conj = t.is_conj();
        m->data = nullptr;
        if (m->is_cpu && m->numel > 0) {
            if (!t.has_storage()) return 0;
            m->data = const_cast<void *>(t.const_data_ptr());
        }
        return 1;
    } catch (...) {
        return 0;
    }
}
