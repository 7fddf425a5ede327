// CPU kernels for the engine step of a Llama-family decoder (fp32 or bf16), built at first use for the CPU at hand
// (kernels/cpu.py compiles this file with -march=native and falls back to torch when it cannot).
//
// Why: a decode step of SmolLM2-135M launches ~50 small torch ops per layer (norm, RoPE, cache write, attention
// plumbing, SwiGLU), each a few microseconds of dispatch, and ATen's CPU flash attention spreads a one-token step
// over (head x query block) work items: 3 items for 2 threads. These kernels do each of those jobs in one call.
//
// Every kernel computes a row's result the same way whatever the number of rows in the call (fixed 16-lane
// accumulators, fixed reduction order), so a verify pass and a decode step agree bit for bit on these parts.
// The plain-torch references beside them are in kernels/cpu.py (`*_reference`), and tests/test_cpu_kernels.py
// checks each against its reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int V = 16;  // accumulator lanes: one AVX-512 register of fp32
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Sum of a[i] * b[i] over n, in 16 lanes then a fixed tree: the same order for every call.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[V] = {};
  int64_t i = 0;
  for (; i + V <= n; i += V)
    for (int j = 0; j < V; j++) acc[j] = std::fma(a[i + j], b[i + j], acc[j]);
  for (int w = V / 2; w > 0; w /= 2)
    for (int j = 0; j < w; j++) acc[j] += acc[j + w];
  float s = acc[0];
  for (; i < n; i++) s = std::fma(a[i], b[i], s);
  return s;
}

// A native vector of fp32 for the tiled kernels: GCC vector types, so one source builds for AVX-512 (16 lanes), AVX2
// (8) or anything else the compiler splits them for. Loads and stores go through memcpy: no alignment assumed.
#if defined(__AVX512F__)
constexpr int L = 16;
#else
constexpr int L = 8;
#endif
typedef float vfloat __attribute__((vector_size(L * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(L * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(L * sizeof(uint32_t))));

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// The few operations exp_nonpos needs, for a float and for a vector of them.
// A float broadcast to every lane, through the intrinsic: one load-broadcast where x comes from memory. `F{} + x` keeps
// the addition (0.0 + -0.0 is +0.0): a scalar add and a register shuffle on a multiply-add's port per operand; a loop
// of lane stores made the attention tiles 2x slower (GCC 12, AVX2).
template <typename F>
inline F splat(float x) {
  if constexpr (std::is_same_v<F, float>) {
    return x;
  } else {
#if defined(__AVX512F__)
    const __m512 r = _mm512_set1_ps(x);
#elif defined(__AVX__)
    const __m256 r = _mm256_set1_ps(x);
#else
    F r;
    for (int i = 0; i < L; i++) r[i] = x;
#endif
    return reinterpret_cast<const F&>(r);
  }
}
inline float vmax(float a, float b) { return std::max(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return a < b ? b : a; }
// a float's (or each lane's) bits shifted left by 23, as a float: the exponent field of 2^n from an integer n + 127
// held in the low bits of a float's mantissa
inline float shl23(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  u <<= 23;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}
inline vfloat shl23(vfloat x) { return (vfloat)((vuint)x << 23); }

// a * b + c rounded once, for a float or lane by lane. The build fuses nothing itself (-ffp-contract=off,
// kernels/cpu.py): every multiply-add is written out, so an expression computes the same bits in every function it is
// inlined into (a verify pass and a decode step run different tile heights); a float a is broadcast.
inline float vfma(float a, float b, float c) { return std::fma(a, b, c); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  __m512 r = _mm512_fmadd_ps(reinterpret_cast<__m512&>(a), reinterpret_cast<__m512&>(b), reinterpret_cast<__m512&>(c));
  return reinterpret_cast<vfloat&>(r);
#elif defined(__FMA__) && defined(__AVX__)
  __m256 r = _mm256_fmadd_ps(reinterpret_cast<__m256&>(a), reinterpret_cast<__m256&>(b), reinterpret_cast<__m256&>(c));
  return reinterpret_cast<vfloat&>(r);
#else
  vfloat r;
  for (int i = 0; i < L; i++) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}
inline vfloat vfma(float a, vfloat b, vfloat c) { return vfma(splat<vfloat>(a), b, c); }

// exp for x <= 0 (softmax after subtracting the max): 2^n * e^r, |r| <= ln2/2, for a float (written so the compiler
// vectorises a loop of it) or a vector of floats. n comes rounded to nearest from adding 1.5 * 2^23 (+ 127, the
// exponent's bias): the sum's low mantissa bits are then n + 127, the bits of 2^n once shifted into the exponent.
// e^r: 1 + r + r^2 q(r), q of degree 4 fitted for the least relative error on [-ln2/2, ln2/2] (1.9e-9 before
// rounding; within 0.87 ulp of e^x over [-87, 0] in fp32).
template <typename F>
inline F exp_nonpos(F x) {
  const F magic = splat<F>(12583039.0f);  // 1.5 * 2^23 + 127
  x = vmax(x, splat<F>(-87.0f));          // 2^n stays a normal float (n >= -126)
  const F t = vfma(x, splat<F>(1.44269504088896341f), magic);
  const F n = t - magic;
  const F r = vfma(n, splat<F>(-1.428606765330187e-06f), vfma(n, splat<F>(-0.693145751953125f), x));
  F p = splat<F>(0.0013814570847898722f);
  p = vfma(p, r, splat<F>(0.008368730545043945f));
  p = vfma(p, r, splat<F>(0.04166838899254799f));
  p = vfma(p, r, splat<F>(0.1666652113199234f));
  p = vfma(p, r, splat<F>(0.4999999403953552f));
  p = vfma(p, r, splat<F>(1.0f));
  p = vfma(p, r, splat<F>(1.0f));
  return p * shl23(t);
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a CPU float32 tensor");
}

// ----------------------------------------------------------------------------- element types
// Activations and the K/V cache are fp32 or bf16 (c10::BFloat16); the arithmetic is fp32 for both. A kernel is one
// template over the element type T: loads widen to fp32 (exact), and where the model rounds an op's output to its
// dtype (a bf16 model: each torch op's result), round_elem<T> does the same rounding (nothing for fp32).
using bf16 = c10::BFloat16;

// x rounded to bf16, to nearest even (NaN -> 0x7FC0), as torch rounds: the 16 bits. Branch-free, so loops vectorise.
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const auto r = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return x != x ? uint16_t{0x7FC0} : r;
}
inline float bf16_value(uint16_t bits) {
  const uint32_t u = uint32_t{bits} << 16;
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}
inline float load_elem(const float* p) { return *p; }
inline float load_elem(const bf16* p) { return bf16_value(p->x); }
inline void store_elem(float* p, float x) { *p = x; }
inline void store_elem(bf16* p, float x) { p->x = bf16_bits(x); }
template <typename T>
inline float round_elem(float x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return bf16_value(bf16_bits(x));
}

// A vector of L elements widened to fp32.
typedef uint16_t vbits __attribute__((vector_size(L * sizeof(uint16_t))));
inline vfloat vload(const bf16* p) {
#if defined(__AVX2__) && !defined(__AVX512F__)  // one vpmovzxwd from memory (GCC's generic widening takes four)
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const vuint u = reinterpret_cast<const vuint&>(w) << 16;
#else
  vbits h;
  std::memcpy(&h, p, sizeof(h));
  const vuint u = __builtin_convertvector(h, vuint) << 16;
#endif
  vfloat v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

void check_elem(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16),
              name, " must be a CPU float32 or bfloat16 tensor");
}

void check_same_dtype(const char* who, const torch::Tensor& a, const torch::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), who, ": tensors of one call share a dtype (", a.scalar_type(),
              " and ", b.scalar_type(), ")");
}

// fn(T{}) with T the element type of t (float or bf16)
template <typename Fn>
auto by_elem(const torch::Tensor& t, Fn fn) {
  if (t.scalar_type() == torch::kBFloat16) return fn(bf16{});
  return fn(float{});
}

// The shapes of an attention call over one layer's cache (tile_attention), checked: q [H, n, D] (made contiguous),
// k_cache / v_cache [Hkv, capacity, D] with contiguous rows and q's dtype, positions start..start+n inside the
// capacity, mask [n, n] (made bool and contiguous) or none.
struct CacheCall {
  torch::Tensor q, mask;
  int64_t H, n, D, hkv, g;
  const bool* mp;  // the mask's entries, or nullptr (causal)
};

CacheCall check_cache_call(const char* who, const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, int64_t start, const c10::optional<torch::Tensor>& mask) {
  check_elem(q, "q");
  check_elem(k_cache, "k_cache");
  check_elem(v_cache, "v_cache");
  check_same_dtype(who, q, k_cache);
  check_same_dtype(who, q, v_cache);
  TORCH_CHECK(q.dim() == 3, who, ": q must be [heads, n, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), who,
              ": k_cache and v_cache must both be [kv_heads, capacity, head_dim]");
  CacheCall c{q.contiguous(), {}, q.size(0), q.size(1), q.size(2), k_cache.size(0), 0, nullptr};
  TORCH_CHECK(c.hkv > 0 && c.H % c.hkv == 0 && k_cache.size(2) == c.D, who, ": head shapes do not match");
  c.g = c.H / c.hkv;
  TORCH_CHECK(c.n >= 1 && start >= 0 && start + c.n <= k_cache.size(1), who, ": positions ", start, "..", start + c.n,
              " out of range");
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == c.D && v_cache.stride(2) == 1 &&
                  v_cache.stride(1) == c.D,
              who, ": cache rows must be contiguous");
  if (mask.has_value()) {
    c.mask = mask->to(torch::kBool).contiguous();
    TORCH_CHECK(c.mask.dim() == 2 && c.mask.size(0) == c.n && c.mask.size(1) == c.n, who, ": mask must be [n, n]");
    c.mp = c.mask.data_ptr<bool>();
  }
  return c;
}

}  // namespace

// RMSNorm over the last dim of x [T, C]: x * rsqrt(mean(x^2) + eps) * w, fp32 or bf16 x (w in either dtype). A bf16
// model rounds the normalised row to bf16 before the weight, then the product (as its torch ops do).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_elem(x, "x");
  check_elem(w, "w");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t C = x.size(-1), T = x.numel() / C;
  TORCH_CHECK(w.numel() == C, "rms_norm: weight has ", w.numel(), " entries for rows of ", C);
  auto y = torch::empty_like(x);
  by_elem(x, [&](auto xe) {
    using E = decltype(xe);
    by_elem(w, [&](auto we) {
      using W = decltype(we);
      const E* xp = x.data_ptr<E>();
      const W* wp = w.data_ptr<W>();
      E* yp = y.data_ptr<E>();
      at::parallel_for(0, T, 64, [&](int64_t a, int64_t e) {
        std::vector<float> wide(std::is_same_v<E, float> ? 0 : C);  // a bf16 row widened
        for (int64_t t = a; t < e; t++) {
          const float* row;
          if constexpr (std::is_same_v<E, float>) {
            row = xp + t * C;
          } else {
            for (int64_t c = 0; c < C; c++) wide[c] = load_elem(xp + t * C + c);
            row = wide.data();
          }
          const float inv = 1.0f / std::sqrt(dot(row, row, C) / static_cast<float>(C) + static_cast<float>(eps));
          E* out = yp + t * C;
          for (int64_t c = 0; c < C; c++) store_elem(out + c, load_elem(wp + c) * round_elem<E>(row[c] * inv));
        }
      });
      return 0;
    });
    return 0;
  });
  return y;
}

// silu(gate) * up for gate_up [T, 2I] (gate first) -> [T, I], fp32 or bf16 (silu rounded to the dtype, then the
// product, as the torch ops).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_elem(gate_up, "gate_up");
  gate_up = gate_up.contiguous();
  const int64_t I2 = gate_up.size(-1), I = I2 / 2, T = gate_up.numel() / I2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, gate_up.options());
  by_elem(gate_up, [&](auto elem) {
    using E = decltype(elem);
    const E* g = gate_up.data_ptr<E>();
    E* yp = y.data_ptr<E>();
    at::parallel_for(0, T, 16, [&](int64_t a, int64_t e) {
      for (int64_t t = a; t < e; t++) {
        const E* gr = g + t * I2;
        const E* ur = gr + I;
        E* out = yp + t * I;
        for (int64_t i = 0; i < I; i++) {  // sigmoid from e^-|x| (never overflows), vectorisable
          const float x = load_elem(gr + i), ex = exp_nonpos(-std::fabs(x));
          store_elem(out + i, round_elem<E>(x * ((x >= 0.0f ? 1.0f : ex) / (1.0f + ex))) * load_elem(ur + i));
        }
      }
    });
    return 0;
  });
  return y;
}

// RoPE on the q and k parts of qkv rows [row0, row0 + n) (qkv [T, (H + 2 Hkv) D], half-rotation layout, cos/sin
// [T, D]); the rotated k and the v of those rows are written to positions start..start+n of one layer's cache
// (k_cache / v_cache [Hkv, capacity, D], last two dims contiguous). All in one dtype, fp32 or bf16 (bf16: each
// product rounded, then the sum, as the torch ops; the same for every row). Returns q as [H, n, D] in that dtype.
torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, int64_t row0, int64_t n, int64_t start, int64_t n_heads) {
  for (const auto* t : {&qkv, &cos, &sin, &k_cache, &v_cache}) {
    check_elem(*t, "rope_write's tensors");
    check_same_dtype("rope_write", qkv, *t);
  }
  const int64_t hkv = k_cache.size(0), cap = k_cache.size(1), D = k_cache.size(2), half = D / 2;
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "rope_write: contiguous inputs");
  TORCH_CHECK(qkv.size(1) == (n_heads + 2 * hkv) * D, "rope_write: qkv width does not match the heads");
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == D && v_cache.stride(2) == 1 && v_cache.stride(1) == D,
              "rope_write: cache rows must be contiguous");
  TORCH_CHECK(start >= 0 && start + n <= cap, "rope_write: positions ", start, "..", start + n, " exceed capacity ",
              cap);
  auto q = torch::empty({n_heads, n, D}, qkv.options());
  by_elem(qkv, [&](auto elem) {
    using E = decltype(elem);
    const int64_t W = qkv.size(1);
    const E* src = qkv.data_ptr<E>();
    const E* cp = cos.data_ptr<E>();
    const E* sp = sin.data_ptr<E>();
    E* qp = q.data_ptr<E>();
    E* kc = k_cache.data_ptr<E>();
    E* vc = v_cache.data_ptr<E>();
    const int64_t ksh = k_cache.stride(0), vsh = v_cache.stride(0);
    const int64_t heads = n_heads + 2 * hkv;
    at::parallel_for(0, n * heads, 64, [&](int64_t a, int64_t e) {
      for (int64_t idx = a; idx < e; idx++) {
        const int64_t t = idx / heads, h = idx % heads;
        const E* x = src + (row0 + t) * W + h * D;
        const E* c = cp + (row0 + t) * D;
        const E* s = sp + (row0 + t) * D;
        E* out;
        if (h < n_heads) {
          out = qp + (h * n + t) * D;
        } else if (h < n_heads + hkv) {
          out = kc + (h - n_heads) * ksh + (start + t) * D;
        } else {
          std::memcpy(vc + (h - n_heads - hkv) * vsh + (start + t) * D, x, D * sizeof(E));
          continue;
        }
        const auto term = [](const E* a, const E* b) { return round_elem<E>(load_elem(a) * load_elem(b)); };
        for (int64_t d = 0; d < half; d++) store_elem(out + d, term(x + d, c + d) - term(x + d + half, s + d));
        for (int64_t d = half; d < D; d++) store_elem(out + d, term(x + d, c + d) + term(x + d - half, s + d));
      }
    });
    return 0;
  });
  return q;
}

// ----------------------------------------------------------------------------- tile_attention: a flash kernel
// The attention of n new tokens over one layer's cache, for every n: a decode step (n = 1), a verify pass's tree, a
// prefill chunk. It works on register tiles: up to kMR query rows x a block of keys, the block's K transposed into
// scratch once (so the score tile is FMAs of broadcast q entries into contiguous key vectors) and shared by every
// query row of the GQA group; an online softmax (running max and sum per row, rescaled as the max grows); then P @ V
// on the same tile. K/V in bf16 are widened to fp32 as they are packed. A row's result depends only on its own query
// and keys: the key blocks sit at fixed positions (multiples of kNB), every row goes through the same operations
// whatever the tile's height, and a block a row sees nothing of changes nothing for it (its P row is 0 and its scale
// 1), so a row computes the same bits whatever other rows, tiles or chunks share its call: a verify pass equals the
// decode steps it replaces.
namespace {

constexpr int kMR = 6;               // most query rows per register tile
// keys per block: a whole number of score tiles in either build. 128 spreads a block's softmax step (the rows' max,
// alpha, the out's rescale, P's rounding) over twice the keys of 64: a 6,656-token prefill 1.05x faster in bf16,
// 1.03x in fp32, a decode step at 4K keys 1-3% slower (Zen 5); 256 made a decode step's attention 1.1-1.26x slower.
constexpr int64_t kNB = 128;
constexpr int64_t kItemTokens = 96;  // most new tokens per work item (their rows share each packed key block)
// Every row's softmax runs per chunk of kChunkKeys keys (from key 0), and the chunks fold in key order (fold_chunk).
// Up to kSplitTokens new tokens (a decode step, a draft tree) there would be too few (KV head, token block) items to
// keep the threads busy, each streaming the whole cache for a few rows: the items are then (KV head, chunk), holding
// every token's rows, and the fold runs after them; past it an item folds its own chunks as it goes. Either way a
// row goes through the same operations, so its result depends only on its query and its keys.
constexpr int64_t kSplitTokens = 64;
constexpr int64_t kChunkKeys = 512;
// A score tile is kMR rows x kNV vectors of keys, a P @ V tile kMR rows x kCV vectors of head dims: with AVX-512,
// 24 accumulators + 4 loaded vectors + 1 broadcast of the 32 registers; with 16 registers (AVX2), 12 + 2 + 1.
#if defined(__AVX512F__)
constexpr int kNV = 4, kCV = 4;
#else
constexpr int kNV = 2, kCV = 2;
#endif

inline float hsum(vfloat v) {  // a fixed tree over the lanes: lane j + w added to lane j, w = L / 2, ..., 1
#if defined(__AVX512F__) || defined(__AVX2__)
  __m256 h;
#if defined(__AVX512F__)
  const __m512 x = reinterpret_cast<const __m512&>(v);
  h = _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
#else
  h = reinterpret_cast<const __m256&>(v);
#endif
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
#else
  float a[L];
  std::memcpy(a, &v, sizeof(a));
  for (int w = L / 2; w > 0; w /= 2)
    for (int j = 0; j < w; j++) a[j] += a[j + w];
  return a[0];
#endif
}

inline float hmax(vfloat v) {  // the largest lane (exact whatever the order)
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<const __m512&>(v));
#elif defined(__AVX2__)
  const __m256 h = reinterpret_cast<const __m256&>(v);
  const __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 d = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(d, _mm_movehdup_ps(d)));
#else
  float m = v[0];
  for (int u = 1; u < L; u++) m = std::max(m, v[u]);
  return m;
#endif
}

// A score is two chains of steps over the head dims, the even steps' and the odd steps', each from 0, summed at the
// end (two chains: half the wait on each multiply-add's latency), in one of two kinds of operand (QE):
// - fp32 (float): one dim per step, q * k + acc (q already scaled);
// - bf16 pairs (uint32_t, the bits of dims 2i and 2i + 1): acc + q0 * k0 + q1 * k1 per step (both products exact in
//   fp32), AVX512-BF16's vdpbf16ps where the CPU has it, else two steps of one multiply-add each, the high
//   element's the even one (q's halves widened once, WidePair), and the sum scaled at the end: half the steps, and a
//   bf16 key block is transposed as pairs (half the shuffles of widened dims).
// One machine runs one kind of step for a dtype everywhere, so the packed and the in-register paths agree. P @ V
// takes the same steps (pv_cols): a key's P times its V row, or a pair of keys' P (bf16) times their V pair row.
inline vuint vload(const uint32_t* p) {
  vuint v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
#if defined(__AVX512BF16__)
constexpr bool kDpbf16 = true;  // a pair step is one vdpbf16ps
#else
constexpr bool kDpbf16 = false;  // a pair step is two multiply-adds (high half first)
#endif
// Without the CPU's bf16 dot product, a q pair's two halves widened to fp32 (once, before the steps that use it, where
// a caller can): the pair step's two multiply-adds, the high element first.
struct WidePair {
  float hi, lo;
};
static_assert(sizeof(WidePair) == 2 * sizeof(float), "a row of WidePairs reads as its floats");
inline WidePair widen(uint32_t q) {  // the pair's bits: element 2i in the low half, 2i + 1 (hi) in the high one
  return {bf16_value(static_cast<uint16_t>(q >> 16)), bf16_value(static_cast<uint16_t>(q))};
}
// A bf16 pair's (or a vector of pairs') high and low elements as fp32 bits: element 2i + 1, element 2i.
template <typename W>
inline W pair_hi(W word) {
  return word & 0xFFFF0000u;
}
template <typename W>
inline W pair_lo(W word) {
  return word << 16;
}
inline vfloat dot_step(WidePair q, vuint k, vfloat acc) {  // vector casts: the same bits
  return vfma(q.lo, (vfloat)pair_lo(k), vfma(q.hi, (vfloat)pair_hi(k), acc));
}
inline vfloat dot_step(float q, vfloat k, vfloat acc) { return vfma(q, k, acc); }
inline vfloat dot_step(uint32_t q, vuint k, vfloat acc) {
#if defined(__AVX512BF16__)
  const __m512 r = _mm512_dpbf16_ps(reinterpret_cast<__m512&>(acc), (__m512bh)reinterpret_cast<__m512i&>(k),
                                    (__m512bh)_mm512_set1_epi32(static_cast<int>(q)));
  return reinterpret_cast<const vfloat&>(r);
#else
  return dot_step(widen(q), k, acc);
#endif
}
// A step of a score's two chains (acc: even, odd): step `parity` of the fp32 or pair operands; a widened pair is two
// steps, its high element the even one.
template <typename QE, typename KV>
inline void score_step(QE q, KV k, int parity, vfloat* acc) {
  acc[parity] = dot_step(q, k, acc[parity]);
}
inline void score_step(WidePair q, vuint k, int, vfloat* acc) {
  acc[0] = vfma(q.hi, (vfloat)pair_hi(k), acc[0]);
  acc[1] = vfma(q.lo, (vfloat)pair_lo(k), acc[1]);
}
// The score operand of a dtype: fp32 rows, or bf16 pairs; and of q, which takes bf16 pairs widened where the CPU has
// no bf16 dot product.
template <typename E>
using score_elem = std::conditional_t<std::is_same_v<E, float>, float, uint32_t>;
template <typename QE>
using q_operand = std::conditional_t<std::is_same_v<QE, uint32_t> && !kDpbf16, WidePair, QE>;

// S [MR, NV vectors from j0] = Q [MR, Dq] @ Kt [Dq, kNB] (those columns) * scale; Dq operands per row (score_elem).
template <int MR, int NV, typename QE>
inline void score_tile(const q_operand<QE>* Q, const QE* Kt, int64_t Dq, int64_t j0, float* S, float scale) {
  for (int64_t parity = 0; parity < 2; parity++) {  // the even steps' chain (parked in S), then the odd steps'
    vfloat acc[MR][NV];
    for (int r = 0; r < MR; r++)
      for (int v = 0; v < NV; v++) acc[r][v] = vfloat{};
    for (int64_t d = parity; d < Dq; d += 2) {
      decltype(vload(Kt)) k[NV];
      for (int v = 0; v < NV; v++) k[v] = vload(Kt + d * kNB + j0 + v * L);
      for (int r = 0; r < MR; r++) {
        const q_operand<QE> x = Q[r * Dq + d];
        for (int v = 0; v < NV; v++) acc[r][v] = dot_step(x, k[v], acc[r][v]);
      }
    }
    for (int r = 0; r < MR; r++)
      for (int v = 0; v < NV; v++) {
        float* s = S + r * kNB + j0 + v * L;
        vstore(s, parity == 0 ? acc[r][v] : (vload(s) + acc[r][v]) * scale);
      }
  }
}

// S [MR, nvec vectors of keys] = Q [MR, Dq] @ Kt [Dq, kNB] * scale: the first nvec * L keys of the block. Each score
// is the same sum in the same order whatever nvec and MR.
template <int MR, typename QE>
inline void score_tiles(const q_operand<QE>* Q, const QE* Kt, int64_t Dq, int64_t nvec, float* S, float scale) {
  for (int64_t j0 = 0; j0 < nvec * L; j0 += kNV * L) {
    const int64_t rest = nvec - j0 / L;
    if (rest >= kNV) {
      score_tile<MR, kNV>(Q, Kt, Dq, j0, S, scale);
      continue;
    }
    switch (rest) {  // the diagonal block of a causal chunk: only the keys its rows see
      case 1: score_tile<MR, 1>(Q, Kt, Dq, j0, S, scale); break;
#if defined(__AVX512F__)
      case 2: score_tile<MR, 2>(Q, Kt, Dq, j0, S, scale); break;
      case 3: score_tile<MR, 3>(Q, Kt, Dq, j0, S, scale); break;
#endif
    }
  }
}

// One key block of the online softmax for a tile's rows: S holds the scores (hidden keys -inf), m and l the rows'
// running max and sum. Writes P = e^(S - new max) (0 where hidden) and alpha = e^(old max - new max), the factor of
// the row's earlier output; a row that sees nothing in the block gets P = 0 and alpha = 1. Covers the first nvec
// vectors of keys; past them, every row's keys are hidden. Unmasked: no score is -inf (every row sees every key), so
// none is tested (the same bits for the keys a masked call sees).
template <int MR, bool Masked>
inline void softmax_tile(const float* S, int64_t nvec, float* P, float* m, float* l, float* alpha) {
  static_assert(MR <= L, "a tile's rows' states are one vector's lanes");
  // the rows side by side, lane r for row r, without a branch on whether a max grew: mo its running max before the
  // block, mb the block's
  const vfloat none = splat<vfloat>(kNegInf);
  vfloat mo = none, mb = none;
  for (int r = 0; r < MR; r++) {
    const float* s = S + r * kNB;
    vfloat mv = vload(s);
    for (int64_t j = L; j < nvec * L; j += L) mv = vmax(mv, vload(s + j));
    mo[r] = m[r];
    mb[r] = hmax(mv);
  }
  const vfloat mx = vmax(mo, mb);
  // a max that did not grow: alpha = 1, e^0 exactly (so also a row that has seen nothing yet, every score -inf: P = 0
  // and its state stays as it is); a row that saw nothing before: 0
  const vfloat grown = exp_nonpos(mo != none ? mo - mx : vfloat{});
  const vfloat a = mx == mo ? splat<vfloat>(1.0f) : mo == none ? vfloat{} : grown;
  const vfloat drop_by = mx == none ? vfloat{} : mx;  // what each row's scores drop by (0 for a row that saw nothing)
  vfloat shift[MR];
  for (int r = 0; r < MR; r++) {
    shift[r] = splat<vfloat>(drop_by[r]);
    alpha[r] = a[r];
  }
  vfloat sum[MR] = {};
  for (int64_t j = 0; j < nvec * L; j += L)  // the rows' exponentials side by side: independent chains
    for (int r = 0; r < MR; r++) {
      const vfloat x = vload(S + r * kNB + j);
      vfloat e = exp_nonpos(x - shift[r]);
      if constexpr (Masked) e = x == kNegInf ? vfloat{} : e;  // exp_nonpos clamps: hidden must give 0
      vstore(P + r * kNB + j, e);
      sum[r] += e;
    }
  for (int r = 0; r < MR; r++) {
    l[r] = std::fma(l[r], alpha[r], hsum(sum[r]));
    m[r] = mx[r];
  }
}

// O [MR, NV vectors from c0] = O * alpha (per row) + W [MR, :steps] @ Vb [steps, those columns]: a step is one key
// (W fp32, Vb rows fp32 or bf16 widened as loaded) or a pair of keys (W bf16 pairs, Vb pair rows: pv_pairs); W rows
// ldw apart, Vb rows ldv apart, O rows Dp apart.
template <int MR, int NV, typename W, typename TV>
inline void pv_cols(const W* Pw, int64_t ldw, const float* alpha, const TV* Vb, int64_t ldv, int64_t steps,
                    int64_t c0, int64_t Dp, float* O) {
  vfloat acc[MR][NV];
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v++) {  // a max that did not grow leaves the row's out as it is (x * 1 is x)
      const vfloat o = vload(O + r * Dp + c0 + v * L);
      acc[r][v] = alpha[r] == 1.0f ? o : o * alpha[r];
    }
  for (int64_t j = 0; j < steps; j++) {
    decltype(vload(Vb)) x[NV];
    for (int v = 0; v < NV; v++) x[v] = vload(Vb + j * ldv + c0 + v * L);
    for (int r = 0; r < MR; r++)
      for (int v = 0; v < NV; v++) acc[r][v] = dot_step(Pw[r * ldw + j], x[v], acc[r][v]);
  }
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v++) vstore(O + r * Dp + c0 + v * L, acc[r][v]);
}

// O [MR, Dp] = O * alpha (per row) + P [MR, :jn] @ Vb [jn, Dp] (rows ldv apart; fp32, or bf16 widened as loaded).
template <int MR, typename TV>
inline void pv_tile(const float* P, const float* alpha, const TV* Vb, int64_t ldv, int64_t jn, int64_t Dp,
                    float* O) {
  for (int64_t c0 = 0; c0 < Dp; c0 += kCV * L) pv_cols<MR, kCV>(P, kNB, alpha, Vb, ldv, jn, c0, Dp, O);
}

// K's rows as score operands: fp32 as they are, bf16 as pairs (32-bit words, moved by the fp32 shuffles bit for bit)
inline const float* key_words(const float* K) { return K; }
inline const float* key_words(const bf16* K) { return reinterpret_cast<const float*>(K); }

// bf16 P @ V in pair steps (AVX-512 builds, D a multiple of 32), half the multiply-adds of pv_tile: a key block's V
// rows interleaved by pairs of keys (Vt: pair p's row holds D words, (V[2p][d], V[2p+1][d]) for the dims d in
// pv_dim order, pack_v_pairs) and each row's P rounded to bf16 pairs (as ATen's bf16 flash attention rounds P). O
// rows then hold their dims in pv_dim order, put in place as they are stored.
// O [MR, D] = O * alpha (per row) + P [MR, :jn] @ V [jn, D]; rows Dp apart.
// out[0..32) = the bf16 bits of x[0..32), 0 from x[n] on (n < 32).
inline void to_bf16_32(const float* x, int64_t n, uint16_t* out) {
#if defined(__AVX512F__)
  const auto mask = [](int64_t k) { return static_cast<__mmask16>(k >= 16 ? 0xFFFF : (k <= 0 ? 0 : (1u << k) - 1)); };
  const __m512 a = _mm512_maskz_loadu_ps(mask(n), x), b = _mm512_maskz_loadu_ps(mask(n - 16), x + 16);
#if defined(__AVX512BF16__)
  _mm512_storeu_si512(out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
#else
  const auto round = [](__m512 v) {  // bf16_bits without the NaN case (P has none)
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
  };
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), round(a));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), round(b));
#endif
#else
  for (int64_t i = 0; i < 32; i++) out[i] = i < n ? bf16_bits(x[i]) : 0;
#endif
}

template <int MR>
inline void pv_pairs(const float* P, const float* alpha, const uint32_t* Vt, int64_t D, int64_t jn, int64_t Dp,
                     float* O) {
  const int64_t np = (jn + 1) / 2;
  uint32_t Pp[MR][kNB / 2];
  for (int r = 0; r < MR; r++)
    for (int64_t j = 0; j < 2 * np; j += 32)  // words (even key, odd key): the keys' bf16 bits in order
      to_bf16_32(P + r * kNB + j, jn - j, reinterpret_cast<uint16_t*>(Pp[r]) + j);
  int64_t c0 = 0;
  for (; c0 + kCV * L <= D; c0 += kCV * L) pv_cols<MR, kCV>(Pp[0], kNB / 2, alpha, Vt, D, np, c0, Dp, O);
  for (; c0 < D; c0 += L) pv_cols<MR, 1>(Pp[0], kNB / 2, alpha, Vt, D, np, c0, Dp, O);
}

#if defined(__AVX512F__)
constexpr bool kPairPV = true;
// The head dim at position i of a pair-packed row: 32-dim halves, each two vectors (unpacklo, unpackhi of two key
// rows), whose 128-bit lanes hold 4 dims each.
inline int64_t pv_dim(int64_t i) { return i / 32 * 32 + (i % 16) / 4 * 8 + (i / 16) % 2 * 4 + i % 4; }

// Vt [ceil(jn / 2), D] = keys 0..jn-1 of the block (rows of V, D apart) interleaved by pairs (see pv_pairs); the
// last pair of an odd jn has zeros for its second key.
inline void pack_v_pairs(const bf16* V, int64_t jn, int64_t D, uint32_t* Vt) {
  for (int64_t p = 0; p < (jn + 1) / 2; p++) {
    const bf16* a = V + 2 * p * D;
    for (int64_t h = 0; h < D; h += 32) {
      const __m512i x = _mm512_loadu_si512(a + h);
      const __m512i y = 2 * p + 1 < jn ? _mm512_loadu_si512(a + D + h) : _mm512_setzero_si512();
      _mm512_storeu_si512(Vt + p * D + h, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(Vt + p * D + h + 16, _mm512_unpackhi_epi16(x, y));
    }
  }
}
#else
constexpr bool kPairPV = false;
inline int64_t pv_dim(int64_t i) { return i; }
inline void pack_v_pairs(const bf16*, int64_t, int64_t, uint32_t*) {}
#endif

#if defined(__AVX512F__)
inline __m512 load_row16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row16(const bf16* p) {  // widened: the bf16 bits are the upper half of the fp32's
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// k[d] = the 16 keys' dim d (k[d] lane j = in[j * ld_in + d]) for 16 keys j x 16 dims d, in registers: pairs of rows
// interleaved by floats, then by float pairs (each 128-bit lane then holds 4 rows of one column), then the lanes
// regrouped.
template <typename E>
inline void transpose16(const E* in, int64_t ld_in, __m512* k) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = load_row16(in + i * ld_in);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)  // r[i + c], lane k: rows i..i+3 of column 4k + c
    for (int c = 0; c < 4; c += 2) {
      const __m512d a = _mm512_castps_pd(t[i + c / 2]), b = _mm512_castps_pd(t[i + 2 + c / 2]);
      r[i + c] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[i + c + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int c = 0; c < 4; c++) {
    const __m512 v0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    k[c] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    k[4 + c] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    k[8 + c] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    k[12 + c] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}

#elif defined(__AVX2__)
// k[c] = the 8 keys' word c (k[c] lane j = in[j * ld_in + c]) for 8 keys j x 8 words c, in registers: pairs of rows
// interleaved by words, then by word pairs (each 128-bit lane then holds 4 rows of one column), then the halves
// regrouped.
inline void transpose8(const float* in, int64_t ld_in, __m256* k) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(in + i * ld_in);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // r[i + c], lane half h: rows i..i+3 of column 4h + c
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int c = 0; c < 4; c++) {
    k[c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x20);
    k[4 + c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x31);
  }
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
constexpr int64_t kScoreRowsMax = 8;  // most rows score_rows takes: a decode step's GQA group
// k[c] lane j = in[j * ld_in + c]: a square of L keys x L words (fp32, or bf16 pairs) transposed in registers.
inline void transpose_words(const float* in, int64_t ld_in, vfloat* k) {
#if defined(__AVX512F__)
  transpose16(in, ld_in, reinterpret_cast<__m512*>(k));
#else
  transpose8(in, ld_in, reinterpret_cast<__m256*>(k));
#endif
}

// S [MR, kNB] = Q [MR, Dq] @ K [kNB keys, Dq]^T * scale for a whole block of keys read from their rows (Dq operands
// per row, a multiple of L), each square of L keys x L operands transposed in registers: every score the same chain
// of steps over the operands from 0 as score_tile's on the packed keys (the same bits), without the packed copy: a
// decode step's few rows. The next block's K and V (next_k, next_v, or null) are prefetched a few lines per square,
// spread over the block: a burst of prefetches would wait on the memory like the loads.
template <int MR, typename E>
inline void score_rows(const q_operand<score_elem<E>>* Q, const E* K, int64_t Dq, float* S, float scale,
                       const E* next_k, const E* next_v) {
  using QE = score_elem<E>;
  using KV = decltype(vload(static_cast<const QE*>(nullptr)));  // a vector of L keys' operands
  constexpr int64_t lines = L * L * 4 / 64;  // per square: the block's lines / its squares
  const float* Kw = key_words(K);
  int64_t step = 0;
  for (int64_t j0 = 0; j0 < kNB; j0 += L) {
    vfloat acc[MR][2] = {};  // the chains of the even and the odd steps (score_step)
    for (int64_t d0 = 0; d0 < Dq; d0 += L, step++) {
      if (next_k)
        for (int64_t b = step * lines * 64; b < (step + 1) * lines * 64; b += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(next_k) + b, 0, 2);
          __builtin_prefetch(reinterpret_cast<const char*>(next_v) + b, 0, 2);
        }
      vfloat k[L];
      transpose_words(Kw + j0 * Dq + d0, Dq, k);
      for (int i = 0; i < L; i++) {
        const KV kv = reinterpret_cast<const KV&>(k[i]);
        for (int r = 0; r < MR; r++) score_step(Q[r * Dq + d0 + i], kv, i % 2, acc[r]);
      }
    }
    for (int r = 0; r < MR; r++) vstore(S + r * kNB + j0, (acc[r][0] + acc[r][1]) * scale);
  }
}


template <typename E>
constexpr void (*kScoreRows[kScoreRowsMax])(const q_operand<score_elem<E>>*, const E*, int64_t, float*, float,
                                            const E*, const E*) = {
    score_rows<1, E>, score_rows<2, E>, score_rows<3, E>, score_rows<4, E>,
    score_rows<5, E>, score_rows<6, E>, score_rows<7, E>, score_rows<8, E>};
constexpr bool kHasScoreRows = true;
#else
constexpr int64_t kScoreRowsMax = kMR;
constexpr bool kHasScoreRows = false;
#endif

// The operand of a packed key block: fp32, or bf16 pairs where the CPU has a bf16 dot product; without it the pairs
// are widened as they are packed, each pair's high element first (the order of WidePair's two multiply-adds), so the
// packed tiles run fp32 steps, the same products in the same order, on q's widened pairs read as floats.
template <typename E>
using packed_elem = std::conditional_t<kDpbf16, score_elem<E>, float>;

#if defined(__AVX512F__) || defined(__AVX2__)
// fn(w, j, v) for a whole key block (kNB rows of Dq words, Dq a multiple of L): v = word w of keys j..j + L - 1, from
// squares of L keys x L words transposed in registers.
// The next block's K and V (next_k, next_v, or null) are prefetched a few lines per square, as in score_rows.
template <typename Fn>
inline void key_word_vectors(const float* Kw, int64_t Dq, Fn&& fn, const void* next_k = nullptr,
                             const void* next_v = nullptr) {
  constexpr int64_t lines = L * L * 4 / 64;
  int64_t step = 0;
  for (int64_t j = 0; j < kNB; j += L)
    for (int64_t d = 0; d < Dq; d += L, step++) {
      if (next_k)
        for (int64_t b = step * lines * 64; b < (step + 1) * lines * 64; b += 64) {
          __builtin_prefetch(static_cast<const char*>(next_k) + b, 0, 2);
          __builtin_prefetch(static_cast<const char*>(next_v) + b, 0, 2);
        }
      vfloat k[L];
      transpose_words(Kw + j * Dq + d, Dq, k);
      for (int i = 0; i < L; i++) fn(d + i, j, reinterpret_cast<const vuint&>(k[i]));
    }
}
#endif

// Kt [Dq, kNB] = the block's `valid` keys (rows of K) as score operands (fp32, or bf16 pairs), transposed; zero past
// them.
template <typename E>
inline void pack_keys(const E* K, int64_t valid, int64_t Dq, score_elem<E>* Kt, const E* next_k = nullptr,
                      const E* next_v = nullptr) {
  const float* Kw = key_words(K);
#if defined(__AVX512F__) || defined(__AVX2__)
  if (valid == kNB && Dq % L == 0) {
    const auto put = [&](int64_t w, int64_t j, vuint v) { std::memcpy(Kt + w * kNB + j, &v, sizeof(v)); };
    return key_word_vectors(Kw, Dq, put, next_k, next_v);
  }
#endif
  for (int64_t j = 0; j < valid; j++)
    for (int64_t d = 0; d < Dq; d++) std::memcpy(Kt + d * kNB + j, Kw + j * Dq + d, sizeof(float));
  if (valid < kNB)
    for (int64_t d = 0; d < Dq; d++) std::fill(Kt + d * kNB + valid, Kt + (d + 1) * kNB, score_elem<E>{});
}

// Kt [2 Dq, kNB] = the block's `valid` bf16 keys widened (packed_elem: rows 2w and 2w + 1 the high and low elements of
// pair w), transposed; zero past them.
inline void pack_keys(const bf16* K, int64_t valid, int64_t Dq, float* Kt, const bf16* next_k = nullptr,
                      const bf16* next_v = nullptr) {
  const float* Kw = key_words(K);
  const auto put = [&](int64_t w, int64_t j, auto word) {  // word: one key's pair w, or a vector of keys' (from j)
    using V = decltype(word);
    const V hi = pair_hi(word), lo = pair_lo(word);
    std::memcpy(Kt + 2 * w * kNB + j, &hi, sizeof(V));
    std::memcpy(Kt + (2 * w + 1) * kNB + j, &lo, sizeof(V));
  };
#if defined(__AVX512F__) || defined(__AVX2__)
  if (valid == kNB && Dq % L == 0) return key_word_vectors(Kw, Dq, put, next_k, next_v);
#endif
  for (int64_t j = 0; j < kNB; j++)
    for (int64_t w = 0; w < Dq; w++) {
      uint32_t word = 0;
      if (j < valid) std::memcpy(&word, Kw + j * Dq + w, sizeof(word));
      put(w, j, word);
    }
}

// Folds a key chunk's softmax state (mc, lc, oc: max, sum, unnormalised out) into a row's running one (m, l, o), chunk
// after chunk in key order; one arithmetic wherever it runs, so a row's bits do not depend on how its call is split.
inline void fold_chunk(float& m, float& l, float* o, float mc, float lc, const float* oc, int64_t D) {
  if (lc == 0.0f) return;  // the row saw no key of the chunk
  const float mx = std::max(m, mc);
  const float a = m == kNegInf ? 0.0f : exp_nonpos(m - mx), b = exp_nonpos(mc - mx);
  l = std::fma(lc, b, l * a);
  for (int64_t d = 0; d < D; d++) o[d] = std::fma(oc[d], b, o[d] * a);
  m = mx;
}

// One register tile of MR query rows (scaled, D apart) against one packed key block: the scores of its first nvec
// vectors of keys, row r seeing the block's first seen[r] keys (none: all of them), the online softmax step, and
// P @ V over the block's first jn keys.
template <typename QE, typename TV>
struct TileStep {
  const q_operand<QE>* Q;
  const QE* Kt;
  float scale;
  const TV* Vb;  // V rows (fp32 or bf16), or bf16 pairs (uint32_t, pv_pairs)
  int64_t ldv, D, Dq, Dp, nvec, jn;
  const int64_t* seen;
  float *S, *P, *alpha, *M, *Ls, *O;
};

template <int MR, typename QE, typename TV>
void attend_tile(const TileStep<QE, TV>& s) {
  if (s.Kt) score_tiles<MR>(s.Q, s.Kt, s.Dq, s.nvec, s.S, s.scale);  // else the scores are in S already (score_rows)
  if (s.seen)
    for (int r = 0; r < MR; r++) {
      float* sr = s.S + r * kNB;
      std::fill(sr + std::clamp<int64_t>(s.seen[r], 0, s.nvec * L), sr + s.nvec * L, kNegInf);
    }
  if (s.seen)
    softmax_tile<MR, true>(s.S, s.nvec, s.P, s.M, s.Ls, s.alpha);
  else
    softmax_tile<MR, false>(s.S, s.nvec, s.P, s.M, s.Ls, s.alpha);
  if constexpr (std::is_same_v<TV, uint32_t>)
    pv_pairs<MR>(s.P, s.alpha, s.Vb, s.D, s.jn, s.Dp, s.O);
  else
    pv_tile<MR>(s.P, s.alpha, s.Vb, s.ldv, s.jn, s.Dp, s.O);
}

template <typename QE, typename TV>
constexpr void (*kAttendTiles[kMR])(const TileStep<QE, TV>&) = {  // [rows - 1]
    attend_tile<1, QE, TV>, attend_tile<2, QE, TV>, attend_tile<3, QE, TV>,
    attend_tile<4, QE, TV>, attend_tile<5, QE, TV>, attend_tile<6, QE, TV>};

// Asks for a block of memory to be brought towards the cache while the current block is computed.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 2);
}

// The softmax states (max, sum, unnormalised out) of a call's rows over its first key chunks, [Hkv][chunk][R]: what
// several sequences whose caches begin with the same K/V compute once for all their rows (group_attention) and each
// then folds before its own chunks.
struct ChunkParts {
  int64_t chunks = 0, R = 0;
  std::vector<float> m, l;
  std::unique_ptr<float[]> o;
};
// A call's part in a shared prefix: `out`, the call computes the states of the chunks below out->chunks for all its
// rows (and no result); `in`, it takes its chunks below in->chunks from there, its rows from row0 on.
struct Shared {
  ChunkParts* out = nullptr;
  const ChunkParts* in = nullptr;
  int64_t row0 = 0;
};

// tile_attention for one element type E of q, the cache and the result.
//
// A token's keys are laid out as a decode step at its position would see them: the prefix at 0..start-1, then the
// new tokens it sees (a tree token: its ancestors and itself, in order) at start, start+1, ... So a tree token's
// result equals the decode step that follows its accepted path, whatever the tree (a chain's tokens see
// start..start+t, where they are). Key blocks of the prefix are packed once for every row of an item; with a mask,
// a block that reaches past the prefix is gathered and packed per token, for its rows (the GQA group).
//
// Work items are (KV head, block of new tokens) or, up to kSplitTokens tokens, (KV head, key chunk); largest first,
// taken by the threads from a shared counter (a causal chunk's last tokens see the most keys). An item's rows are
// token-major: row r is token t0 + r / g, query head kv * g + r % g.
template <typename E>
torch::Tensor tile_attention_impl(const CacheCall& c, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                  int64_t start, double scale, Shared shared = {}) {
  using QE = score_elem<E>;
  using KT = packed_elem<E>;
  const int64_t H = c.H, n = c.n, D = c.D, hkv = c.hkv, g = c.g, length = start + n;
  constexpr bool fp32 = std::is_same_v<E, float>;
  TORCH_CHECK(fp32 || D % 2 == 0, "tile_attention: a bf16 head dim must be even");
  const int64_t Dq = D * sizeof(E) / sizeof(QE);  // score operands per row: D fp32, D / 2 bf16 pairs
  const int64_t Dk = std::is_same_v<KT, QE> ? Dq : D;  // per packed row: the same, or D widened (packed_elem)
  const int64_t Dp = (D + kCV * L - 1) / (kCV * L) * (kCV * L);  // O rows padded to whole P @ V tiles
  const bool* mp = c.mp;
  // with a mask: the new tokens each token sees, in order (seen_at[t]..seen_at[t + 1] of seen_new)
  std::vector<int64_t> seen_at(mp ? n + 1 : 0), seen_new;
  for (int64_t t = 0; mp && t < n; t++) {
    seen_at[t] = seen_new.size();
    for (int64_t j = 0; j < n; j++)
      if (mp[t * n + j]) seen_new.push_back(j);
    seen_at[t + 1] = seen_new.size();
  }
  // tokens per item: a multiple of kMR, at most kItemTokens, few enough for ~4 items per thread and a number of items
  // the threads share evenly (9 like items on 2 threads: one waits for the last a ninth of the time); split: all
  const int64_t threads = at::get_num_threads();
  int64_t per_head = std::max<int64_t>(1, (4 * threads + hkv - 1) / hkv);
  while (hkv * per_head % threads) per_head++;
  const bool split = n <= kSplitTokens || shared.out;
  TORCH_CHECK(split || !shared.in, "tile_attention: a shared prefix's chunks need the split path");
  const int64_t TB = split ? n : std::clamp<int64_t>(((n + per_head - 1) / per_head + kMR - 1) / kMR * kMR, kMR,
                                                      kItemTokens);
  // the chunks this call computes: from the first not given (shared.in), up to the last it shares (shared.out)
  const int64_t chunks = shared.out ? shared.out->chunks : split ? (length + kChunkKeys - 1) / kChunkKeys : 1;
  const int64_t first = shared.in ? shared.in->chunks : 0;
  struct Item {
    int64_t kv, t0, t1, chunk, cost;
  };
  std::vector<Item> items;
  for (int64_t kv = 0; kv < hkv; kv++)
    for (int64_t t0 = 0; t0 < n; t0 += TB) {
      const int64_t t1 = std::min(n, t0 + TB), kend = mp ? length : start + t1;
      for (int64_t ch = first; ch < chunks && ch * kChunkKeys < kend; ch++)
        items.push_back({kv, t0, t1, ch, (split ? std::min(kChunkKeys, kend - ch * kChunkKeys) : kend) * (t1 - t0)});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  // split: each (KV head, chunk)'s rows as (max, sum, unnormalised out), merged below; chunks no row reached stay empty
  const int64_t R = g * n;
  std::vector<float> part_m(split ? hkv * chunks * R : 0, kNegInf), part_l(split ? hkv * chunks * R : 0, 0.0f);
  // part_o is left uninitialised: fold_chunk reads a chunk's out only where its sum is set (> 0), i.e. written
  std::unique_ptr<float[]> part_o(new float[split ? hkv * chunks * R * D : 0]);

  auto y = torch::empty({n, H * D}, c.q.options());
  const E* qp = c.q.data_ptr<E>();
  const E* kc = k_cache.data_ptr<E>();
  const E* vc = v_cache.data_ptr<E>();
  E* yp = y.data_ptr<E>();
  const int64_t ksh = k_cache.stride(0), vsh = v_cache.stride(0);
  const float sc = static_cast<float>(scale);
  const float score_scale = std::is_same_v<E, float> ? 1.0f : sc;  // fp32 q rows are scaled as loaded, pairs after
  // V rows are read in place where they are whole P @ V tiles and either fp32 or read by at most two tiles of rows (a
  // decode step, a tree token's GQA group); else through an fp32 copy of the block, widened and padded once
  const bool pad_v = Dp != D, wide_v = fp32;
  const bool pairs = !fp32 && kPairPV && D % 32 == 0;  // P @ V in pair steps (pv_pairs): every path of the call
  const auto dim = [&](int64_t i) { return pairs ? pv_dim(i) : i; };  // where O's entry i goes
  std::atomic<int64_t> next{0};
  std::atomic<bool> unseen{false};  // a row that sees no key (a mask row without its own token)
  const int64_t n_items = items.size(), workers = std::min(threads, n_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const int64_t rows_max = g * TB;
    std::vector<KT> Kt(Dk * kNB);
    std::vector<q_operand<QE>> Q(rows_max * Dq);
    const auto* Qk = reinterpret_cast<const q_operand<KT>*>(Q.data());  // widened pairs as floats (packed_elem)
    std::vector<float> Vp(kNB * Dp, 0.0f), S(kScoreRowsMax * kNB), P(kMR * kNB), alpha(kMR);
    std::vector<uint32_t> Vt(pairs ? kNB / 2 * D : 0);
    std::vector<float> O(rows_max * Dp), M(rows_max), Ls(rows_max);  // the chunk's softmax state
    std::vector<float> RO(rows_max * D), RM(rows_max), RL(rows_max);                   // the folded chunks'
    std::vector<int64_t> seen(rows_max);
    std::vector<E> Kg(mp ? kNB * D : 0), Vg(mp ? kNB * D : 0);  // a token's gathered key block
    // tiles of up to kMR rows over rows [r0, r1) against the keys packed in Kt (or, kt null, their scores in S
    // already) and the block's V rows Vs (`valid` of them), the tiles' rows seeing its first jn keys (row r: sn[r],
    // nullptr: all)
    const auto run_tiles = [&](int64_t r0, int64_t r1, const KT* kt, const E* Vs, int64_t valid, int64_t jn,
                               const int64_t* sn) {
      const auto run = [&](const auto* Vb, int64_t ldv) {
        using TV = std::remove_cv_t<std::remove_pointer_t<decltype(Vb)>>;
        for (int64_t row0 = r0; row0 < r1; row0 += kMR) {
          const int64_t mr = std::min<int64_t>(kMR, r1 - row0);
          const int64_t tn = sn ? std::min(jn, sn[row0 + mr - 1]) : jn;  // rows are in token order: the last sees most
          if (tn <= 0) continue;
          kAttendTiles<KT, TV>[mr - 1]({Qk + row0 * Dk, kt, score_scale, Vb, ldv, D, Dk, Dp, (tn + L - 1) / L, tn,
                                    sn ? sn + row0 : nullptr, S.data() + (kt ? 0 : (row0 - r0) * kNB), P.data(),
                                    alpha.data(), M.data() + row0, Ls.data() + row0, O.data() + row0 * Dp});
        }
      };
      if constexpr (!std::is_same_v<E, float>)
        if (pairs) {
          pack_v_pairs(Vs, std::min(valid, jn), D, Vt.data());
          return run(static_cast<const uint32_t*>(Vt.data()), D);
        }
      if (!pad_v && (wide_v || r1 - r0 <= 2 * kMR)) return run(Vs, D);
      for (int64_t j = 0; j < std::min(valid, jn); j++)
        for (int64_t d = 0; d < D; d++) Vp[j * Dp + d] = load_elem(Vs + j * D + d);
      run(static_cast<const float*>(Vp.data()), Dp);
    };
    for (int64_t i; (i = next.fetch_add(1)) < n_items;) {
      const Item it = items[i];
      const int64_t tb = it.t1 - it.t0, rows = g * tb;
      for (int64_t r = 0; r < rows; r++) {  // the item's query rows: fp32 scaled, bf16 as pairs (or widened pairs)
        const E* src = qp + ((it.kv * g + r % g) * n + it.t0 + r / g) * D;
        if constexpr (std::is_same_v<E, float>)
          for (int64_t d = 0; d < D; d++) Q[r * D + d] = src[d] * sc;
        else if constexpr (std::is_same_v<q_operand<QE>, WidePair>)
          for (int64_t w = 0; w < Dq; w++) {
            uint32_t word;
            std::memcpy(&word, src + 2 * w, sizeof(word));
            Q[r * Dq + w] = widen(word);
          }
        else
          std::memcpy(Q.data() + r * Dq, src, D * sizeof(E));
      }
      const auto new_chunk = [&] {
        std::fill(O.begin(), O.begin() + rows * Dp, 0.0f);
        std::fill(M.begin(), M.begin() + rows, kNegInf);
        std::fill(Ls.begin(), Ls.begin() + rows, 0.0f);
      };
      new_chunk();
      std::fill(RO.begin(), RO.begin() + rows * D, 0.0f);
      std::fill(RM.begin(), RM.begin() + rows, kNegInf);
      std::fill(RL.begin(), RL.begin() + rows, 0.0f);
      // keys any row of the item sees lie below kend; split: the chunk's only
      const int64_t kend = std::min(mp ? length : start + it.t1, split ? (it.chunk + 1) * kChunkKeys : length);
      const E* Kh = kc + it.kv * ksh;
      const E* Vh = vc + it.kv * vsh;
      const bool score_rows_fit = kHasScoreRows && Dq % L == 0 && rows <= kScoreRowsMax;
      for (int64_t kb = split ? it.chunk * kChunkKeys : 0; kb < kend; kb += kNB) {
        const bool more = kb + 2 * kNB <= kend;  // a next whole block: on its way while this one is computed
        // nk, nv: the next block's K and V, prefetched a few lines at a time while this block's keys are read (null:
        // nothing left to prefetch). A few rows over the prefix (a decode step, a draft tree) go that way, and from
        // an item's last block on to the next item's first (a burst would wait on the memory like the loads); else
        // the next block is prefetched all at once here.
        const bool spread = split && kb + kNB <= start;
        const E *nk = more ? Kh + (kb + kNB) * D : nullptr, *nv = Vh + (kb + kNB) * D;
        if (spread && !more)  // the shared counter read once an item, not every block
          if (const int64_t p = next.load(std::memory_order_relaxed); p < n_items) {
            nk = kc + items[p].kv * ksh + items[p].chunk * kChunkKeys * D;
            nv = vc + items[p].kv * vsh + items[p].chunk * kChunkKeys * D;
          }
        if (more && !spread) {
          prefetch_bytes(nk, kNB * D * sizeof(E));
          prefetch_bytes(nv, kNB * D * sizeof(E));
          nk = nullptr;
        }
        if (mp && kb + kNB > start) {  // per token: the prefix's keys of the block, then the new tokens it sees
          for (int64_t t = it.t0; t < it.t1; t++) {
            const int64_t* tree = seen_new.data() + seen_at[t];
            const int64_t vis = std::min(kNB, start + (seen_at[t + 1] - seen_at[t]) - kb);
            if (vis <= 0) continue;
            for (int64_t p = 0; p < vis; p++) {
              const int64_t key = kb + p < start ? kb + p : start + tree[kb + p - start];
              std::memcpy(Kg.data() + p * D, Kh + key * D, D * sizeof(E));
              std::memcpy(Vg.data() + p * D, Vh + key * D, D * sizeof(E));
            }
            pack_keys(Kg.data(), vis, Dq, Kt.data());
            const int64_t r0 = (t - it.t0) * g;
            std::fill(seen.begin() + r0, seen.begin() + r0 + g, vis);
            run_tiles(r0, r0 + g, Kt.data(), Vg.data(), vis, vis, seen.data());
          }
        } else {  // every row sees the block's keys; a causal chunk's token t those up to start + t
          const int64_t valid = std::min(kNB, length - kb);
          if (score_rows_fit && kb + kNB <= start) {  // a few rows (a decode step): no packed copy of the keys
#if defined(__AVX512F__) || defined(__AVX2__)
            kScoreRows<E>[rows - 1](Q.data(), Kh + kb * D, Dq, S.data(), score_scale, nk, nv);
#endif
            run_tiles(0, rows, nullptr, Vh + kb * D, valid, valid, nullptr);
          } else if (pack_keys(Kh + kb * D, valid, Dq, Kt.data(), nk, nv); kb + kNB <= start) {
            run_tiles(0, rows, Kt.data(), Vh + kb * D, valid, valid, nullptr);
          } else {
            for (int64_t r = 0; r < rows; r++) seen[r] = std::min(start + it.t0 + r / g + 1, length) - kb;
            const int64_t jn = std::min(valid, seen[rows - 1]);  // the keys the last row sees
            if (jn > 0) run_tiles(0, rows, Kt.data(), Vh + kb * D, valid, jn, seen.data());
          }
        }
        if (!split && ((kb + kNB) % kChunkKeys == 0 || kb + kNB >= kend)) {  // the chunk's end: fold it
          for (int64_t r = 0; r < rows; r++)
            fold_chunk(RM[r], RL[r], RO.data() + r * D, M[r], Ls[r], O.data() + r * Dp, D);
          new_chunk();
        }
      }
      if (split) {
        const int64_t at = (it.kv * chunks + it.chunk) * R;
        for (int64_t r = 0; r < rows; r++) {
          part_m[at + r] = M[r];
          part_l[at + r] = Ls[r];
          std::copy(O.data() + r * Dp, O.data() + r * Dp + D, part_o.get() + (at + r) * D);
        }
        continue;
      }
      for (int64_t r = 0; r < rows; r++) {
        if (RL[r] == 0.0f) {
          unseen = true;
          continue;
        }
        const float inv = 1.0f / RL[r];
        E* out = yp + (it.t0 + r / g) * H * D + (it.kv * g + r % g) * D;
        for (int64_t d = 0; d < D; d++) store_elem(out + dim(d), RO[r * D + d] * inv);
      }
    }
  });
  if (shared.out) {  // the rows' states per chunk, for the calls of the sequences sharing them to fold
    shared.out->m = std::move(part_m);
    shared.out->l = std::move(part_l);
    shared.out->o.reset(part_o.release());
    shared.out->R = R;
    return y;
  }
  if (split)  // row r of KV head kv: token r / g, query head kv * g + r % g
    at::parallel_for(0, hkv * R, 16, [&](int64_t a, int64_t e) {
      std::vector<float> o(D);
      for (int64_t kr = a; kr < e; kr++) {
        const int64_t kv = kr / R, r = kr % R;
        float m = kNegInf, l = 0.0f;
        std::fill(o.begin(), o.end(), 0.0f);
        for (int64_t ch = 0; ch < first; ch++) {  // the shared chunks' states, then this call's own
          const ChunkParts& in = *shared.in;
          const int64_t t = (kv * first + ch) * in.R + shared.row0 + r;
          fold_chunk(m, l, o.data(), in.m[t], in.l[t], in.o.get() + t * D, D);
        }
        for (int64_t ch = first; ch < chunks; ch++) {
          const int64_t t = (kv * chunks + ch) * R + r;
          fold_chunk(m, l, o.data(), part_m[t], part_l[t], part_o.get() + t * D, D);
        }
        if (l == 0.0f) {
          unseen = true;
          continue;
        }
        const float inv = 1.0f / l;
        E* out = yp + (r / g) * H * D + (kv * g + r % g) * D;
        for (int64_t d = 0; d < D; d++) store_elem(out + dim(d), o[d] * inv);
      }
    });
  TORCH_CHECK(!unseen, "tile_attention: a query row sees no key (a mask row without its own token?)");
  return y;
}

}  // namespace

// Attention of n new tokens, q [H, n, D], over one layer's cache (k_cache / v_cache [Hkv, capacity, D]) whose
// positions 0..start-1 are the committed prefix, every token sees all of them, and start..start+n-1 are the new
// tokens themselves (written by rope_write), seen through mask [n, n] (bool, True = visible; none = causal). GQA: the
// H / Hkv query heads of a group share each packed key block. q, the cache and the result [n, H * D] share one dtype,
// fp32 or bf16 (the result rounded once from the fp32 arithmetic).
torch::Tensor tile_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, int64_t start,
                             c10::optional<torch::Tensor> mask, double scale) {
  const CacheCall c = check_cache_call("tile_attention", q, k_cache, v_cache, start, mask);
  return by_elem(q, [&](auto elem) { return tile_attention_impl<decltype(elem)>(c, k_cache, v_cache, start, scale); });
}

// ----------------------------------------------------------------------------- rows_linear: few-row products
// x [M, K] @ w[N, K]^T (+ bias) for a decode step, a verify pass or any number of rows, in fp32 or bf16: the weights
// are read from memory once per kRowsMax rows of x, kRowBlock rows at a time, and each block meets the x rows in
// groups of up to kGroup, R weight rows by the group's rows in registers. Every output is one multiply-add chain
// over k in order in fixed lanes, a fixed reduction of the lanes, then the tail and the bias: the same sums in the
// same order whatever M, the pass, the group or the tile, so a verify pass of any size equals a decode step bit for
// bit.
constexpr int64_t kRowsMax = 64;   // x rows per pass over the weights (more rows: another pass)
#if defined(__AVX512F__)
constexpr int kGroup = 8;  // x rows per register tile
#else
constexpr int kGroup = 4;  // 16 registers: groups of 8 rows ran 3-9% slower at 4-32 rows on Zen 3
#endif
constexpr int64_t kRowBlock = 24;  // weight rows per block: a multiple of every tile's R, so only N's end has a tail

// R, the weight rows of a tile with M x rows: R * M accumulators (AVX-512: at most 24 of the 32 registers)
template <int M>
constexpr int tile_rows() {
#if defined(__AVX512F__)
  return M <= 3 ? 8 : (M == 4 ? 6 : (M <= 6 ? 4 : 3));
#else
  return M == 1 ? 4 : 2;
#endif
}

// Weight elements from a tile's first to the rows it prefetches (into L2) as it reads its own: whole tiles of R rows
// (the next R rows are the next R * K elements), at least 4 KB ahead. The hardware prefetcher alone keeps too few of a
// tile's R row streams in flight: the SmolLM2 weights in bf16 streamed at 11 instead of 18 GB/s on Zen 4.
template <int R, typename T>
inline int64_t rows_prefetch_ahead(int64_t K) {
  const int64_t tile = R * K;
  return (4096 / (tile * int64_t(sizeof(T))) + 1) * tile;
}

#if defined(__AVX512F__)
// A vector loaded into a register once: the empty asm keeps the compiler from folding the load into each
// multiply-add that reads it (one load per use: the tile would run out of loads before multiply-adds).
static inline __m512 load_once(const float* p) {
  __m512 v = _mm512_loadu_ps(p);
  asm("" : "+v"(v));
  return v;
}

// The lane sums of n <= 16 accumulators into out[0..n), each by the tree of _mm512_reduce_add_ps (lanes j + j+8,
// then j + j+4, j + j+2, j + j+1: the same values) but 16 at a time, the vectors transposed as they are added.
static inline void reduce16(const __m512* a, int n, float* out) {
  __m512 v[16], c[8], d[4], e[2];
  for (int i = 0; i < 16; i++) v[i] = i < n ? a[i] : _mm512_setzero_ps();
  for (int i = 0; i < 8; i++)  // 128-bit quarters [a0 a1 b0 b1] + [a2 a3 b2 b3]: accumulators 2i, 2i+1 by halves
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; i++)  // accumulators 4i..4i+3, one per quarter
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; i++)  // quarter q: two lanes of accumulator 8i + q, then two of 8i + 4 + q
    e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  float s[16];  // lane 4q + i: accumulator q + 4i
  _mm512_storeu_ps(s, _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1))));
  for (int i = 0; i < n; i++) out[i] = s[4 * (i % 4) + i / 4];
}
#endif

// Rows n0..n1 of w against the M rows of x, R rows of w per pass (the last n1 - n0 mod R one at a time).
template <int M, int R>
static void rows_tile(const float* x, const float* w, const float* b, float* y, int64_t N, int64_t K, int64_t n0,
                      int64_t n1) {
  const int64_t K16 = K / V * V;
  [[maybe_unused]] const int64_t ahead = rows_prefetch_ahead<R, float>(K);
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const float* w0 = w + n * K;
#if defined(__AVX512F__)
    __m512 acc[R][M];
    for (int r = 0; r < R; r++)
      for (int mm = 0; mm < M; mm++) acc[r][mm] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += V) {
      for (int r = 0; r < R; r++) _mm_prefetch(reinterpret_cast<const char*>(w0 + ahead + r * K + k), _MM_HINT_T1);
      if constexpr (M <= R) {  // the x rows stay in registers
        __m512 xv[M];
        for (int mm = 0; mm < M; mm++) xv[mm] = load_once(x + mm * K + k);
        for (int r = 0; r < R; r++) {
          const __m512 wv = M > 1 ? load_once(w0 + r * K + k) : _mm512_loadu_ps(w0 + r * K + k);
          for (int mm = 0; mm < M; mm++) acc[r][mm] = _mm512_fmadd_ps(wv, xv[mm], acc[r][mm]);
        }
      } else {  // the weight rows stay in registers
        __m512 wv[R];
        for (int r = 0; r < R; r++) wv[r] = load_once(w0 + r * K + k);
        for (int mm = 0; mm < M; mm++) {
          const __m512 xv = load_once(x + mm * K + k);
          for (int r = 0; r < R; r++) acc[r][mm] = _mm512_fmadd_ps(wv[r], xv, acc[r][mm]);
        }
      }
    }
    __m512 flat[R * M];
    for (int r = 0; r < R; r++)
      for (int mm = 0; mm < M; mm++) flat[r * M + mm] = acc[r][mm];
    float sums[(R * M + 15) / 16 * 16];
    for (int i = 0; i < R * M; i += 16) reduce16(flat + i, std::min(16, R * M - i), sums + i);
    for (int r = 0; r < R; r++)
      for (int mm = 0; mm < M; mm++) {
        float s = sums[r * M + mm];
        for (int64_t k = K16; k < K; k++) s = std::fma(w0[r * K + k], x[mm * K + k], s);
        y[mm * N + n + r] = s + (b ? b[n + r] : 0.0f);
      }
#else
    float acc[R][M][V] = {};
    for (int64_t k = 0; k < K16; k += V)
      for (int r = 0; r < R; r++) {
        const float* wr = w0 + r * K + k;
        __builtin_prefetch(wr + ahead, 0, 0);
        for (int mm = 0; mm < M; mm++) {
          const float* xm = x + mm * K + k;
          for (int j = 0; j < V; j++) acc[r][mm][j] = std::fma(wr[j], xm[j], acc[r][mm][j]);
        }
      }
    for (int r = 0; r < R; r++)
      for (int mm = 0; mm < M; mm++) {
        float* a = acc[r][mm];
        for (int h = V / 2; h > 0; h /= 2)
          for (int j = 0; j < h; j++) a[j] += a[j + h];
        float s = a[0];
        for (int64_t k = K16; k < K; k++) s = std::fma(w0[r * K + k], x[mm * K + k], s);
        y[mm * N + n + r] = s + (b ? b[n + r] : 0.0f);
      }
#endif
  }
  if constexpr (R > 1) rows_tile<M, 1>(x, w, b, y, N, K, n, n1);
}

using RowsTileFn = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
template <size_t... I>
constexpr std::array<RowsTileFn, kGroup> rows_tiles(std::index_sequence<I...>) {
  return {rows_tile<I + 1, tile_rows<I + 1>()>...};
}
constexpr auto kRowsTiles = rows_tiles(std::make_index_sequence<kGroup>());  // [m - 1]: the tile for m x rows

// Runs tile(m0, m, n0, n1) (x rows m0..m0+m against weight rows n0..n1) over every row of x and of w: passes of up to
// kRowsMax x rows, each a parallel loop over the blocks of weight rows that meets every group of the pass's rows
// while the block is in cache (groups of even size: 17 rows as 6, 6, 5).
template <typename Tile>
static void rows_passes(int64_t M, int64_t N, const Tile& tile) {
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  for (int64_t pass = 0; pass < M; pass += kRowsMax) {
    const int64_t rows = std::min(kRowsMax, M - pass), groups = (rows + kGroup - 1) / kGroup;
    // a thread takes at least ~150 weight rows for one group of x rows (fewer as the groups add work per row)
    at::parallel_for(0, blocks, std::max<int64_t>(1, 6 / groups), [&](int64_t a, int64_t e) {
      for (int64_t blk = a; blk < e; blk++) {
        const int64_t n0 = blk * kRowBlock, n1 = std::min(N, n0 + kRowBlock);
        for (int64_t g = 0, m0 = 0; g < groups; g++) {  // the block is read from memory once, then from the cache
          const int64_t m = (rows - m0 + groups - g - 1) / (groups - g);
          tile(pass + m0, m, n0, n1);
          m0 += m;
        }
      }
    });
  }
}

// --- bf16: bf16 weights and x, fp32 sums, a bias in bf16 or fp32, bf16 out (each output rounded once, to nearest
// even). With AVX512-BF16 a tile takes 32 bf16 of k at a time through vdpbf16ps: lane j of an accumulator adds the
// products of k = 32i + 2j and 32i + 2j + 1 (each exact in fp32); K's last partial vector is loaded masked (zeros past
// K) and goes through the same instruction. Without it (AVX-512F, AVX2, anything else) a tile reads 2L bf16 of k at a
// time as L words and multiplies each word's halves (a bf16 is the top half of an fp32) by x widened once per call,
// K's last partial block zero-padded. Either way each output is the same instructions in the same order for every
// row.

// A bias in fp32 or bf16 (or none), read as fp32.
struct RowsBias {
  const float* f = nullptr;
  const at::BFloat16* h = nullptr;
  float at(int64_t n) const { return f ? f[n] : (h ? static_cast<float>(h[n]) : 0.0f); }
};

#if defined(__AVX512BF16__)
using RowsBf16X = const at::BFloat16*;  // x as given: vdpbf16ps takes bf16 pairs
constexpr int64_t kRowsBf16Vec = 32;     // bf16 per vector

// 32 bf16 of k from p, zeros past the `mask` bits (a full mask: a plain load); `once` as load_once.
static inline __attribute__((always_inline)) __m512bh rows_load_bf16(const at::BFloat16* p, __mmask32 mask,
                                                                      bool once) {
  __m512i v = mask == ~__mmask32(0) ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(mask, p);
  if (once) asm("" : "+v"(v));
  return (__m512bh)v;
}

// Rows n0..n1 of w against the M rows of x (rows ldx apart), R rows of w per pass (the last n1 - n0 mod R one at a
// time).
template <int M, int R>
static void rows_tile_bf16(RowsBf16X x, int64_t ldx, const at::BFloat16* w, RowsBias b, at::BFloat16* y, int64_t N,
                           int64_t K, int64_t n0, int64_t n1) {
  const int64_t Kv = K / kRowsBf16Vec * kRowsBf16Vec;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t(1) << (K - Kv)) - 1);
  const int64_t ahead = rows_prefetch_ahead<R, at::BFloat16>(K);
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const at::BFloat16* w0 = w + n * K;
    __m512 acc[R][M];
    for (int r = 0; r < R; r++)
      for (int mm = 0; mm < M; mm++) acc[r][mm] = _mm512_setzero_ps();
    auto step = [&](int64_t k, __mmask32 mask) __attribute__((always_inline)) {
      for (int r = 0; r < R; r++) _mm_prefetch(reinterpret_cast<const char*>(w0 + ahead + r * K + k), _MM_HINT_T1);
      if constexpr (M <= R) {  // the x rows stay in registers
        __m512bh xv[M];
        for (int mm = 0; mm < M; mm++) xv[mm] = rows_load_bf16(x + mm * ldx + k, mask, true);
        for (int r = 0; r < R; r++) {
          const __m512bh wv = rows_load_bf16(w0 + r * K + k, mask, M > 1);
          for (int mm = 0; mm < M; mm++) acc[r][mm] = _mm512_dpbf16_ps(acc[r][mm], wv, xv[mm]);
        }
      } else {  // the weight rows stay in registers
        __m512bh wv[R];
        for (int r = 0; r < R; r++) wv[r] = rows_load_bf16(w0 + r * K + k, mask, true);
        for (int mm = 0; mm < M; mm++) {
          const __m512bh xv = rows_load_bf16(x + mm * ldx + k, mask, true);
          for (int r = 0; r < R; r++) acc[r][mm] = _mm512_dpbf16_ps(acc[r][mm], wv[r], xv);
        }
      }
    };
    for (int64_t k = 0; k < Kv; k += kRowsBf16Vec) step(k, ~__mmask32(0));
    if (Kv < K) step(Kv, tail);
    __m512 flat[R * M];
    for (int r = 0; r < R; r++)
      for (int mm = 0; mm < M; mm++) flat[r * M + mm] = acc[r][mm];
    float sums[(R * M + 15) / 16 * 16];
    for (int i = 0; i < R * M; i += 16) reduce16(flat + i, std::min(16, R * M - i), sums + i);
    for (int r = 0; r < R; r++)
      for (int mm = 0; mm < M; mm++) y[mm * N + n + r] = at::BFloat16(sums[r * M + mm] + b.at(n + r));
  }
  if constexpr (R > 1) rows_tile_bf16<M, 1>(x, ldx, w, b, y, N, K, n, n1);
}
#else
// x widened to fp32 once per call and dealt out per block of 2L k: the L odd k, then the L even k, which are the high
// and the low halves of the L words a weight vector of 2L bf16 reads as (pair_hi, pair_lo: no widening per weight);
// rows zero-padded to a multiple of 2L. Lane j of an accumulator adds, per block, weight k = 2j + 1 times x, then
// k = 2j (the pair step's order, dot_step), each one multiply-add.
using RowsBf16X = const float*;
constexpr int64_t kRowsBf16Vec = 2 * L;  // bf16 per block

// x [K] -> xw [ldx] (ldx: K rounded up to whole blocks) in the blocks above, zeros past K.
inline void deal_pairs(const at::BFloat16* x, int64_t K, int64_t ldx, float* xw) {
  for (int64_t k = 0; k < ldx; k++) {
    const int64_t blk = k / kRowsBf16Vec * kRowsBf16Vec, j = (k - blk) / 2;
    xw[blk + (k % 2 ? j : L + j)] = k < K ? static_cast<float>(x[k]) : 0.0f;
  }
}

// Bytes past a tile's first weight byte at which it prefetches as it reads: one stream along the thread's rows, at
// the pace it reads them (a tile's R rows lie one after the other), rather than R streams per tile.
constexpr int64_t kRowsPrefetchBytes = 4096;

template <int M, int R>
static void rows_tile_bf16(RowsBf16X x, int64_t ldx, const at::BFloat16* w, RowsBias b, at::BFloat16* y, int64_t N,
                           int64_t K, int64_t n0, int64_t n1) {
  const int64_t Kv = K / kRowsBf16Vec * kRowsBf16Vec;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const at::BFloat16* w0 = w + n * K;
    const char* ahead = reinterpret_cast<const char*>(w0) + kRowsPrefetchBytes;
    vfloat acc[R][M] = {};
    auto step = [&](int64_t k, const vuint* wd) __attribute__((always_inline)) {
      for (int mm = 0; mm < M; mm++) {
        const vfloat xh = vload(x + mm * ldx + k), xl = vload(x + mm * ldx + k + L);
        for (int r = 0; r < R; r++)
          acc[r][mm] = vfma((vfloat)pair_lo(wd[r]), xl, vfma((vfloat)pair_hi(wd[r]), xh, acc[r][mm]));
      }
    };
    for (int64_t k = 0; k < Kv; k += kRowsBf16Vec) {
      for (int64_t o = 0; o < R * kRowsBf16Vec * 2; o += 64) __builtin_prefetch(ahead + o, 0, 0);
      ahead += R * kRowsBf16Vec * 2;
      vuint wd[R];
      for (int r = 0; r < R; r++) wd[r] = vload(reinterpret_cast<const uint32_t*>(w0 + r * K + k));
      step(k, wd);
    }
    if (Kv < K) {  // the last K % 2L weights, zero-padded (x is zero there too)
      vuint wd[R];
      for (int r = 0; r < R; r++) {
        at::BFloat16 pad[kRowsBf16Vec] = {};
        std::copy(w0 + r * K + Kv, w0 + r * K + K, pad);
        wd[r] = vload(reinterpret_cast<const uint32_t*>(pad));
      }
      step(Kv, wd);
    }
    for (int r = 0; r < R; r++)
      for (int mm = 0; mm < M; mm++) y[mm * N + n + r] = at::BFloat16(hsum(acc[r][mm]) + b.at(n + r));
  }
  if constexpr (R > 1) rows_tile_bf16<M, 1>(x, ldx, w, b, y, N, K, n, n1);
}
#endif

using RowsBf16TileFn = void (*)(RowsBf16X, int64_t, const at::BFloat16*, RowsBias, at::BFloat16*, int64_t, int64_t,
                                int64_t, int64_t);
template <size_t... I>
constexpr std::array<RowsBf16TileFn, kGroup> rows_tiles_bf16(std::index_sequence<I...>) {
  return {rows_tile_bf16<I + 1, tile_rows<I + 1>()>...};
}
constexpr auto kRowsBf16Tiles = rows_tiles_bf16(std::make_index_sequence<kGroup>());

// The checks and set-up every linear kernel shares: x [..., K] and a contiguous weight [N, K], both fp32 or both bf16,
// a bias of N entries in fp32 (or, for bf16, in bf16); y [..., N] in x's dtype (empty when x has no rows).
struct LinearCall {
  torch::Tensor x, y, b;  // x contiguous; b keeps the contiguous bias alive for rb
  RowsBias rb;
  int64_t M, N, K;
  bool bf16;
};

LinearCall check_linear(const char* who, torch::Tensor x, const torch::Tensor& w,
                        const c10::optional<torch::Tensor>& bias) {
  const auto dt = w.scalar_type();
  LinearCall c;
  c.bf16 = dt == torch::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), who, ": x and the weight must be CPU tensors");
  TORCH_CHECK((dt == torch::kFloat32 || c.bf16) && x.scalar_type() == dt, who,
              ": x and the weight must be both float32 or both bfloat16, got ", x.scalar_type(), " and ", dt);
  TORCH_CHECK(w.is_contiguous(), who, ": weight must be contiguous");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2, who, ": x [..., K] and a weight [N, K]");
  c.K = x.size(-1), c.M = x.numel() ? x.numel() / c.K : 0, c.N = w.size(0);
  TORCH_CHECK(w.size(1) == c.K, who, ": x has ", c.K, " features, the weight ", w.size(1));
  c.x = x.contiguous();
  auto sizes = c.x.sizes().vec();
  sizes.back() = c.N;
  c.y = torch::empty(sizes, c.x.options());
  if (bias.has_value()) {
    c.b = bias->contiguous();
    TORCH_CHECK(c.b.device().is_cpu() && (c.b.scalar_type() == torch::kFloat32 || (c.bf16 && c.b.scalar_type() == dt)),
                who, ": bias must be a CPU float32", c.bf16 ? " or bfloat16" : "", " tensor, got ", c.b.scalar_type());
    TORCH_CHECK(c.b.numel() == c.N, who, ": bias has ", c.b.numel(), " entries for ", c.N, " outputs");
    if (c.b.scalar_type() == torch::kFloat32)
      c.rb.f = c.b.data_ptr<float>();
    else
      c.rb.h = c.b.data_ptr<at::BFloat16>();
  }
  return c;
}

// x [..., K] @ w [N, K]^T (+ bias [N]) -> [..., N], any number of rows: x and w both fp32 (a bias in fp32) or both
// bf16 (a bias in bf16 or fp32; out in bf16).
torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  const LinearCall c = check_linear("rows_linear", x, w, bias);
  const int64_t M = c.M, N = c.N, K = c.K;
  const RowsBias rb = c.rb;
  torch::Tensor y = c.y;
  x = c.x;
  if (M == 0) return y;
  if (!c.bf16) {
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    rows_passes(M, N, [&](int64_t m0, int64_t m, int64_t n0, int64_t n1) {
      kRowsTiles[m - 1](xp + m0 * K, wp, rb.f, yp + m0 * N, N, K, n0, n1);
    });
    return y;
  }
#if defined(__AVX512BF16__)
  RowsBf16X xp = x.data_ptr<at::BFloat16>();
  const int64_t ldx = K;
#else
  const int64_t ldx = (K + kRowsBf16Vec - 1) / kRowsBf16Vec * kRowsBf16Vec;
  std::vector<float> xf(M * ldx);  // exact: a bf16 is an fp32 with a shorter mantissa
  for (int64_t m = 0; m < M; m++) deal_pairs(x.data_ptr<at::BFloat16>() + m * K, K, ldx, xf.data() + m * ldx);
  RowsBf16X xp = xf.data();
#endif
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  rows_passes(M, N, [&](int64_t m0, int64_t m, int64_t n0, int64_t n1) {
    kRowsBf16Tiles[m - 1](xp + m0 * ldx, ldx, wp, rb, yp + m0 * N, N, K, n0, n1);
  });
  return y;
}

// ----------------------------------------------------------------------------- lanes_linear: prefill GEMM
// x [M, K] @ w [N, K]^T (+ bias) for prefill chunks of any size, fp32 or bf16: the x rows lie in the lanes of the
// vectors (L rows per packed tile, its columns transposed once per call) and each weight is broadcast to them, so
// y[m, n] is one chain of steps over k in order in lane m % L of one accumulator, the same instructions for every row
// however many share the call, with no reduction across lanes. A prompt prefilled in chunks of any sizes therefore
// gets the same bits (the engine may size chunks by load), where a GEMM library picks its summation order by the row
// count. A step is dot_step's: an fp32 multiply-add, or a bf16 pair of k (vdpbf16ps with AVX512-BF16). Unlike
// `rows` (which sums a row's products in lanes, then across them), nothing is wasted on row counts that are
// multiples of L and the weights are read once per block of rows, so it runs at the GEMM libraries' speed from a few
// dozen rows up; below L rows most lanes idle.
#if defined(__AVX512F__)
// a tile: MV packed tiles of L rows x NR weight rows (24 accumulators); 3 x 8 ran SmolLM2's linears 3-7% faster
// than 4 x 6 at 256-1024 rows on Zen 5 (fp32 and bf16)
constexpr int kLanesMV = 3, kLanesNR = 8;
#else  // 12 accumulators + 2 loaded + 1 broadcast of 16 registers: 8 loads per 12 multiply-adds (1 x 8: 9 per 8, 1.14x
       // slower at a 256-row chunk of SmolLM2's linears on Zen 3, fp32 and bf16)
constexpr int kLanesMV = 2, kLanesNR = 6;
#endif

// x [M, Kw] words (fp32 values, or bf16 pairs as uint32) -> xt [ceil(M / L)][Kw][L], rows past M zero.
template <typename Wd>
static void lanes_pack(const Wd* x, int64_t M, int64_t Kw, Wd* xt) {
  const int64_t tiles = (M + L - 1) / L;
  at::parallel_for(0, tiles, 1, [&](int64_t a, int64_t e) {
    for (int64_t t = a; t < e; t++) {
      const int64_t rows = std::min<int64_t>(L, M - t * L);
      const Wd* src = x + t * L * Kw;
      Wd* dst = xt + t * Kw * L;
      int64_t k = 0;
#if defined(__AVX512F__)
      if (rows == L)  // whole 16 x 16 blocks through registers (bit moves: the words are copied, never computed on)
        for (; k + 16 <= Kw; k += 16) {
          __m512 v[16];
          transpose16(reinterpret_cast<const float*>(src + k), Kw, v);
          for (int d = 0; d < 16; d++) _mm512_storeu_ps(reinterpret_cast<float*>(dst + (k + d) * L), v[d]);
        }
#endif
      for (; k < Kw; k++)
        for (int64_t j = 0; j < L; j++) dst[k * L + j] = j < rows ? src[j * Kw + k] : Wd{};
    }
  });
}

inline float lanes_word(const float* w, int64_t i) { return w[i]; }
inline uint32_t lanes_word(const bf16* w, int64_t i) {  // elements 2i and 2i + 1: a pair in one word
  uint32_t u;
  std::memcpy(&u, w + 2 * i, sizeof(u));
  return u;
}

// out [NR][MV * L] = the MV tiles of xt (Kw words each) against weight rows w0, w0 + K, ... (NR of them). `ahead`
// (or null): the next group's weight rows, `stride` bytes of them per word, prefetched at this tile's pace. Not
// inlined: inlined into lanes_run (GCC 12, AVX2) its accumulators were stored to the stack at every step.
template <int MV, int NR, typename E, typename Wd>
static __attribute__((noinline)) void lanes_tile(const Wd* xt, int64_t Kw, const E* w0, int64_t K, float* out,
                                                 const char* ahead, int64_t stride) {
  using XV = std::conditional_t<std::is_same_v<Wd, float>, vfloat, vuint>;
  vfloat acc[MV][NR] = {};
  for (int64_t p0 = 0; p0 < Kw; p0 += 16) {  // the prefetch per 16 words, outside the multiply-adds' loop
    if (ahead)
      for (int64_t o = 0; o < 16 * stride; o += 64) __builtin_prefetch(ahead + p0 * stride + o, 0, 0);
    const int64_t p1 = std::min<int64_t>(Kw, p0 + 16);
    for (int64_t p = p0; p < p1; p++) {
      XV xv[MV];
      for (int i = 0; i < MV; i++) xv[i] = vload(xt + (i * Kw + p) * L);
      for (int r = 0; r < NR; r++) {
        const Wd q = lanes_word(w0 + r * K, p);
        for (int i = 0; i < MV; i++) acc[i][r] = dot_step(q, xv[i], acc[i][r]);
      }
    }
  }
  for (int r = 0; r < NR; r++)
    for (int i = 0; i < MV; i++) vstore(out + (r * MV + i) * L, acc[i][r]);
}

// y rows 0..rows (ldy apart), columns 0..kLanesNR = the transposed accumulators out [kLanesNR][L] (rows ldo apart)
// plus the bias, rounded to E.
template <typename E>
static inline void lanes_store(const float* out, int64_t ldo, const float* bias, int64_t rows, E* y, int64_t ldy) {
#if defined(__AVX512F__)
  __m512 v[16];
  transpose16(out, ldo, v);  // v[j]: row j's kLanesNR outputs (and 16 - kLanesNR unused lanes)
  const __m512 bv = _mm512_loadu_ps(bias);
  constexpr __mmask16 keep = (1u << kLanesNR) - 1;
  for (int64_t j = 0; j < rows; j++) {
    const __m512 s = _mm512_add_ps(v[j], bv);
    if constexpr (std::is_same_v<E, float>) {
      _mm512_mask_storeu_ps(y + j * ldy, keep, s);
    } else {  // bf16_bits, 16 at a time
      const __m512i u = _mm512_castps_si512(s);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
      r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
      _mm256_mask_storeu_epi16(y + j * ldy, keep, _mm512_cvtepi32_epi16(r));
    }
  }
#else
  for (int64_t j = 0; j < rows; j++)
    for (int r = 0; r < kLanesNR; r++) store_elem(y + j * ldy + r, out[r * ldo + j] + bias[r]);
#endif
}

// bf16 without the CPU's bf16 dot product (`wide`): a pair step is two multiply-adds, the pair's high element first
// (dot_step), so x and each group of weight rows are widened to fp32 once, each pair's two elements swapped, and the
// fp32 tile runs over them: the same products in the same order as the pair steps, without unpacking a pair per step.
// dst[i ^ 1] = src[i] widened to fp32, for i < n (even): each pair's elements swapped.
inline void widen_pairs_swapped(const bf16* src, int64_t n, float* dst) {
  vint swap;
  for (int j = 0; j < L; j++) swap[j] = j ^ 1;
  int64_t i = 0;
  for (; i + L <= n; i += L) vstore(dst + i, __builtin_shuffle(vload(src + i), swap));
  for (; i < n; i++) dst[i ^ 1] = load_elem(src + i);
}

template <typename E>
static void lanes_run(const E* x, const E* w, RowsBias b, E* y, int64_t M, int64_t N, int64_t K) {
  constexpr bool wide = !std::is_same_v<E, float> && !kDpbf16;
  using Wd = std::conditional_t<std::is_same_v<E, float> || wide, float, uint32_t>;
  constexpr int MV = kLanesMV, NR = kLanesNR;
  const int64_t Kw = std::is_same_v<Wd, float> ? K : K / 2, tiles = (M + L - 1) / L;
  const int64_t stride = NR * K * static_cast<int64_t>(sizeof(E)) / Kw;  // bytes of a group's weight rows per word
  std::unique_ptr<Wd[]> xt(new Wd[tiles * Kw * L]);
  if constexpr (wide) {
    std::unique_ptr<float[]> xw(new float[M * K]);
    widen_pairs_swapped(x, M * K, xw.get());  // K is even: i ^ 1 is the other element of i's pair
    lanes_pack(xw.get(), M, K, xt.get());
  } else {
    lanes_pack(reinterpret_cast<const Wd*>(x), M, Kw, xt.get());
  }
  // tiles per block: a block's packed rows (~256 KB) stay in the core's L2 while the thread's weight rows pass by
  const int64_t per_block = std::max<int64_t>(MV, (256 << 10) / (Kw * L * 4) / MV * MV);
  const int64_t groups = (N + NR - 1) / NR;
  at::parallel_for(0, groups, 1, [&](int64_t a, int64_t e) {
    alignas(64) float out[16 * MV * L];  // NR rows, room for 16 (lanes_store transposes 16)
    std::vector<float> wf(wide ? NR * K : 0);  // wide: the group's weight rows
    for (int64_t b0 = 0; b0 < tiles; b0 += per_block) {
      const int64_t b1 = std::min(tiles, b0 + per_block);
      for (int64_t g = a; g < e; g++) {
        const int64_t n0 = std::min(g * NR, N - NR);  // the last group overlaps the one before: the same values
        float bias[16] = {};
        for (int r = 0; r < NR; r++) bias[r] = b.at(n0 + r);
        if constexpr (wide)
          widen_pairs_swapped(w + n0 * K, NR * K, wf.data());
        const auto* wg = [&] {
          if constexpr (wide) return static_cast<const float*>(wf.data());
          else return w + n0 * K;
        }();
        // The block's first tile prefetches the next group's weight rows (contiguous), so they come from memory
        // while this group computes: a few tiles (a verify pass) would otherwise wait on each group's rows, too short
        // a read for the hardware prefetcher (fp32 at 8-16 rows: 1.3-1.4x, at a 256-row chunk ~1.02x).
        const char* next = g + 1 < groups ? reinterpret_cast<const char*>(w + std::min((g + 1) * NR, N - NR) * K)
                                          : nullptr;
        for (int64_t t = b0; t < b1;) {
          const int mv = b1 - t >= MV ? MV : 1;  // whole tiles of MV, then the block's last ones one by one
          const char* ahead = t == b0 ? next : nullptr;
          if (mv == MV)
            lanes_tile<MV, NR>(xt.get() + t * Kw * L, Kw, wg, K, out, ahead, stride);
          else
            lanes_tile<1, NR>(xt.get() + t * Kw * L, Kw, wg, K, out, ahead, stride);
          for (int i = 0; i < mv; i++)
            lanes_store(out + i * L, mv * L, bias, std::min<int64_t>(L, M - (t + i) * L), y + (t + i) * L * N + n0, N);
          t += mv;
        }
      }
    }
  });
}

// Fewer than L rows leave most of a lanes tile's lanes idle (a decode step: one of L). There the outputs take the
// lanes instead: a square of L weight rows x L words is transposed in registers (lane j: output n0 + j) and each x
// word is broadcast, so y[m, n] is the same chain of dot_steps over k in order as in lanes_tile (a multiply-add's
// factors commute, as vdpbf16ps's pair products do), plus the bias, rounded once: lanes_linear's bits, its weights read
// once per call for up to kColsRows rows at a time. Needs N >= L.
#if defined(__AVX512F__) || defined(__AVX2__)
constexpr int kColsRows = L == 16 ? 8 : 4;  // x rows per pass: L transposed words + the accumulators in registers

// A vector of weight words as dot_step takes them: fp32 values, or bf16 pairs (the same bits as a vuint).
template <typename Wd>
inline auto as_words(const vfloat& v) {
  if constexpr (std::is_same_v<Wd, float>)
    return v;
  else
    return reinterpret_cast<const vuint&>(v);
}

template <int MR, typename Xq, typename Wd>
static void cols_tile(const Xq* xq, int64_t Kw, const Wd* w0, RowsBias b, int64_t n0, float* out) {
  vfloat acc[MR] = {};
  int64_t p = 0;
  for (; p + L <= Kw; p += L) {
    vfloat wv[L];
    // the group two on, read in order at this group's pace: one stream rather than L
    const char* ahead = reinterpret_cast<const char*>(w0 + 2 * L * Kw + p * L);
    for (int o = 0; o < L * L * 4; o += 64) __builtin_prefetch(ahead + o, 0, 0);
    transpose_words(reinterpret_cast<const float*>(w0 + p), Kw, wv);
    for (int c = 0; c < L; c++)
      for (int m = 0; m < MR; m++) acc[m] = dot_step(xq[m * Kw + p + c], as_words<Wd>(wv[c]), acc[m]);
  }
  for (; p < Kw; p++) {  // the last Kw % L words, one gathered vector each
    alignas(64) Wd col[L];
    for (int j = 0; j < L; j++) col[j] = w0[j * Kw + p];
    const vfloat wv = vload(reinterpret_cast<const float*>(col));
    for (int m = 0; m < MR; m++) acc[m] = dot_step(xq[m * Kw + p], as_words<Wd>(wv), acc[m]);
  }
  alignas(64) float bias[L];
  for (int j = 0; j < L; j++) bias[j] = b.at(n0 + j);
  for (int m = 0; m < MR; m++) vstore(out + m * L, acc[m] + vload(bias));
}

template <int MR, typename Xq, typename Wd>  // cols_tile for mr <= MR rows
static void cols_pass(int mr, const Xq* xq, int64_t Kw, const Wd* w0, RowsBias b, int64_t n0, float* out) {
  if (mr == MR)
    cols_tile<MR>(xq, Kw, w0, b, n0, out);
  else if constexpr (MR > 1)
    cols_pass<MR - 1>(mr, xq, Kw, w0, b, n0, out);
}

template <typename E>
static void cols_run(const E* x, const E* w, RowsBias b, E* y, int64_t M, int64_t N, int64_t K) {
  constexpr bool fp32 = std::is_same_v<E, float>, wide = !fp32 && !kDpbf16;
  using Wd = std::conditional_t<fp32, float, uint32_t>;  // weight words as stored: fp32, or bf16 pairs
  using Xq = std::conditional_t<fp32, float, std::conditional_t<wide, WidePair, uint32_t>>;  // dot_step's scalar
  const int64_t Kw = fp32 ? K : K / 2;
  std::unique_ptr<Xq[]> xq(new Xq[M * Kw]);
  for (int64_t i = 0; i < M * Kw; i++) {
    if constexpr (fp32)
      xq[i] = x[i];
    else if constexpr (wide)
      xq[i] = widen(lanes_word(x, i));
    else
      xq[i] = lanes_word(x, i);
  }
  const Wd* ww = reinterpret_cast<const Wd*>(w);
  at::parallel_for(0, (N + L - 1) / L, 4, [&](int64_t a, int64_t e) {
    alignas(64) float out[kColsRows * L];
    for (int64_t g = a; g < e; g++) {
      const int64_t n0 = std::min(g * L, N - L);  // the last group overlaps the one before: the same values
      for (int64_t m0 = 0; m0 < M; m0 += kColsRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kColsRows, M - m0));
        cols_pass<kColsRows>(mr, xq.get() + m0 * Kw, Kw, ww + n0 * Kw, b, n0, out);
        for (int m = 0; m < mr; m++)
          for (int j = 0; j < L; j++) store_elem(y + (m0 + m) * N + n0 + j, out[m * L + j]);
      }
    }
  });
}
#endif

// lanes_run for a call's rows, or cols_run's same bits where they are fewer than L.
template <typename E>
static void lanes_any(const E* x, const E* w, RowsBias b, E* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if (M < L && N >= L) return cols_run(x, w, b, y, M, N, K);
#endif
  lanes_run(x, w, b, y, M, N, K);
}

// x [..., K] @ w [N, K]^T (+ bias [N]) -> [..., N]: x and w both fp32 (a bias in fp32) or both bf16 (a bias in bf16
// or fp32; out in bf16). The shapes the tiles do not take (fewer than kLanesNR outputs, bf16 with odd K) run on
// rows_linear, also row-invariant: the kernel follows the shape, never the row count.
torch::Tensor lanes_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  const LinearCall c = check_linear("lanes_linear", x, w, bias);
  if (c.N < kLanesNR || (c.bf16 && c.K % 2)) return rows_linear(x, w, bias);  // by shape: the same for every row
  if (c.M == 0) return c.y;
  if (c.bf16)
    lanes_any(reinterpret_cast<const bf16*>(c.x.data_ptr()), reinterpret_cast<const bf16*>(w.data_ptr()), c.rb,
              reinterpret_cast<bf16*>(c.y.data_ptr()), c.M, c.N, c.K);
  else
    lanes_any(c.x.data_ptr<float>(), w.data_ptr<float>(), c.rb, c.y.data_ptr<float>(), c.M, c.N, c.K);
  return c.y;
}

// tile_attention of several sequences at once, sequence i's new tokens qs[i] over its cache (ks[i], vs[i]), where
// every cache begins with the same `shared_keys` K/V, bit for bit (a prefix copied from one slot to the others): the
// whole key chunks of that prefix are read once, from the first cache, for the rows of every sequence (rather than once
// per sequence), and each sequence folds them before its own chunks. A row goes through the same operations as in its
// own tile_attention call, so the results are those calls' bits. Each sequence: at most kSplitTokens new tokens, its
// start at or past `shared_keys`; q, the caches and the masks as tile_attention takes them.
std::vector<torch::Tensor> group_attention(std::vector<torch::Tensor> qs, std::vector<torch::Tensor> ks,
                                           std::vector<torch::Tensor> vs, std::vector<int64_t> starts,
                                           std::vector<c10::optional<torch::Tensor>> masks, int64_t shared_keys,
                                           double scale) {
  const size_t m = qs.size();
  TORCH_CHECK(m > 0 && ks.size() == m && vs.size() == m && starts.size() == m && masks.size() == m,
              "group_attention: one q, k_cache, v_cache, start and mask per sequence");
  std::vector<CacheCall> calls;
  std::vector<torch::Tensor> qc;
  for (size_t i = 0; i < m; i++) {
    calls.push_back(check_cache_call("group_attention", qs[i], ks[i], vs[i], starts[i], masks[i]));
    const CacheCall& c = calls.back();
    TORCH_CHECK(c.H == calls[0].H && c.D == calls[0].D && c.hkv == calls[0].hkv, "group_attention: head shapes differ");
    check_same_dtype("group_attention", qs[i], qs[0]);
    TORCH_CHECK(c.n <= kSplitTokens, "group_attention: at most ", kSplitTokens, " new tokens per sequence");
    TORCH_CHECK(shared_keys >= 0 && shared_keys <= starts[i], "group_attention: ", shared_keys,
                " shared keys past a sequence's start ", starts[i]);
    qc.push_back(c.q);
  }
  const int64_t chunks = shared_keys / kChunkKeys;
  return by_elem(qs[0], [&](auto elem) {
    using E = decltype(elem);
    std::vector<torch::Tensor> out;
    if (chunks == 0 || m == 1) {
      for (size_t i = 0; i < m; i++) out.push_back(tile_attention_impl<E>(calls[i], ks[i], vs[i], starts[i], scale));
      return out;
    }
    // every sequence's rows, token-major, one sequence after the other, over the first cache's shared chunks
    const CacheCall& c0 = calls[0];
    torch::Tensor q_all = torch::cat(qc, 1);
    const CacheCall all{q_all, {}, c0.H, q_all.size(1), c0.D, c0.hkv, c0.g, nullptr};
    ChunkParts parts;
    parts.chunks = chunks;
    tile_attention_impl<E>(all, ks[0], vs[0], chunks * kChunkKeys, scale, {&parts});
    int64_t row0 = 0;
    for (size_t i = 0; i < m; i++) {
      out.push_back(tile_attention_impl<E>(calls[i], ks[i], vs[i], starts[i], scale, {nullptr, &parts, row0}));
      row0 += calls[i].n * calls[i].g;
    }
    return out;
  });
}

// ----------------------------------------------------------------------------- layer_stack: a forward's layers
// Every decoder layer of a row-invariant forward (a decode step, a verify pass) in one call: the same kernels, in
// the same order, on the same tensors as Block._forward_native with every linear on rows_linear, or on lanes_linear
// where `lanes` (so the same bits), without the Python between them (at SmolLM2's size ~2.5 ms of a ~21 ms bf16
// decode step on Zen 3). x [T, C] holds the segments' new tokens in order; cos/sin are [T, D] (or [T, 1, D]);
// weights, per layer in order: attention norm, wqkv, its bias (None if none), wo, MLP norm, w_gate_up, w_down;
// k_cache / v_cache [slots, layers, Hkv, capacity, D]; per segment its slot, committed length, token count and tree
// mask (None: causal), and its group: the first of the segments whose caches begin with the same `shared_keys` K/V
// (group_attention), itself if none. Returns the last layer's output, then the output of each layer listed in
// `capture` (ascending).
std::vector<torch::Tensor> layer_stack(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                       std::vector<c10::optional<torch::Tensor>> weights, double eps,
                                       torch::Tensor k_cache, torch::Tensor v_cache, std::vector<int64_t> slots,
                                       std::vector<int64_t> starts, std::vector<int64_t> counts,
                                       std::vector<c10::optional<torch::Tensor>> masks, int64_t n_heads, double scale,
                                       std::vector<int64_t> capture, bool lanes, std::vector<int64_t> groups,
                                       std::vector<int64_t> shared_keys) {
  const auto linear = lanes ? lanes_linear : rows_linear;
  constexpr size_t kPerLayer = 7;
  const size_t segs = slots.size();
  TORCH_CHECK(weights.size() % kPerLayer == 0 && weights.size() / kPerLayer == size_t(k_cache.size(1)),
              "layer_stack: ", kPerLayer, " weights per layer of the cache's ", k_cache.size(1));
  TORCH_CHECK(segs > 0 && starts.size() == segs && counts.size() == segs && masks.size() == segs,
              "layer_stack: one slot, start, count and mask per segment");
  TORCH_CHECK(groups.size() == segs && shared_keys.size() == segs, "layer_stack: one group and shared length per segment");
  // the groups of segments whose caches share a prefix (group_attention): root segment -> its segments in order
  std::vector<std::vector<size_t>> members(segs);
  for (size_t i = 0; i < segs; i++) {
    TORCH_CHECK(groups[i] >= 0 && size_t(groups[i]) <= i && groups[groups[i]] == groups[i] &&
                    shared_keys[i] == shared_keys[groups[i]],
                "layer_stack: segment ", i, "'s group must be an earlier segment heading its own, sharing as many keys");
    members[groups[i]].push_back(i);
  }
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes(), "layer_stack: K/V [slots, layers, Hkv, cap, D]");
  int64_t rows = 0;
  for (size_t i = 0; i < segs; i++) rows += counts[i];
  TORCH_CHECK(x.dim() == 2 && x.size(0) == rows, "layer_stack: x [", rows, ", C] for the segments' tokens");
  const c10::optional<torch::Tensor> none;
  std::vector<torch::Tensor> out{x};
  size_t next_capture = 0;
  const int64_t layers = k_cache.size(1);
  for (int64_t l = 0; l < layers; l++) {
    const auto* w = weights.data() + l * kPerLayer;
    const torch::Tensor qkv = linear(rms_norm(x, *w[0], eps), *w[1], w[2]);
    std::vector<torch::Tensor> qs, ks, vs, outs(segs);
    for (size_t i = 0, offset = 0; i < segs; offset += counts[i], i++) {
      ks.push_back(k_cache.select(0, slots[i]).select(0, l));
      vs.push_back(v_cache.select(0, slots[i]).select(0, l));
      qs.push_back(rope_write(qkv, cos, sin, ks[i], vs[i], offset, counts[i], starts[i], n_heads));
    }
    for (size_t r = 0; r < segs; r++) {
      if (members[r].empty()) continue;  // a segment of an earlier one's group
      if (members[r].size() == 1) {
        outs[r] = tile_attention(qs[r], ks[r], vs[r], starts[r], masks[r], scale);
        continue;
      }
      std::vector<torch::Tensor> gq, gk, gv;
      std::vector<int64_t> gs;
      std::vector<c10::optional<torch::Tensor>> gm;
      for (size_t i : members[r]) {
        gq.push_back(qs[i]), gk.push_back(ks[i]), gv.push_back(vs[i]), gs.push_back(starts[i]), gm.push_back(masks[i]);
      }
      const auto got = group_attention(gq, gk, gv, gs, gm, shared_keys[r], scale);
      for (size_t j = 0; j < got.size(); j++) outs[members[r][j]] = got[j];
    }
    const torch::Tensor h = x + linear(outs.size() > 1 ? torch::cat(outs) : outs[0], *w[3], none);
    x = h + linear(silu_mul(linear(rms_norm(h, *w[4], eps), *w[5], none)), *w[6], none);
    if (next_capture < capture.size() && capture[next_capture] == l) {
      out.push_back(x);
      next_capture++;
    }
  }
  out[0] = x;
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL released while it runs (a whole forward): a server's other Python threads go on meanwhile
  m.def("layer_stack", &layer_stack, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope_write", &rope_write);
  m.def("tile_attention", &tile_attention);
  m.def("group_attention", &group_attention);
  m.attr("chunk_keys") = py::int_(kChunkKeys);      // the whole chunks group_attention shares
  m.attr("split_tokens") = py::int_(kSplitTokens);  // the most new tokens per sequence it takes
  m.def("rows_linear", &rows_linear);
  m.def("lanes_linear", &lanes_linear);
}
