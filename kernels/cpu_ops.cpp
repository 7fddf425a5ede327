// CPU kernels for the engine step of a Llama-family decoder (fp32), built at first use for the CPU at hand
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
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int V = 16;  // accumulator lanes: one AVX-512 register of fp32

// Sum of a[i] * b[i] over n, in 16 lanes then a fixed tree: the same order for every call.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[V] = {};
  int64_t i = 0;
  for (; i + V <= n; i += V)
    for (int j = 0; j < V; j++) acc[j] += a[i + j] * b[i + j];
  for (int w = V / 2; w > 0; w /= 2)
    for (int j = 0; j < w; j++) acc[j] += acc[j + w];
  float s = acc[0];
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

// exp for x <= 0 (softmax after subtracting the max): 2^n * e^r, |r| <= ln2/2, degree-7 Taylor (rel. error < 1e-8
// before rounding), written so the compiler vectorises a loop of it.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const int32_t ni = static_cast<int32_t>(x * 1.44269504088896341f - 0.5f);  // nearest integer (x <= 0): no floor,
  const float n = static_cast<float>(ni);                                    // which would not vectorise
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a CPU float32 tensor");
}

}  // namespace

// RMSNorm over the last dim of x [T, C]: x * rsqrt(mean(x^2) + eps) * w.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  x = x.contiguous();
  const int64_t C = x.size(-1), T = x.numel() / C;
  TORCH_CHECK(w.numel() == C, "rms_norm: weight has ", w.numel(), " entries for rows of ", C);
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.contiguous().data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t a, int64_t e) {
    for (int64_t t = a; t < e; t++) {
      const float* row = xp + t * C;
      const float inv = 1.0f / std::sqrt(dot(row, row, C) / static_cast<float>(C) + static_cast<float>(eps));
      float* out = yp + t * C;
      for (int64_t c = 0; c < C; c++) out[c] = wp[c] * (row[c] * inv);
    }
  });
  return y;
}

// silu(gate) * up for gate_up [T, 2I] (gate first) -> [T, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "gate_up");
  gate_up = gate_up.contiguous();
  const int64_t I2 = gate_up.size(-1), I = I2 / 2, T = gate_up.numel() / I2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t a, int64_t e) {
    for (int64_t t = a; t < e; t++) {
      const float* gr = g + t * I2;
      const float* ur = gr + I;
      float* out = yp + t * I;
      for (int64_t i = 0; i < I; i++) {  // sigmoid from e^-|x| (never overflows), vectorisable
        const float x = gr[i], e = exp_nonpos(-std::fabs(x));
        out[i] = x * ((x >= 0.0f ? 1.0f : e) / (1.0f + e)) * ur[i];
      }
    }
  });
  return y;
}

// RoPE on the q and k parts of qkv rows [row0, row0 + n) (qkv [T, (H + 2 Hkv) D], half-rotation layout, cos/sin
// [T, D]); the rotated k and the v of those rows are written to positions start..start+n of one layer's cache
// (k_cache / v_cache [Hkv, capacity, D], last two dims contiguous). Returns q as [H, n, D].
torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, int64_t row0, int64_t n, int64_t start, int64_t n_heads) {
  check_f32(qkv, "qkv");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  const int64_t hkv = k_cache.size(0), cap = k_cache.size(1), D = k_cache.size(2), half = D / 2;
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "rope_write: contiguous inputs");
  TORCH_CHECK(qkv.size(1) == (n_heads + 2 * hkv) * D, "rope_write: qkv width does not match the heads");
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == D && v_cache.stride(2) == 1 && v_cache.stride(1) == D,
              "rope_write: cache rows must be contiguous");
  TORCH_CHECK(start >= 0 && start + n <= cap, "rope_write: positions ", start, "..", start + n, " exceed capacity ",
              cap);
  auto q = torch::empty({n_heads, n, D}, qkv.options());
  const int64_t W = qkv.size(1);
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t ksh = k_cache.stride(0), vsh = v_cache.stride(0);
  const int64_t heads = n_heads + 2 * hkv;
  at::parallel_for(0, n * heads, 64, [&](int64_t a, int64_t e) {
    for (int64_t idx = a; idx < e; idx++) {
      const int64_t t = idx / heads, h = idx % heads;
      const float* x = src + (row0 + t) * W + h * D;
      const float* c = cp + (row0 + t) * D;
      const float* s = sp + (row0 + t) * D;
      float* out;
      if (h < n_heads) {
        out = qp + (h * n + t) * D;
      } else if (h < n_heads + hkv) {
        out = kc + (h - n_heads) * ksh + (start + t) * D;
      } else {
        std::memcpy(vc + (h - n_heads - hkv) * vsh + (start + t) * D, x, D * sizeof(float));
        continue;
      }
      for (int64_t d = 0; d < half; d++) out[d] = x[d] * c[d] - x[d + half] * s[d];
      for (int64_t d = half; d < D; d++) out[d] = x[d] * c[d] + x[d - half] * s[d];
    }
  });
  return q;
}

// One chunk of keys for the R query rows of one KV head: the unnormalised softmax of each row over the chunk, as
// (max m, sum l, out o = sum_j e^(s_j - m) v_j). Keys from `tree_lo` on are draft-tree tokens: row r (tree token
// r % n) sees tree key t iff visible(r % n, t); a row that sees no key of the chunk gets m = -inf, l = 0, o = 0.
// s is scratch of R * len floats.
template <typename Visible>
static void attend_chunk(const float* Q, const float* K, const float* Vv, int64_t R, int64_t D, int64_t len, float sc,
                         int64_t n, int64_t tree_lo, Visible visible, float* s, float* m, float* l, float* o) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  if (D % V == 0 && D <= 16 * V) {
    const int64_t nv = D / V;
    for (int64_t r = 0; r < R; r++) {
      __m512 q[16];
      for (int64_t c = 0; c < nv; c++) q[c] = _mm512_loadu_ps(Q + r * D + c * V);
      float* sr = s + r * len;
      for (int64_t j = 0; j < len; j++) {
        const float* kr = K + j * D;
        __m512 acc = _mm512_mul_ps(q[0], _mm512_loadu_ps(kr));
        for (int64_t c = 1; c < nv; c++) acc = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(kr + c * V), acc);
        sr[j] = _mm512_reduce_add_ps(acc) * sc;
      }
    }
  } else
#endif
  {
    for (int64_t r = 0; r < R; r++)
      for (int64_t j = 0; j < len; j++) s[r * len + j] = dot(Q + r * D, K + j * D, D) * sc;
  }
  for (int64_t r = 0; r < R; r++) {
    float* sr = s + r * len;
    for (int64_t j = std::max<int64_t>(tree_lo, 0); j < len; j++)
      if (!visible(r % n, j - tree_lo)) sr[j] = kNegInf;
    float lane_max[V];
    std::fill(lane_max, lane_max + V, kNegInf);
    int64_t j = 0;
    for (; j + V <= len; j += V)
      for (int u = 0; u < V; u++) lane_max[u] = std::max(lane_max[u], sr[j + u]);
    float mx = *std::max_element(lane_max, lane_max + V);
    for (; j < len; j++) mx = std::max(mx, sr[j]);
    if (mx == kNegInf) {  // nothing visible in this chunk
      std::fill(sr, sr + len, 0.0f);
      m[r] = kNegInf;
      l[r] = 0.0f;
      continue;
    }
    for (j = 0; j < len; j++) sr[j] = exp_nonpos(sr[j] - mx);
    for (j = std::max<int64_t>(tree_lo, 0); j < len; j++)  // exp_nonpos clamps: a hidden key must give exactly 0
      if (!visible(r % n, j - tree_lo)) sr[j] = 0.0f;
    float acc[V] = {};
    for (j = 0; j + V <= len; j += V)
      for (int u = 0; u < V; u++) acc[u] += sr[j + u];
    for (int w = V / 2; w > 0; w /= 2)
      for (int u = 0; u < w; u++) acc[u] += acc[u + w];
    float sum = acc[0];
    for (; j < len; j++) sum += sr[j];
    m[r] = mx;
    l[r] = sum;
  }
#if defined(__AVX512F__)
  if (D % V == 0 && D <= 16 * V) {
    const int64_t nv = D / V;
    for (int64_t r = 0; r < R; r++) {
      __m512 acc[16];
      for (int64_t c = 0; c < nv; c++) acc[c] = _mm512_setzero_ps();
      const float* sr = s + r * len;
      for (int64_t j = 0; j < len; j++) {
        const __m512 p = _mm512_set1_ps(sr[j]);
        const float* vr = Vv + j * D;
        for (int64_t c = 0; c < nv; c++) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + c * V), acc[c]);
      }
      for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(o + r * D + c * V, acc[c]);
    }
    return;
  }
#endif
  std::fill(o, o + R * D, 0.0f);
  for (int64_t j = 0; j < len; j++)
    for (int64_t r = 0; r < R; r++) {
      const float p = s[r * len + j];
      for (int64_t d = 0; d < D; d++) o[r * D + d] += p * Vv[j * D + d];
    }
}

// Attention of n new tokens, q [H, n, D], over one layer's cache (k_cache / v_cache [Hkv, capacity, D]) whose
// positions 0..start-1 are the committed prefix, every token sees all of them, and start..start+n-1 are the new
// tokens themselves (written by rope_write), seen through mask [n, n] (bool, True = visible; none = causal). A decode
// step is n = 1. GQA: the H / Hkv query heads of a group share each K/V chunk while it is in cache. The keys are cut
// into chunks of kChunk spread over the threads (split-K), each chunk's softmax kept as (max, sum, out) and merged
// exactly. Every row is computed the same way whatever n is. Returns [n, H * D].
torch::Tensor cache_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, int64_t start,
                              c10::optional<torch::Tensor> mask, double scale) {
  check_f32(q, "q");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  q = q.contiguous();
  TORCH_CHECK(q.dim() == 3, "cache_attention: q must be [heads, n, head_dim]");
  const int64_t H = q.size(0), n = q.size(1), D = q.size(2), hkv = k_cache.size(0), g = H / hkv, R = g * n;
  const int64_t length = start + n;
  TORCH_CHECK(H % hkv == 0 && k_cache.size(2) == D, "cache_attention: head shapes do not match");
  TORCH_CHECK(n >= 1 && start >= 0 && length <= k_cache.size(1), "cache_attention: positions ", start, "..", length,
              " out of range");
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == D && v_cache.stride(2) == 1 && v_cache.stride(1) == D,
              "cache_attention: cache rows must be contiguous");
  torch::Tensor mk;
  const bool* mp = nullptr;
  if (mask.has_value()) {
    mk = mask->to(torch::kBool).contiguous();
    TORCH_CHECK(mk.dim() == 2 && mk.size(0) == n && mk.size(1) == n, "cache_attention: mask must be [n, n]");
    mp = mk.data_ptr<bool>();
  }
  constexpr int64_t kChunk = 512;
  const int64_t chunks = (length + kChunk - 1) / kChunk, tasks = hkv * chunks;
  std::vector<float> m(tasks * R), l(tasks * R), o(tasks * R * D);
  const float* qp = q.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t ksh = k_cache.stride(0), vsh = v_cache.stride(0);
  at::parallel_for(0, tasks, 1, [&](int64_t a, int64_t e) {
    std::vector<float> s(R * kChunk);
    for (int64_t task = a; task < e; task++) {
      const int64_t kv = task / chunks, lo = (task % chunks) * kChunk, len = std::min(length, lo + kChunk) - lo;
      const float* Q = qp + kv * R * D;
      const float* K = kc + kv * ksh + lo * D;
      const float* Vv = vc + kv * vsh + lo * D;
      float *mt = m.data() + task * R, *lt = l.data() + task * R, *ot = o.data() + task * R * D;
      const float sc = static_cast<float>(scale);
      if (mp)
        attend_chunk(Q, K, Vv, R, D, len, sc, n, start - lo, [&](int64_t i, int64_t t) { return mp[i * n + t]; },
                     s.data(), mt, lt, ot);
      else
        attend_chunk(Q, K, Vv, R, D, len, sc, n, start - lo, [](int64_t i, int64_t t) { return t <= i; }, s.data(),
                     mt, lt, ot);
    }
  });
  auto y = torch::empty({n, H * D}, q.options());
  float* yp = y.data_ptr<float>();
  for (int64_t kv = 0; kv < hkv; kv++)
    for (int64_t r = 0; r < R; r++) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; c++) mx = std::max(mx, m[(kv * chunks + c) * R + r]);
      float total = 0.0f;
      float* out = yp + (r % n) * H * D + (kv * g + r / n) * D;  // row r = (head kv * g + r / n, token r % n)
      std::fill(out, out + D, 0.0f);
      for (int64_t c = 0; c < chunks; c++) {
        const int64_t t = (kv * chunks + c) * R + r;
        if (l[t] == 0.0f) continue;
        const float w = std::exp(m[t] - mx);
        total += l[t] * w;
        const float* part = o.data() + t * D;
        for (int64_t d = 0; d < D; d++) out[d] += w * part[d];
      }
      TORCH_CHECK(total > 0.0f, "cache_attention: a query row sees no key (a mask row without its own token?)");
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < D; d++) out[d] *= inv;
    }
  return y;
}

// x [M, K] @ w[N, K]^T (+ bias) for 1 to 64 rows (a decode step, a verify pass): the weights are read from memory
// once, kRowBlock rows at a time, and each block meets the x rows in groups of up to kGroup, R weight rows by the
// group's rows in registers. Every output is one 16-lane multiply-add chain over k in order, a fixed reduction of the
// lanes, then the K % 16 tail and the bias: the same sums in the same order whatever M, the group or the tile, so a
// verify pass of up to 64 rows equals a decode step bit for bit.
constexpr int64_t kRowsMax = 64;  // x rows per call
constexpr int kGroup = 8;         // x rows per register tile
constexpr int64_t kRowBlock = 24;  // weight rows per block: a multiple of every tile's R, so only N's end has a tail

// R, the weight rows of a tile with M x rows: R * M accumulators (AVX-512: at most 24 of the 32 registers)
template <int M>
constexpr int tile_rows() {
#if defined(__AVX512F__)
  return M <= 3 ? 8 : (M == 4 ? 6 : (M <= 6 ? 4 : 3));
#else
  return M == 1 ? 4 : (M <= 3 ? 2 : 1);
#endif
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
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const float* w0 = w + n * K;
#if defined(__AVX512F__)
    __m512 acc[R][M];
    for (int r = 0; r < R; r++)
      for (int mm = 0; mm < M; mm++) acc[r][mm] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += V) {
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
        for (int64_t k = K16; k < K; k++) s += w0[r * K + k] * x[mm * K + k];
        y[mm * N + n + r] = s + (b ? b[n + r] : 0.0f);
      }
#else
    float acc[R][M][V] = {};
    for (int64_t k = 0; k < K16; k += V)
      for (int r = 0; r < R; r++) {
        const float* wr = w0 + r * K + k;
        for (int mm = 0; mm < M; mm++) {
          const float* xm = x + mm * K + k;
          for (int j = 0; j < V; j++) acc[r][mm][j] += wr[j] * xm[j];
        }
      }
    for (int r = 0; r < R; r++)
      for (int mm = 0; mm < M; mm++) {
        float* a = acc[r][mm];
        for (int h = V / 2; h > 0; h /= 2)
          for (int j = 0; j < h; j++) a[j] += a[j + h];
        float s = a[0];
        for (int64_t k = K16; k < K; k++) s += w0[r * K + k] * x[mm * K + k];
        y[mm * N + n + r] = s + (b ? b[n + r] : 0.0f);
      }
#endif
  }
  if constexpr (R > 1) rows_tile<M, 1>(x, w, b, y, N, K, n, n1);
}

using RowsTileFn = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr RowsTileFn kRowsTiles[kGroup] = {  // [m - 1]: the tile for a group of m x rows
    rows_tile<1, tile_rows<1>()>, rows_tile<2, tile_rows<2>()>, rows_tile<3, tile_rows<3>()>,
    rows_tile<4, tile_rows<4>()>, rows_tile<5, tile_rows<5>()>, rows_tile<6, tile_rows<6>()>,
    rows_tile<7, tile_rows<7>()>, rows_tile<8, tile_rows<8>()>};

torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(w.is_contiguous(), "rows_linear: weight must be contiguous");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2, "rows_linear: x [..., K] and a weight [N, K]");
  const int64_t K = x.size(-1), M = x.numel() ? x.numel() / K : 0, N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "rows_linear: x has ", K, " features, the weight ", w.size(1));
  TORCH_CHECK(M <= kRowsMax, "rows_linear: at most ", kRowsMax, " rows, got ", M);
  x = x.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  if (M == 0) return y;
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    check_f32(b, "bias");
    TORCH_CHECK(b.numel() == N, "rows_linear: bias has ", b.numel(), " entries for ", N, " outputs");
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock, groups = (M + kGroup - 1) / kGroup;
  // a thread takes at least ~150 weight rows for one group of x rows (fewer as the groups add work per row)
  at::parallel_for(0, blocks, std::max<int64_t>(1, 6 / groups), [&](int64_t a, int64_t e) {
    for (int64_t blk = a; blk < e; blk++) {
      const int64_t n0 = blk * kRowBlock, n1 = std::min(N, n0 + kRowBlock);
      for (int64_t g = 0, m0 = 0; g < groups; g++) {  // the block is read from memory once, then from the cache
        const int64_t m = (M - m0 + groups - g - 1) / (groups - g);  // groups of even size: 17 rows as 6, 6, 5
        kRowsTiles[m - 1](xp + m0 * K, wp, bp, yp + m0 * N, N, K, n0, n1);
        m0 += m;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope_write", &rope_write);
  m.def("cache_attention", &cache_attention);
  m.def("rows_linear", &rows_linear);
}
