// Attention around the paged KV cache on a CPU, in two calls a layer instead of ~15 ops.
//
// After a layer's q|k|v projection (one GEMM), the rest of its attention is small work spread
// over many tensors: RoPE on q and k, k and v scattered into the cache, each decode sequence's
// context read back and multiplied by its query heads. As Paddle ops that is ~15 launches a
// layer, each reading and writing whole tensors, and at 32 decode sequences it took as long as
// the layer's GEMMs (bench/README.md, "Attention in one call"). Here:
//
// - attn_rope_store: for every row, RoPE on q and k, k and v into the cache at the row's slot,
//   q (rotated) into q_out, in one pass over the projection's output.
// - attn_decode: for each query (a decode's, or a prefill chunk token's), each KV head's g query
//   heads against its sequence's first keys, read in place from its blocks: scores, softmax, the
//   weighted sum of V. One task per (query, KV head); a task reads only its own sequence, in a
//   fixed order, so a query's output does not depend on the rest of the batch or on the threads.
//
// The cache is fd's head-major layout (fd/engine/model/llama.py, allocate_kv_cache): row
// ``h * num_slots + slot`` holds KV head h of a slot, a slot being ``block * block_size + i``.
// RoPE is the model's: ``x * cos + roll(x, hd / 2) * sin`` with the rotation's sign folded into
// the sin table, a row of ``rope`` being [cos(hd) | sin(hd)] of a position. q arrives already
// scaled by 1/sqrt(hd) (folded into its weights).
//
// Written in AVX2 and FMA (every x86 CPU of the last decade has them; AVX-512 runs it too):
// head_dim a multiple of 8. A score is a query head's dot with a key, 8 keys at a time and
// summed across in one go; the exponential is a polynomial, 8 at a time.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "exp.h"

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// the 8 sums of 8 vectors, as one vector
static inline __m256 hsum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float dot(const float* a, const float* b, int hd) {
  __m256 acc = _mm256_setzero_ps();
  for (int d = 0; d < hd; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return hsum8(acc);
}

// qkv [rows, stride]: q (nh heads), k, v (kvh heads each) of hd floats, in that order.
// rope [P, 2 * hd]; positions, slots [rows]; kc, vc [kvh * num_slots, hd]; q_out [rows, nh * hd].
extern "C" void attn_rope_store(const float* qkv, int64_t rows, int64_t stride, int nh, int kvh, int hd,
                                const float* rope, const int64_t* positions, const int64_t* slots, float* kc,
                                float* vc, int64_t num_slots, float* q_out, int nt) {
  const int half = hd / 2;
#pragma omp parallel for num_threads(nt) if (rows >= 64)
  for (int64_t r = 0; r < rows; r++) {
    const float* x = qkv + r * stride;
    const float* cs = rope + positions[r] * 2 * hd;
    const float* sn = cs + hd;
    const int64_t slot = slots[r];
    for (int h = 0; h < nh + kvh; h++) {
      const float* a = x + h * hd;
      float* o = h < nh ? q_out + r * (int64_t)nh * hd + h * hd : kc + ((h - nh) * num_slots + slot) * hd;
#pragma omp simd
      for (int d = 0; d < half; d++) o[d] = a[d] * cs[d] + a[d + half] * sn[d];
#pragma omp simd
      for (int d = half; d < hd; d++) o[d] = a[d] * cs[d] + a[d - half] * sn[d];
    }
    const float* v = x + (nh + kvh) * hd;
    for (int h = 0; h < kvh; h++) memcpy(vc + (h * num_slots + slot) * hd, v + h * hd, hd * sizeof(float));
  }
}

// q [*, nh * hd] (row q_rows[s] is query s); tables [S, nb] its sequence's blocks; lens [S] its
// context length (its position + 1, its own key included); window > 0: only the last ``window``
// keys. out [S, nh * hd]. hd % 8 == 0.
extern "C" void attn_decode(const float* q, const int64_t* q_rows, int64_t S, int nh, int kvh, int hd,
                            const float* kc, const float* vc, int64_t num_slots, int block_size,
                            const int64_t* tables, int64_t nb, const int64_t* lens, int64_t window, float* out,
                            int nt) {
  const int g = nh / kvh;
#pragma omp parallel for schedule(static) num_threads(nt) if (S * kvh > 1)
  for (int64_t task = 0; task < S * kvh; task++) {
    const int64_t s = task / kvh;
    const int h = (int)(task % kvh);
    const int64_t len = lens[s];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t L = len - first;
    const int64_t Lp = (L + 7) & ~7;
    static thread_local std::vector<float> buf;
    static thread_local std::vector<const float*> at;
    if ((int64_t)buf.size() < g * Lp) buf.resize(g * Lp);
    if ((int64_t)at.size() < 2 * L) at.resize(2 * L);
    float* sc = buf.data();  // [g, Lp]
    const float** ks = at.data();
    const float** vs = ks + L;
    const int64_t* bt = tables + s * nb;
    const float* kh = kc + (int64_t)h * num_slots * hd;
    const float* vh = vc + (int64_t)h * num_slots * hd;
    for (int64_t j = 0; j < L; j++) {
      const int64_t p = first + j;
      const int64_t row = (bt[p / block_size] * block_size + p % block_size) * hd;
      ks[j] = kh + row;
      vs[j] = vh + row;
    }
    const float* qh = q + q_rows[s] * (int64_t)nh * hd + (int64_t)h * g * hd;
    for (int i = 0; i < g; i++) {
      const float* qi = qh + i * hd;
      float* si = sc + i * Lp;
      int64_t j = 0;
      for (; j + 8 <= L; j += 8) {
        __m256 acc[8];
        for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qi + d);
          for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(ks[j + u] + d), acc[u]);
        }
        _mm256_storeu_ps(si + j, hsum8x8(acc));
      }
      for (; j < L; j++) si[j] = dot(qi, ks[j], hd);
      // softmax over the L scores (the padding up to Lp: e^-inf, 0)
      float m = si[0];
      for (int64_t t = 1; t < L; t++) m = std::max(m, si[t]);
      for (int64_t t = L; t < Lp; t++) si[t] = -INFINITY;
      const __m256 mv = _mm256_set1_ps(m);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t t = 0; t < Lp; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(si + t), mv));
        _mm256_storeu_ps(si + t, e);
        sum = _mm256_add_ps(sum, e);
      }
      const float inv = 1.0f / hsum8(sum);
      // the weighted sum of V, 32 of hd at a time in registers
      float* oi = out + s * (int64_t)nh * hd + ((int64_t)h * g + i) * hd;
      for (int d0 = 0; d0 < hd; d0 += 32) {
        const int w = std::min(32, hd - d0) / 8;
        __m256 o[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t t = 0; t < L; t++) {
          const __m256 pw = _mm256_set1_ps(si[t]);
          const float* v = vs[t] + d0;
          for (int u = 0; u < w; u++) o[u] = _mm256_fmadd_ps(pw, _mm256_loadu_ps(v + 8 * u), o[u]);
        }
        const __m256 iv = _mm256_set1_ps(inv);
        for (int u = 0; u < w; u++) _mm256_storeu_ps(oi + d0 + 8 * u, _mm256_mul_ps(o[u], iv));
      }
    }
  }
}
