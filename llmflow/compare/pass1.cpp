// The compiled pass of compare_tensors: one read of a golden row `a` and a target row `b` (float32
// or bfloat16) gives every sum the metrics need. kernels.py holds the math (the N_VALUES it returns, in order)
// and the eager float64 reference this must agree with; llmflow.native builds this file once per
// machine for each instruction set (g++ -O3 -march=x86-64-v4|v3|v2|armv8-a -fopenmp) and the best
// build the CPU runs is called through ctypes (llmflow_pass1).
//
// Written with GCC/Clang vector extensions, not intrinsics: 16 lanes a step on any ISA the
// compiler targets, in registers of its width (see NB), no libm calls in the loops (a call makes the compiler spill every
// accumulator). Element-wise work is float32, exact for float32/bfloat16/float16 data. Products
// for the quadratic sums (cosine depends on them to the last bit) are formed in float64 (exact)
// and summed in float64. The other sums (|d|, rel, the softmax weights, y and z) are summed in
// float32 over BLOCK steps of each lane, then in float64: a block's partial sum is off by at most
// BLOCK ulps of the sum of its terms' magnitudes, and the conversions and float64 additions it
// saves make the pass ~1.3x faster.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <utility>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// The build target's register width: the widest vectors the compiler may use (x86-64-v4: 512
// bits; x86-64-v3: 256; x86-64-v2, aarch64's NEON and any other target: 128). Every vector type
// here is one register: GCC splits a wider one into scalar pieces (5x slower).
#if defined(__AVX512F__)
constexpr int NB = 64;
#elif defined(__AVX2__)
constexpr int NB = 32;
#else
constexpr int NB = 16;
#endif

// The sums have W = 16 lanes whatever the register width, so that every build adds the same
// terms in the same order and gives the same bits (where both targets have FMA: a target without
// it rounds the products the others fuse). A row is swept SWEEPS times, each sweep taking one
// register's worth of the 16 lanes of every step. Float64 lane j sums float lanes j and j + 8
// (widen_sum), so sweep s takes float lanes s*H .. s*H+H-1 and 8+s*H .. 8+s*H+H-1, H being the
// float64 lanes a register holds: its float64 sums are then whole registers too.
constexpr int W = 16;           // lanes of the sums: elements a step
constexpr int NF = NB / 4;      // float lanes a register
constexpr int H = NF / 2;       // float64 lanes a register
constexpr int SWEEPS = W / NF;  // sweeps of a row
constexpr int BLOCK = 8;        // steps summed in float32 before a float64 sum
constexpr int N_ROW = 20;       // values a row yields before the rows are merged
constexpr float EPS = 1.1920928955078125e-07f;

typedef float vf __attribute__((vector_size(NB)));
typedef float vfh __attribute__((vector_size(NB / 2)));  // half a register: H floats
typedef double vd __attribute__((vector_size(NB)));
typedef int32_t vi __attribute__((vector_size(NB)));
typedef uint16_t vu16 __attribute__((vector_size(NB / 2)));
typedef uint32_t vu32 __attribute__((vector_size(NB)));
typedef uint16_t vu16h __attribute__((vector_size(NB / 4)));
typedef uint32_t vu32h __attribute__((vector_size(NB / 2)));
inline vf splat(float v) { return vf{} + v; }
struct bf16 { uint16_t bits; };  // bfloat16: the top half of a float32, widened exactly by a shift

// the lane of the W-lane step that register lane j of sweep s holds
constexpr int step_lane(int s, int j) { return j < H ? s * H + j : 8 + s * H + (j - H); }

// Sweep s's lanes of the W elements at p: two runs of H elements, 8 apart, joined in registers
// (__builtin_shufflevector, GCC 12+ and Clang; older GCC joins them through memory, slower:
// a store of each half then a load of the whole stalls store forwarding).
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define LLMFLOW_SHUFFLE 1
#endif
#endif

inline vfh load_half(const float *p) { vfh v; std::memcpy(&v, p, sizeof v); return v; }
// Conversions between vectors of two sizes are written lane by lane: GCC 12 turns those into one
// instruction (vpmovzxwd, vcvtps2pd) where __builtin_convertvector takes the vector apart.
template <int... I>
inline vfh load_half(const bf16 *p, std::integer_sequence<int, I...>) {
    vu16h h;
    std::memcpy(&h, p, sizeof h);
    return (vfh)(vu32h{uint32_t(h[I])...} << 16);
}
inline vfh load_half(const bf16 *p) { return load_half(p, std::make_integer_sequence<int, H>{}); }
template <int... I>
inline vd widen(vfh h, std::integer_sequence<int, I...>) { return vd{double(h[I])...}; }
#ifdef LLMFLOW_SHUFFLE
template <int... I>
inline vf join(vfh lo, vfh hi, std::integer_sequence<int, I...>) { return __builtin_shufflevector(lo, hi, I...); }
template <int... I>
inline vfh pick(vf x, std::integer_sequence<int, I...>) { return __builtin_shufflevector(x, x, I...); }
template <int OFFSET, int... I>
inline vfh pick_from(vf x, std::integer_sequence<int, I...>) { return pick(x, std::integer_sequence<int, (OFFSET + I)...>{}); }
inline vf join(vfh lo, vfh hi) { return join(lo, hi, std::make_integer_sequence<int, NF>{}); }
inline vfh lower(vf x) { return pick_from<0>(x, std::make_integer_sequence<int, H>{}); }
inline vfh upper(vf x) { return pick_from<H>(x, std::make_integer_sequence<int, H>{}); }
#else
inline vf join(vfh lo, vfh hi) {
    vf v;
    std::memcpy(&v, &lo, sizeof lo);
    std::memcpy(reinterpret_cast<char *>(&v) + sizeof lo, &hi, sizeof hi);
    return v;
}
inline vfh lower(vf x) { vfh h; std::memcpy(&h, &x, sizeof h); return h; }
inline vfh upper(vf x) { vfh h; std::memcpy(&h, reinterpret_cast<const char *>(&x) + sizeof h, sizeof h); return h; }
#endif

template <class T>
inline vf load(const T *p, int s) {
    if constexpr (H == 8) {  // one run: the whole step
        if constexpr (sizeof(T) == 4) {
            vf v;
            std::memcpy(&v, p, sizeof v);
            return v;
        } else {
            vu16 h;
            std::memcpy(&h, p, sizeof h);
            return (vf)(__builtin_convertvector(h, vu32) << 16);
        }
    } else {
        return join(load_half(p + s * H), load_half(p + 8 + s * H));
    }
}

inline vd half(vf x, int which) {  // H floats of x widened
    return widen(which ? upper(x) : lower(x), std::make_integer_sequence<int, H>{});
}
inline vd widen_sum(vf x) { return half(x, 0) + half(x, 1); }
inline vf vmax(vf m, vf x) { return x > m ? x : m; }  // NaN is caught by the sums, not here
inline vf vmin(vf m, vf x) { return x < m ? x : m; }
// |x| by clearing the sign bit: one AND where x < 0 ? -x : x takes a compare, a negation and a
// blend (to keep -0 as -0). The two differ only in the sign of -0 and NaN, which no sum, maximum
// or comparison here can tell apart (0 + -0 = 0; NaN sends the piece to eager torch either way).
inline vf vabs(vf x) { return (vf)((vu32)x & 0x7fffffffu); }

// exp(x) for x <= 0 (0 below -87): 2^n * p(r), r = x - n ln2, p a degree-6 minimax polynomial
// (1.9e-9 relative, under fp32's rounding); n rounded to nearest even by adding 1.5 * 2^23
inline vf exp_neg(vf x) {
    const vf magic = splat(12582912.0f);
    vf n = (x * 1.4426950408889634f + magic) - magic;
    vf r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    vf p = r * 0.0013836828293278813f + 0.00837481115013361f;
    p = p * r + 0.04166822507977486f;
    p = p * r + 0.16666419804096222f;
    p = p * r + 0.49999991059303284f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
    return x < -87.0f ? splat(0.0f) : p * (vf)scale;
}

// phi(d) / d^2 = sum_k d^k / (k + 2)!, by Horner from term TERMS - 1: TERMS = 9 (to d^8) for
// |d| < 1 (truncation < 3e-8 relative), TERMS = 5 (to d^4) for |d| < 1/16 (< 4e-10)
constexpr float PHI[9] = {0.5f, 0.16666666666666666f, 0.041666666666666664f, 0.008333333333333333f,
                          0.001388888888888889f, 0.0001984126984126984f, 2.48015873015873e-05f,
                          2.7557319223985893e-06f, 2.755731922398589e-07f};

template <int TERMS>
inline vf phi_series(vf d) {
    vf p = splat(PHI[TERMS - 1]);
    for (int k = TERMS - 2; k >= 0; k--) p = p * d + PHI[k];
    return p;
}

struct Pass1 {  // maxima, exact quadratic sums, counts
    vd aa{}, bb{}, ab{}, dd{}, sad{}, srel{};
    vf block_ad{}, block_rel{}, mad{}, mrel{};
    vf ma = splat(-INFINITY), mb = splat(-INFINITY);
    vi c1{}, c5{};

    template <bool TAIL>
    void step(vf x, vf y, vi valid) {
        vf d = y - x, ad = vabs(d), ag = vabs(x);
        vf rel = ag > EPS ? ad / ag : splat(0.0f);
        vi v1 = rel < 1e-3f, v5 = rel < 5e-3f;
        if (TAIL) {  // lanes past the end: 0 adds nothing; the maxima ignore them
            const vf zero = splat(0.0f), ninf = splat(-INFINITY);
            ad = valid ? ad : zero; rel = valid ? rel : zero; v1 &= valid; v5 &= valid;
            ma = vmax(ma, valid ? x : ninf); mb = vmax(mb, valid ? y : ninf);
            x = valid ? x : zero; y = valid ? y : zero;
        } else {
            ma = vmax(ma, x); mb = vmax(mb, y);
        }
        vd xl = half(x, 0), xh = half(x, 1), yl = half(y, 0), yh = half(y, 1);
        vd dl = yl - xl, dh = yh - xh;
        aa += xl * xl + xh * xh; bb += yl * yl + yh * yh; ab += xl * yl + xh * yh; dd += dl * dl + dh * dh;
        block_ad += ad; block_rel += rel; c1 -= v1; c5 -= v5;
        mad = vmax(mad, ad); mrel = vmax(mrel, rel);
    }
    void flush() {
        sad += widen_sum(block_ad); srel += widen_sum(block_rel);
        block_ad = block_rel = vf{};
    }
};

// The second pass's form, by the row's largest |d| (the first pass's max): every |d| < 1 means
// exp(d) = 1 + d + phi(d) converges, so exp(b - mb) = exp(a - ma) * exp(d) * exp(ma - mb) costs 3
// products where a second exp_neg costs ~16 operations; under 1/16 four terms of the series do.
// Chosen per row, not per element: a test per vector of 16 costs more than it saves.
enum Spread { SMALL, UNDER_ONE, ANY, NO_SOFTMAX };  // the row's largest |d|: < 1/16, < 1, or more
// NO_SOFTMAX: the caller asked for no KL (llmflow_pass1's `softmax` 0), so the loop takes each side's
// minimum and plain sum only: on 256-bit and narrower builds the exp polynomials are most of the
// kernel's arithmetic (see docs/benchmarks.md). Not for a row whose largest |d| reaches
// OVERFLOW_SPREAD: there the softmax sums are taken anyway, because their float32 arithmetic may
// overflow (exp(max b - max a) past 88), and an overflow sends the piece to eager float64 torch,
// whose other values differ in the last bits; so a compare without the KL redoes the same pieces
// and writes the same other values as one with it.
constexpr float OVERFLOW_SPREAD = 64.0f;  // below it every softmax sum stays under ~1e29

// Each side's minimum and plain sum (its mean) are taken here, not in the first loop: this loop
// waits on its exp polynomials and has issue slots to spare; in the first they cost ~15%.
template <Spread S>
struct Pass2 {  // the softmax sums, weights exp(a - max a) and exp(b - max b) of this row
    vf ma, mb, scale_b, scale_ab, block_sa{}, block_sb{}, block_y{}, block_z{}, block_a{}, block_b{};
    vf na = splat(INFINITY), nb = splat(INFINITY);
    vd sa{}, sb{}, y{}, z{}, s_a{}, s_b{};

    template <bool TAIL>
    void step(vf xa, vf xb, vi valid) {
        vf ea, eb, zz, yd;
        if constexpr (S != NO_SOFTMAX) {
            vf d = xb - xa;
            ea = exp_neg(xa - ma);
            if (S == ANY) {
                eb = exp_neg(xb - mb);
                // ea * phi(d); beyond |d| = 1 through eb: ea * exp(d) = exp(b - ma) = eb * exp(mb - ma)
                zz = vabs(d) < 1.0f ? ea * (phi_series<9>(d) * (d * d)) : eb * scale_b - ea * (1.0f + d);
            } else {
                // every |d| < 1: exp(d) = 1 + d + phi(d) gives eb from ea, without a second exp
                vf phi = (S == SMALL ? phi_series<5>(d) : phi_series<9>(d)) * (d * d);
                zz = ea * phi;
                eb = ea * ((1.0f + d) + phi) * scale_ab;
            }
            yd = ea * d;
        }
        if (TAIL) {
            const vf zero = splat(0.0f), pinf = splat(INFINITY);
            if constexpr (S != NO_SOFTMAX) {
                ea = valid ? ea : zero; eb = valid ? eb : zero; zz = valid ? zz : zero; yd = valid ? yd : zero;
            }
            na = vmin(na, valid ? xa : pinf); nb = vmin(nb, valid ? xb : pinf);
            xa = valid ? xa : zero; xb = valid ? xb : zero;
        } else {
            na = vmin(na, xa); nb = vmin(nb, xb);
        }
        if constexpr (S != NO_SOFTMAX) {
            block_sa += ea; block_sb += eb; block_y += yd; block_z += zz;
        }
        block_a += xa; block_b += xb;
    }
    void flush() {
        if constexpr (S != NO_SOFTMAX) {
            sa += widen_sum(block_sa); sb += widen_sum(block_sb); y += widen_sum(block_y); z += widen_sum(block_z);
        }
        s_a += widen_sum(block_a); s_b += widen_sum(block_b);
        block_sa = block_sb = block_y = block_z = block_a = block_b = vf{};
    }
};

// The reductions of a sum's W lanes in lane order, over the SWEEPS registers that hold them
// (lane order matters: it decides the float64 rounding, and which zero a max of -0 and 0 keeps).
template <class P>
double hsum(const P *p, vd P::*sum) {  // the W / 2 float64 lanes, sweep s holding s*H .. s*H+H-1
    double t = 0;
    for (int s = 0; s < SWEEPS; s++)
        for (int j = 0; j < H; j++) t += (p[s].*sum)[j];
    return t;
}
template <class P, class V>
auto lane(const P *p, V P::*v, int l) {  // lane l of the W lanes (the inverse of step_lane)
    int q = l % 8;
    return (p[q / H].*v)[l < 8 ? q % H : H + q % H];
}
template <class P>
float hmax(const P *p, vf P::*v) {
    float m = lane(p, v, 0);
    for (int l = 1; l < W; l++) m = lane(p, v, l) > m ? lane(p, v, l) : m;
    return m;
}
template <class P>
float hmin(const P *p, vf P::*v) {
    float m = lane(p, v, 0);
    for (int l = 1; l < W; l++) m = lane(p, v, l) < m ? lane(p, v, l) : m;
    return m;
}
template <class P>
int64_t count(const P *p, vi P::*c) {
    int64_t t = 0;
    for (int s = 0; s < SWEEPS; s++)
        for (int j = 0; j < NF; j++) t += (p[s].*c)[j];
    return t;
}

// The next row's bytes, fetched into L2 a few cache lines a block while this row's sweeps run.
// Only a row's first sweep reads memory; the others read the row from cache while the memory
// bus idles. One core streams memory at about the speed of the arithmetic, so without this the
// first sweep of every row waits on memory and the rest of the row's work waits on nothing:
// fetching ahead overlaps the two (docs/benchmarks.md). Hints only: no result depends on them,
// and a prefetch of an address not mapped yet is dropped, never a fault.
struct Ahead {
    const char *a = nullptr, *b = nullptr;
    int64_t a_bytes = 0, b_bytes = 0, done = 0, per_block = 0;  // done: bytes of each side fetched so far

    void block() {  // the next per_block lines of each side
        for (int64_t k = 0; k < per_block && (done < a_bytes || done < b_bytes); k++, done += 64) {
            if (done < a_bytes) __builtin_prefetch(a + done, 0, 2);
            if (done < b_bytes) __builtin_prefetch(b + done, 0, 2);
        }
    }
};

// sweep s of a row: its lanes of every step
template <class P, class A, class B>
void sweep(P &out, const A *a, const B *b, int64_t n, int s, Ahead &ahead) {
    // The sums live in a local copy: `out` is memory that a float load from a or b might alias,
    // so summing into it directly makes the compiler store every accumulator at every step
    // (~1.1x on bfloat16 rows of the x86-64-v3 build).
    P p = out;
    int64_t full = n - n % W;
    for (int64_t i0 = 0; i0 < full; i0 += BLOCK * W) {
        int64_t end = i0 + BLOCK * W < full ? i0 + BLOCK * W : full;
        for (int64_t i = i0; i < end; i += W) p.template step<false>(load(a + i, s), load(b + i, s), vi{});
        p.flush();
        ahead.block();
    }
    if (full < n) {  // the last n % W elements, from a zero-padded copy (no read past the end)
        A ta[W] = {};
        B tb[W] = {};
        vi valid{};
        for (int j = 0; j < NF; j++) valid[j] = step_lane(s, j) < n - full ? -1 : 0;
        std::memcpy(ta, a + full, (n - full) * sizeof(A));
        std::memcpy(tb, b + full, (n - full) * sizeof(B));
        p.template step<true>(load(ta, s), load(tb, s), valid);
        p.flush();
    }
    out = p;
}

template <class P, class A, class B>
void second_pass(const P &start, const A *a, const B *b, int64_t n, double *t, Ahead &ahead) {
    P p[SWEEPS];
    for (int s = 0; s < SWEEPS; s++) {
        p[s] = start;
        sweep(p[s], a, b, n, s, ahead);
    }
    t[0] = hsum(p, &P::sa); t[1] = hsum(p, &P::sb); t[2] = hsum(p, &P::y); t[3] = hsum(p, &P::z);
    t[4] = hmin(p, &P::na); t[5] = hsum(p, &P::s_a); t[6] = hmin(p, &P::nb); t[7] = hsum(p, &P::s_b);
}

// one row: its N_ROW values (the first loop reads a and b from memory, the second from cache),
// fetching the next row's `next` elements (0: none) into cache meanwhile; without `softmax` the
// softmax sums are left 0
template <class A, class B>
void one_row(const A *a, const B *b, int64_t n, int64_t next, bool softmax, double *r) {
    Ahead ahead{reinterpret_cast<const char *>(a + n), reinterpret_cast<const char *>(b + n),
                next * int64_t(sizeof(A)), next * int64_t(sizeof(B))};
    int64_t lines = ((ahead.a_bytes > ahead.b_bytes ? ahead.a_bytes : ahead.b_bytes) + 63) / 64;
    int64_t blocks = 2 * SWEEPS * ((n + BLOCK * W - 1) / (BLOCK * W));  // every sweep's blocks
    ahead.per_block = (lines + blocks - 1) / blocks;
    Pass1 p[SWEEPS];
    for (int s = 0; s < SWEEPS; s++) sweep(p[s], a, b, n, s, ahead);
    float ma = hmax(p, &Pass1::ma), mb = hmax(p, &Pass1::mb), spread = hmax(p, &Pass1::mad);
    const vf va = splat(ma), vb = splat(mb);
    const vf scale_b = splat(std::exp(mb - ma)), scale_ab = splat(std::exp(ma - mb));
    double t[8];
    if (!softmax && spread < OVERFLOW_SPREAD)
        second_pass(Pass2<NO_SOFTMAX>{va, vb, scale_b, scale_ab}, a, b, n, t, ahead);
    else if (spread < 0.0625f) second_pass(Pass2<SMALL>{va, vb, scale_b, scale_ab}, a, b, n, t, ahead);
    else if (spread < 1.0f) second_pass(Pass2<UNDER_ONE>{va, vb, scale_b, scale_ab}, a, b, n, t, ahead);
    else second_pass(Pass2<ANY>{va, vb, scale_b, scale_ab}, a, b, n, t, ahead);
    const double v[N_ROW] = {hsum(p, &Pass1::aa), hsum(p, &Pass1::bb), hsum(p, &Pass1::ab),
                             hsum(p, &Pass1::dd), hmax(p, &Pass1::mad), hsum(p, &Pass1::sad),
                             hmax(p, &Pass1::mrel), hsum(p, &Pass1::srel), double(count(p, &Pass1::c1)),
                             double(count(p, &Pass1::c5)), ma, t[0], mb, t[1], t[2], t[3], t[4], t[5],
                             t[6], t[7]};
    std::memcpy(r, v, sizeof v);
}

template <class A, class B>
void all_rows(const void *a, const void *b, int64_t n, int64_t row, int64_t rows, int threads, bool softmax,
              double *r) {
    (void)threads;  // without OpenMP (-fopenmp refused): one thread
    // Each thread takes a run of consecutive rows (as schedule(static) would), so that the row
    // it fetches ahead is the one it reads next.
#pragma omp parallel num_threads(threads) if (rows > 1)
    {
        int64_t first = 0, last = rows;
#ifdef _OPENMP
        int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        first = rows * me / team;
        last = rows * (me + 1) / team;
#endif
        for (int64_t i = first; i < last; i++) {
            int64_t start = i * row, stop = start + row < n ? start + row : n;
            int64_t next = i + 1 < last ? (stop + row < n ? stop + row : n) - stop : 0;
            one_row(static_cast<const A *>(a) + start, static_cast<const B *>(b) + start, stop - start, next,
                    softmax, r + i * N_ROW);
        }
    }
}

}  // namespace

// n elements of a and b (each float32, or bfloat16 where a_bf16 / b_bf16) as rows of `row`
// elements (the last may be shorter), rows in parallel on `threads` threads, merged here: the 20
// values of kernels.pass1 into out; where `softmax` is 0 (no KL wanted) values 10-13, the softmax
// sums, are 0 and not computed (NaN where a row's would overflow: see OVERFLOW_SPREAD). Returns 0,
// or -1 when out of memory.
extern "C" int llmflow_pass1(const void *a, int a_bf16, const void *b, int b_bf16, int64_t n, int64_t row,
                             int threads, double *out, int softmax) {
    int64_t rows = (n + row - 1) / row;
    double stack[64 * N_ROW];
    double *r = rows <= 64 ? stack : static_cast<double *>(std::malloc(rows * N_ROW * sizeof(double)));
    if (!r) return -1;
    if (a_bf16 && b_bf16) all_rows<bf16, bf16>(a, b, n, row, rows, threads, softmax != 0, r);
    else if (a_bf16) all_rows<bf16, float>(a, b, n, row, rows, threads, softmax != 0, r);
    else if (b_bf16) all_rows<float, bf16>(a, b, n, row, rows, threads, softmax != 0, r);
    else all_rows<float, float>(a, b, n, row, rows, threads, softmax != 0, r);
    // rows merged with weights relative to the largest row maximum (online softmax)
    double top_a = -INFINITY, top_b = -INFINITY;
    for (int64_t i = 0; i < rows; i++) {
        top_a = r[i * N_ROW + 10] > top_a ? r[i * N_ROW + 10] : top_a;
        top_b = r[i * N_ROW + 12] > top_b ? r[i * N_ROW + 12] : top_b;
    }
    double o[20] = {0}, sa = 0, sb = 0, y = 0, z = 0;
    o[4] = o[6] = -INFINITY;
    o[15] = o[18] = INFINITY;
    for (int64_t i = 0; i < rows; i++) {
        const double *x = r + i * N_ROW;
        for (int k : {0, 1, 2, 3, 5, 7, 8, 9}) o[k] += x[k];
        o[4] = x[4] > o[4] ? x[4] : o[4];
        o[6] = x[6] > o[6] ? x[6] : o[6];
        o[15] = x[16] < o[15] ? x[16] : o[15];
        o[18] = x[18] < o[18] ? x[18] : o[18];
        o[16] += x[17];
        o[19] += x[19];
        double wa = std::exp(x[10] - top_a), wb = std::exp(x[12] - top_b);
        sa += wa * x[11]; sb += wb * x[13]; y += wa * x[14]; z += wa * x[15];
    }
    o[10] = std::log(sa) + top_a; o[11] = std::log(sb) + top_b; o[12] = y / sa; o[13] = z / sa;
    o[14] = top_a; o[17] = top_b;
    if (!softmax) {  // 0, or NaN where a row's softmax sums overflowed
        bool overflow = false;
        for (int64_t i = 0; i < rows; i++)
            for (int k : {11, 13, 14, 15}) overflow = overflow || !std::isfinite(r[i * N_ROW + k]);
        o[10] = o[11] = o[12] = o[13] = overflow ? NAN : 0;
    }
    std::memcpy(out, o, sizeof o);
    if (r != stack) std::free(r);
    return 0;
}
