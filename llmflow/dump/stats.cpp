// The statistics of one CPU tensor, for a statistics-mode dump: max, min, mean, L2 norm, NaN
// count, Inf count (STAT_KEYS order), written as 6 doubles.
//
// Called once per captured tensor from the forward pass (through ctypes, see stats.py): a decode
// step of a small model captures hundreds of tensors of a few KB each, so what matters is the
// cost of a call, not bandwidth. This replaces a copy of the tensor now and batched torch
// reductions later. Element-wise work is float32 (exact for bfloat16/float16 data), 8 lanes of
// GCC/Clang vector extensions; sums of 8 steps of a lane are float32, then float64, as in the
// compare kernel (pass1.cpp). Semantics follow torch: any NaN makes max, min, mean and norm NaN.
// Integer tensors (token ids, positions: a few elements each) are summed in float64, as
// batched_stats does.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));

enum Dtype { F32 = 0, BF16 = 1, F16 = 2, I64 = 3, I32 = 4 };

// float16 widened exactly, in the form each compiler takes: ARM's __fp16 (GCC before 13 has no
// _Float16 in C++ on aarch64, though it defines __FLT16_MAX__), _Float16 on x86 (one vcvtph2ps
// with F16C), and elsewhere from the bits.
#if defined(__ARM_FP16_FORMAT_IEEE)
inline float widen_half(uint16_t h) { __fp16 v; std::memcpy(&v, &h, 2); return v; }
#elif defined(__SSE2__) && defined(__FLT16_MAX__)
inline float widen_half(uint16_t h) { _Float16 v; std::memcpy(&v, &h, 2); return v; }
#else
inline float widen_half(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
        float f = float(mantissa) * 5.9604644775390625e-08f;
        std::memcpy(&bits, &f, 4);
        bits |= sign;
    } else {  // Inf and NaN (exponent 31) keep all ones; the others are rebiased (15 -> 127)
        bits = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | mantissa << 13;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
#endif

template <int DT>
inline float load(const void* p, int64_t i) {
    if constexpr (DT == F32) {
        return static_cast<const float*>(p)[i];
    } else if constexpr (DT == BF16) {
        uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    } else {
        return widen_half(static_cast<const uint16_t*>(p)[i]);
    }
}

// NaN and Inf counts: the slow pass, run only when the fast one met a non-finite value
template <int DT>
void count_non_finite(const void* x, int64_t n, int64_t* nans, int64_t* infinities) {
    *nans = *infinities = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = load<DT>(x, i);
        *nans += v != v;
        *infinities += std::isinf(v);
    }
}

// One pass for max, min, sum and sum of squares. NaN and Inf are not counted in it: a NaN makes
// the sum NaN and an Inf the sum of squares Inf, so a finite sum and sum of squares prove there
// were none, and only a tensor that holds one (or whose squares overflow float32) is read again
// to count them. The loop does half the vector work it would counting every element.
template <int DT>
void stats(const void* x, int64_t n, double* out) {
    constexpr int64_t LANES = 8, BLOCK = 8;  // a block: 8 steps of 8 lanes
    const v8f inf = {INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY};
    v8f vmax = -inf, vmin = inf;
    v8d sum = {0}, sq = {0};
    int64_t i = 0;
    for (; i + LANES * BLOCK <= n; i += LANES * BLOCK) {
        v8f s = {0}, q = {0};
        for (int64_t j = 0; j < BLOCK; j++) {
            v8f v;
            for (int k = 0; k < LANES; k++) v[k] = load<DT>(x, i + j * LANES + k);
            vmax = v > vmax ? v : vmax;  // (a NaN never wins a comparison: it shows in the sum)
            vmin = v < vmin ? v : vmin;
            s += v;
            q += v * v;
        }
        sum += __builtin_convertvector(s, v8d);
        sq += __builtin_convertvector(q, v8d);
    }
    double total = 0, squares = 0;
    float mx = -INFINITY, mn = INFINITY;
    for (int k = 0; k < LANES; k++) {
        mx = vmax[k] > mx ? vmax[k] : mx;
        mn = vmin[k] < mn ? vmin[k] : mn;
        total += sum[k];
        squares += sq[k];
    }
    for (; i < n; i++) {
        float v = load<DT>(x, i);
        mx = v > mx ? v : mx;
        mn = v < mn ? v : mn;
        total += v;
        squares += static_cast<double>(v) * v;
    }
    int64_t nans = 0, infinities = 0;
    if (!std::isfinite(total) || !std::isfinite(squares)) count_non_finite<DT>(x, n, &nans, &infinities);
    if (nans) {
        out[0] = out[1] = out[2] = out[3] = NAN;
    } else {
        out[0] = mx;
        out[1] = mn;
        out[2] = total / static_cast<double>(n);
        out[3] = std::sqrt(squares);
    }
    out[4] = static_cast<double>(nans);
    out[5] = static_cast<double>(infinities);
}

template <typename T>
void integer_stats(const T* x, int64_t n, double* out) {
    T mx = x[0], mn = x[0];
    double total = 0, squares = 0;
    for (int64_t i = 0; i < n; i++) {
        mx = x[i] > mx ? x[i] : mx;
        mn = x[i] < mn ? x[i] : mn;
        double v = static_cast<double>(x[i]);
        total += v;
        squares += v * v;
    }
    out[0] = static_cast<double>(mx);
    out[1] = static_cast<double>(mn);
    out[2] = total / static_cast<double>(n);
    out[3] = std::sqrt(squares);
    out[4] = out[5] = 0;
}

}  // namespace

// x: n > 0 contiguous elements of dtype (see Dtype: stats.py's KERNEL_DTYPES); out: 6 doubles.
extern "C" void llmflow_stats(const void* x, int dtype, int64_t n, double* out) {
    switch (dtype) {
        case BF16: stats<BF16>(x, n, out); break;
        case F16: stats<F16>(x, n, out); break;
        case I64: integer_stats(static_cast<const int64_t*>(x), n, out); break;
        case I32: integer_stats(static_cast<const int32_t*>(x), n, out); break;
        default: stats<F32>(x, n, out);
    }
}
