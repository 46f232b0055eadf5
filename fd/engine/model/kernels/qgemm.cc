// Quantized GEMMs for the CPU: Y[M, N] = X[M, K] @ W[K, N], W held in fewer bytes.
//
// A decode step reads every weight once and does little else with it, so its time is the
// weights' bytes over the memory bandwidth. These kernels read W in the layout they compute
// in, prepared once at load:
//
// - q8: GGUF's Q8_0 idea (blocks of 32 weights along K, one scale each) with the activations
//   quantized the same way at each call (as llama.cpp does), and the products summed in int32
//   by AVX512-VNNI (vpdpbusd). 1.125 bytes a weight (32 int8 + an fp16 scale + an int16 sum).
// - bf16: the weights in bfloat16, products in float by AVX512-BF16 (vdpbf16ps). 2 bytes.
//
// Layout, both: N in tiles of 16 columns (one zmm of results). For q8, within a tile each block
// of 32 rows of W is 8 groups of 64 bytes, a group being 4 consecutive k of each of the 16
// columns (what one vpdpbusd multiplies by a broadcast 4 bytes of X). For bf16, pairs of k of
// the 16 columns (one vdpbf16ps). Every tile is independent: the threads split the tiles.
//
// The file is compiled once per format and ISA (fd/engine/model/qgemm.py) with that ISA's flags,
// each part guarded by its macro: no library holds an instruction that the CPU check before
// loading it did not allow. The integer formats have a second build for AVX2 CPUs without VNNI
// (-DFD_AVX2: the same packed layouts, vpmaddubsw for vpdpbusd); bf16 needs AVX512-BF16.
//
// vpdpbusd multiplies unsigned by signed bytes: X's quantized values go in with 128 added, and
// 128 times each block's weight sum (kept beside its scale) comes off again.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "exp.h"

// Each calling thread's scratch for X in the kernels' form, grown as needed (the engine calls
// from one step thread; the buffer lives as long as it does).
static uint8_t* scratch(size_t bytes) {
  static thread_local std::vector<uint8_t> buf;
  if (buf.size() < bytes) buf.resize(bytes);
  return buf.data();
}

#ifdef __AVX512F__
// SwiGLU, silu(gate) * up, of X2 [M, 2K] (gate | up: the gate|up GEMM's output as it lies) into
// this thread's buffer [M, K], K % 16 == 0: the down GEMMs take their input from it, so the MLP's
// activation is no separate op.
static const float* swiglu_rows(const float* X2, int M, int K) {
  static thread_local std::vector<float> buf;
  if (buf.size() < (size_t)M * K) buf.resize((size_t)M * K);
  for (int m = 0; m < M; m++) {
    const float* g = X2 + (int64_t)m * 2 * K;
    float* y = buf.data() + (int64_t)m * K;
    for (int k = 0; k < K; k += 16) {
      const __m512 gv = _mm512_loadu_ps(g + k);
      const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      _mm512_storeu_ps(y + k, _mm512_mul_ps(silu, _mm512_loadu_ps(g + K + k)));
    }
  }
  return buf.data();
}

#else
static const float* swiglu_rows(const float* X2, int M, int K) {
  static thread_local std::vector<float> buf;
  if (buf.size() < (size_t)M * K) buf.resize((size_t)M * K);
  for (int m = 0; m < M; m++) {
    const float* g = X2 + (int64_t)m * 2 * K;
    float* y = buf.data() + (int64_t)m * K;
    for (int k = 0; k < K; k += 8) {
      const __m256 gv = _mm256_loadu_ps(g + k);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
      _mm256_storeu_ps(y + k, _mm256_mul_ps(silu, _mm256_loadu_ps(g + K + k)));
    }
  }
  return buf.data();
}

#endif

// RMSNorm of X's rows after the residual add, as the model's layers begin and its MLPs do:
// S = X + R into S (R null: S = X, the first layer's), and S * rsqrt(mean(S^2) + eps) * w into
// this thread's buffer [M, K], which the GEMM after it takes as its input: the norm is no
// separate op. Plain loops the compiler vectorizes for either ISA.
static const float* norm_rows(const float* X, const float* R, const float* w, float eps, int M, int K, float* S) {
  static thread_local std::vector<float> buf;
  if (buf.size() < (size_t)M * K) buf.resize((size_t)M * K);
  for (int m = 0; m < M; m++) {
    const float* x = X + (int64_t)m * K;
    const float* r = R ? R + (int64_t)m * K : nullptr;
    float* s = S + (int64_t)m * K;
    float ss = 0.f;
    if (r) {
#pragma omp simd reduction(+ : ss)
      for (int k = 0; k < K; k++) {
        s[k] = x[k] + r[k];
        ss += s[k] * s[k];
      }
    } else {
#pragma omp simd reduction(+ : ss)
      for (int k = 0; k < K; k++) {
        s[k] = x[k];
        ss += s[k] * s[k];
      }
    }
    const float inv = 1.0f / std::sqrt(ss / (float)K + eps);
    float* y = buf.data() + (int64_t)m * K;
#pragma omp simd
    for (int k = 0; k < K; k++) y[k] = s[k] * inv * w[k];
  }
  return buf.data();
}

#if defined(__AVX512VNNI__) || defined(FD_AVX2)
// --- q8 ---------------------------------------------------------------------------------

static inline uint16_t f32_to_f16(float f) { return _cvtss_sh(f, 0); }

// Bytes the packed form of a [K, N] weight takes: quants, fp16 scales, int16 sums.
extern "C" int64_t q8_packed_bytes(int K, int N) {
  int64_t blocks = (int64_t)(K / 32) * N;
  return blocks * 32 + blocks * 2 + blocks * 2;
}

// W row-major [K, N], K % 32 == 0, N % 16 == 0. out: q8_packed_bytes(K, N) bytes.
extern "C" void q8_pack(const float* W, int K, int N, uint8_t* out, int nt) {
  const int KB = K / 32, T = N / 16;
  int8_t* q = (int8_t*)out;
  uint16_t* d = (uint16_t*)(out + (int64_t)KB * N * 32);
  int16_t* s = (int16_t*)(out + (int64_t)KB * N * 34);
#pragma omp parallel for num_threads(nt)
  for (int t = 0; t < T; t++) {
    for (int b = 0; b < KB; b++) {
      for (int c = 0; c < 16; c++) {
        const int n = t * 16 + c;
        float amax = 0.f;
        for (int k = 0; k < 32; k++) amax = std::max(amax, std::fabs(W[(int64_t)(b * 32 + k) * N + n]));
        // the scale is stored in fp16: quantize with the value stored, so the two agree
        const uint16_t dh = f32_to_f16(amax / 127.f);
        const float dv = _cvtsh_ss(dh);
        const float id = dv > 0.f ? 1.f / dv : 0.f;
        int sum = 0;
        for (int k = 0; k < 32; k++) {
          int v = (int)std::nearbyint(W[(int64_t)(b * 32 + k) * N + n] * id);
          v = std::min(127, std::max(-127, v));
          sum += v;
          const int g = k / 4, j = k % 4;
          q[(((int64_t)t * KB + b) * 8 + g) * 64 + c * 4 + j] = (int8_t)v;
        }
        d[((int64_t)t * KB + b) * 16 + c] = dh;
        s[((int64_t)t * KB + b) * 16 + c] = (int16_t)sum;
      }
    }
  }
}

#ifdef __AVX512VNNI__
// One block of 32 of X quantized: its scale, and its values (+ 128 where `offset`: q8's unsigned
// operand) into `out`; returns the values' sum (q4's m term).
static inline int quantize_block(const float* x, uint8_t* out, float* d_out, bool offset) {
  const __m512 a = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x)), _mm512_abs_ps(_mm512_loadu_ps(x + 16)));
  const float d = _mm512_reduce_max_ps(a) / 127.f;
  const __m512 vid = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
  int sum = 0;
  for (int h = 0; h < 2; h++) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + h * 16), vid));  // nearest even
    sum += _mm512_reduce_add_epi32(v);
    if (offset)
      _mm_storeu_si128((__m128i*)(out + h * 16), _mm512_cvtusepi32_epi8(_mm512_add_epi32(v, _mm512_set1_epi32(128))));
    else
      _mm_storeu_si128((__m128i*)(out + h * 16), _mm512_cvtsepi32_epi8(v));
  }
  *d_out = d;
  return sum;
}

// vpdpbusd takes X unsigned: + 128 (and 128 times the weights' sum off again)
static constexpr bool Q8_OFFSET = true;

template <int R>
static inline void q8_tile_rows(const uint8_t* packed, int K, int N, int t, const uint8_t* xq, const float* dx,
                                int m0, float* Y) {
  const int KB = K / 32;
  const int8_t* q = (const int8_t*)packed;
  const uint16_t* d = (const uint16_t*)(packed + (int64_t)KB * N * 32);
  const int16_t* s = (const int16_t*)(packed + (int64_t)KB * N * 34);
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < KB; b++) {
    const int8_t* qb = q + ((int64_t)t * KB + b) * 512;
    __m512i w[8];
    for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512((const void*)(qb + g * 64));
    const int64_t sb = ((int64_t)t * KB + b) * 16;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d + sb)));
    const __m512i off =
        _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i*)(s + sb))), 7);
    for (int r = 0; r < R; r++) {
      const uint8_t* xr = xq + (int64_t)(m0 + r) * K + b * 32;
      __m512i i = _mm512_setzero_si512();
      for (int g = 0; g < 8; g++) {
        int32_t x4;
        memcpy(&x4, xr + g * 4, 4);
        i = _mm512_dpbusd_epi32(i, _mm512_set1_epi32(x4), w[g]);
      }
      i = _mm512_sub_epi32(i, off);
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[(m0 + r) * KB + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), scale, acc[r]);
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(Y + (int64_t)(m0 + r) * N + t * 16, acc[r]);
}

template <int R>
static inline void q4_tile_rows(const uint8_t* packed, int K, int N, int t, const int8_t* xq, const float* dx,
                                const float* sx, int m0, float* Y) {
  const int KB = K / 32;
  const uint16_t* dm = (const uint16_t*)(packed + (int64_t)KB * N * 16);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < KB; b++) {
    const uint8_t* qb = packed + ((int64_t)t * KB + b) * 256;
    __m512i w[8];
    for (int j = 0; j < 4; j++) {
      const __m512i v = _mm512_loadu_si512((const void*)(qb + j * 64));
      w[2 * j] = _mm512_and_si512(v, low);
      w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const uint16_t* db = dm + ((int64_t)t * KB + b) * 32;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)db));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(db + 16)));
    for (int r = 0; r < R; r++) {
      const int8_t* xr = xq + (int64_t)(m0 + r) * K + b * 32;
      __m512i i = _mm512_setzero_si512();
      for (int g = 0; g < 8; g++) {
        int32_t x4;
        memcpy(&x4, xr + g * 4, 4);
        i = _mm512_dpbusd_epi32(i, w[g], _mm512_set1_epi32(x4));
      }
      const int64_t rb = (int64_t)(m0 + r) * KB + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dw, _mm512_set1_ps(dx[rb])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[rb]), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(Y + (int64_t)(m0 + r) * N + t * 16, acc[r]);
}

#else
// --- AVX2 (no VNNI): vpmaddubsw multiplies unsigned by signed bytes into int16 pairs, vpmaddwd
// sums the pairs' pairs into int32. q8 takes X signed (no offset) and each weight's sign onto X's
// byte (|w| by sign(x, w): a pair is at most 2 * 127 * 127, inside int16); q4's q is unsigned
// already (2 * 15 * 127). The packed layouts are the AVX-512 ones: a group's 64 bytes are two
// halves of 8 columns, each one ymm.

static inline int quantize_block(const float* x, uint8_t* out, float* d_out, bool offset) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], a = _mm256_setzero_ps();
  for (int h = 0; h < 4; h++) {
    v[h] = _mm256_loadu_ps(x + h * 8);
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[h]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.f;
  const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i q[4];
  for (int h = 0; h < 4; h++) q[h] = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], id));  // nearest even
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  if (offset)
    for (int h = 0; h < 4; h++) q[h] = _mm256_add_epi32(q[h], _mm256_set1_epi32(128));
  // 32 int32 -> 32 bytes in order (the packs interleave 128-bit lanes; the permute undoes it)
  const __m256i w0 = _mm256_packs_epi32(q[0], q[1]), w1 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i p = offset ? _mm256_packus_epi16(w0, w1) : _mm256_packs_epi16(w0, w1);
  _mm256_storeu_si256((__m256i*)out, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d_out = d;
  return _mm_cvtsi128_si32(s4);
}

// AVX2's q8 takes X signed (the weights' signs go onto X's bytes: dot4)
static constexpr bool Q8_OFFSET = false;

static inline __m256i dot4(__m256i w, int32_t x4) {  // int32 lanes: w's 4 bytes a column . x4 (q8)
  const __m256i xb = _mm256_set1_epi32(x4);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xb, w)),
                           _mm256_set1_epi16(1));
}

template <int R>
static inline void q8_tile_rows(const uint8_t* packed, int K, int N, int t, const uint8_t* xq, const float* dx,
                                int m0, float* Y) {
  const int KB = K / 32;
  const int8_t* q = (const int8_t*)packed;
  const uint16_t* d = (const uint16_t*)(packed + (int64_t)KB * N * 32);
  for (int h = 0; h < 2; h++) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < KB; b++) {
      const int8_t* qb = q + ((int64_t)t * KB + b) * 512 + h * 32;
      __m256i w[8];
      for (int g = 0; g < 8; g++) w[g] = _mm256_loadu_si256((const __m256i*)(qb + g * 64));
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d + ((int64_t)t * KB + b) * 16 + h * 8)));
      for (int r = 0; r < R; r++) {
        const int8_t* xr = (const int8_t*)xq + (int64_t)(m0 + r) * K + b * 32;
        __m256i i = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {
          int32_t x4;
          memcpy(&x4, xr + g * 4, 4);
          i = _mm256_add_epi32(i, dot4(w[g], x4));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(dw, _mm256_set1_ps(dx[(m0 + r) * KB + b])), acc[r]);
      }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + (int64_t)(m0 + r) * N + t * 16 + h * 8, acc[r]);
  }
}

template <int R>
static inline void q4_tile_rows(const uint8_t* packed, int K, int N, int t, const int8_t* xq, const float* dx,
                                const float* sx, int m0, float* Y) {
  const int KB = K / 32;
  const uint16_t* dm = (const uint16_t*)(packed + (int64_t)KB * N * 16);
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; h++) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < KB; b++) {
      const uint8_t* qb = packed + ((int64_t)t * KB + b) * 256 + h * 32;
      __m256i w[8];
      for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qb + j * 64));
        w[2 * j] = _mm256_and_si256(v, low);
        w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const uint16_t* db = dm + ((int64_t)t * KB + b) * 32 + h * 8;
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)db));
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(db + 16)));
      for (int r = 0; r < R; r++) {
        const int8_t* xr = xq + (int64_t)(m0 + r) * K + b * 32;
        // a pair of q * x is at most 2 * 15 * 127 = 3,810 and the block's eight groups' sum
        // 30,480: the sums stay in int16, and one vpmaddwd a block widens them
        __m256i p = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {
          int32_t x4;
          memcpy(&x4, xr + g * 4, 4);
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(x4)));
        }
        const __m256i i = _mm256_madd_epi16(p, ones);
        const int64_t rb = (int64_t)(m0 + r) * KB + b;
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(dw, _mm256_set1_ps(dx[rb])), acc[r]);
        acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[rb]), acc[r]);
      }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(Y + (int64_t)(m0 + r) * N + t * 16 + h * 8, acc[r]);
  }
}

#endif

// X row-major [M, K] -> xq [M, K] (+ 128 where Q8_OFFSET) and dx [M, K/32] (each block's scale).
static void q8_quantize_rows(const float* X, int M, int K, uint8_t* xq, float* dx, int nt) {
  const int KB = K / 32;
#pragma omp parallel for num_threads(nt) if (M >= 64)
  for (int m = 0; m < M; m++)
    for (int b = 0; b < KB; b++)
      quantize_block(X + (int64_t)m * K + b * 32, xq + (int64_t)m * K + b * 32, dx + m * KB + b, Q8_OFFSET);
}

// X row-major [M, K] -> xq [M, K] signed bytes, dx [M, K/32] each block's scale, and sx [M, K/32]
// each block's scale times its sum of xq (what m multiplies).
static void q4_quantize_rows(const float* X, int M, int K, int8_t* xq, float* dx, float* sx, int nt) {
  const int KB = K / 32;
#pragma omp parallel for num_threads(nt) if (M >= 64)
  for (int m = 0; m < M; m++)
    for (int b = 0; b < KB; b++) {
      const int64_t rb = (int64_t)m * KB + b;
      const int sum = quantize_block(X + (int64_t)m * K + b * 32, (uint8_t*)xq + (int64_t)m * K + b * 32, dx + rb, false);
      sx[rb] = dx[rb] * (float)sum;
    }
}

// Y [M, N] = X [M, K] @ W, W packed by q8_pack; on `nt` threads.
extern "C" void q8_gemm(const float* X, int M, int K, const uint8_t* packed, int N, float* Y, int nt) {
  uint8_t* xq = scratch((size_t)M * K + (size_t)M * (K / 32) * 4);
  float* dx = (float*)(xq + (int64_t)M * K);
  q8_quantize_rows(X, M, K, xq, dx, nt);
  const int T = N / 16;
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int t = 0; t < T; t++) {
    int m = 0;
    for (; m + 4 <= M; m += 4) q8_tile_rows<4>(packed, K, N, t, xq, dx, m, Y);
    for (; m < M; m++) q8_tile_rows<1>(packed, K, N, t, xq, dx, m, Y);
  }
}

// --- q4 ---------------------------------------------------------------------------------
// GGUF's Q4_1 and Q4_0 (d * (q - 8): m = -8 d, d negative where the largest magnitude is above
// zero): w = d * q + m, q in 0..15, d and m fp16 per block of 32 along K: 0.625 bytes a weight,
// the file's own. (Q4_K's sub-blocks are d * q + m too, but their scales, fp16 times 6 bits, are
// not fp16: int8 holds those.) Packed only where that is exact
// (q4_pack's error; a weight quantized otherwise stays 8-bit, fd/engine/model/qgemm.py).
// Within a tile's block, 4 loads of 64 bytes: load j's low nibbles are group 2j (4 k of the 16
// columns, vpdpbusd's layout), its high nibbles group 2j + 1. vpdpbusd multiplies the unsigned
// q by X quantized to signed bytes (no offset), and m comes back in as m * dx * sum(xq).

extern "C" int64_t q4_packed_bytes(int K, int N) {
  int64_t blocks = (int64_t)(K / 32) * N;
  return blocks * 16 + blocks * 4;
}

// W row-major [K, N], K % 32 == 0, N % 16 == 0; returns the largest |d * q + m - w| over the
// weights, as a share of its block's d (0 where exact but for float rounding).
extern "C" float q4_pack(const float* W, int K, int N, uint8_t* out, int nt) {
  const int KB = K / 32, T = N / 16;
  uint8_t* q = out;
  uint16_t* dm = (uint16_t*)(out + (int64_t)KB * N * 16);
  float worst = 0.f;
#pragma omp parallel for num_threads(nt) reduction(max : worst)
  for (int t = 0; t < T; t++) {
    for (int b = 0; b < KB; b++) {
      uint8_t* qb = q + ((int64_t)t * KB + b) * 256;
      uint16_t* d16 = dm + ((int64_t)t * KB + b) * 32;
      memset(qb, 0, 256);
      for (int c = 0; c < 16; c++) {
        const int64_t n = t * 16 + c;
        float lo = INFINITY, hi = -INFINITY;
        for (int k = 0; k < 32; k++) {
          const float w = W[(int64_t)(b * 32 + k) * N + n];
          lo = std::min(lo, w);
          hi = std::max(hi, w);
        }
        // The block's grid, the one its values lie on: Q4_1's (its 0 and 15 are the block's min
        // and max), else Q4_0's, d (q - 8) with the largest magnitude at q = 0, -8 d: below zero,
        // or above it with d negative (m = -8 d either way, exact in fp16).
        const float amax = std::max(-lo, hi);
        float best = INFINITY, d = 0.f, m = 0.f;
        for (int c2 = 0; c2 < 3; c2++) {
          const float dc = _cvtsh_ss(f32_to_f16(c2 == 0 ? (hi - lo) / 15.f : (c2 == 1 ? amax : -amax) / 8.f));
          const float mc = c2 == 0 ? _cvtsh_ss(f32_to_f16(lo)) : -8.f * dc;
          const float idc = dc != 0.f ? 1.f / dc : 0.f;
          float e = 0.f;
          for (int k = 0; k < 32; k++) {
            const float w = W[(int64_t)(b * 32 + k) * N + n];
            const int v = std::min(15, std::max(0, (int)std::nearbyint((w - mc) * idc)));
            e = std::max(e, std::fabs(dc * v + mc - w) / (dc != 0.f ? std::fabs(dc) : 1.f));
          }
          if (e < best) best = e, d = dc, m = mc;
        }
        d16[c] = f32_to_f16(d);
        d16[16 + c] = f32_to_f16(m);
        const float id = d != 0.f ? 1.f / d : 0.f;
        worst = std::max(worst, best);
        for (int k = 0; k < 32; k++) {
          const float w = W[(int64_t)(b * 32 + k) * N + n];
          const int v = std::min(15, std::max(0, (int)std::nearbyint((w - m) * id)));
          const int g = k / 4, j = g / 2;  // group g's values: load j's low or high nibbles
          qb[j * 64 + c * 4 + k % 4] |= (uint8_t)(v << ((g % 2) * 4));
        }
      }
    }
  }
  return worst;
}

// Y [M, N] = X [M, K] @ W, W packed by q4_pack; on `nt` threads.
extern "C" void q4_gemm(const float* X, int M, int K, const uint8_t* packed, int N, float* Y, int nt) {
  const int KB = K / 32;
  int8_t* xq = (int8_t*)scratch((size_t)M * K + (size_t)M * KB * 8);
  float* dx = (float*)(xq + (int64_t)M * K);
  float* sx = dx + (int64_t)M * KB;
  q4_quantize_rows(X, M, K, xq, dx, sx, nt);
  const int T = N / 16;
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int t = 0; t < T; t++) {
    int m = 0;
    for (; m + 4 <= M; m += 4) q4_tile_rows<4>(packed, K, N, t, xq, dx, sx, m, Y);
    for (; m < M; m++) q4_tile_rows<1>(packed, K, N, t, xq, dx, sx, m, Y);
  }
}

extern "C" void q4_gemm_swiglu(const float* X2, int M, int K, const uint8_t* packed, int N, float* Y, int nt) {
  q4_gemm(swiglu_rows(X2, M, K), M, K, packed, N, Y, nt);
}

// Y [M, N] = swiglu(X2) @ W: X2 [M, 2K] the MLP's gate | up (swiglu_rows).
extern "C" void q8_gemm_swiglu(const float* X2, int M, int K, const uint8_t* packed, int N, float* Y, int nt) {
  q8_gemm(swiglu_rows(X2, M, K), M, K, packed, N, Y, nt);
}

// Y [M, N] = rmsnorm(X + R) * w @ W, X + R into S (norm_rows).
extern "C" void q8_gemm_norm(const float* X, const float* R, const float* w, float eps, int M, int K,
                             const uint8_t* packed, int N, float* Y, float* S, int nt) {
  q8_gemm(norm_rows(X, R, w, eps, M, K, S), M, K, packed, N, Y, nt);
}

extern "C" void q4_gemm_norm(const float* X, const float* R, const float* w, float eps, int M, int K,
                             const uint8_t* packed, int N, float* Y, float* S, int nt) {
  q4_gemm(norm_rows(X, R, w, eps, M, K, S), M, K, packed, N, Y, nt);
}

#endif  // __AVX512VNNI__ || FD_AVX2

#ifdef __AVX512BF16__
// --- bf16 -------------------------------------------------------------------------------

extern "C" int64_t bf16_packed_bytes(int K, int N) { return (int64_t)K * N * 2; }

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
  return (uint16_t)(u >> 16);
}

// W row-major [K, N], K % 2 == 0, N % 16 == 0.
extern "C" void bf16_pack(const float* W, int K, int N, uint8_t* out, int nt) {
  uint16_t* o = (uint16_t*)out;
  const int T = N / 16, KP = K / 2;
#pragma omp parallel for num_threads(nt)
  for (int t = 0; t < T; t++)
    for (int p = 0; p < KP; p++)
      for (int c = 0; c < 16; c++)
        for (int j = 0; j < 2; j++)
          o[(((int64_t)t * KP + p) * 16 + c) * 2 + j] = f32_to_bf16(W[(int64_t)(p * 2 + j) * N + t * 16 + c]);
}

template <int R>
static inline void bf16_tile_rows(const uint16_t* w, int K, int N, int t, const uint32_t* xb, int m0, float* Y) {
  const int KP = K / 2;
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  const uint16_t* wt = w + (int64_t)t * KP * 32;
  for (int p = 0; p < KP; p++) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(wt + p * 32));
    for (int r = 0; r < R; r++)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(xb[(int64_t)(m0 + r) * KP + p]), wv);
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(Y + (int64_t)(m0 + r) * N + t * 16, acc[r]);
}

// Y [M, N] = X [M, K] @ W, W packed by bf16_pack; on `nt` threads.
extern "C" void bf16_gemm(const float* X, int M, int K, const uint8_t* packed, int N, float* Y, int nt) {
  uint16_t* xb = (uint16_t*)scratch((size_t)M * K * 2);
  const int64_t total = (int64_t)M * K;
  int64_t i = 0;
  for (; i + 32 <= total; i += 32) {
    __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(X + i + 16), _mm512_loadu_ps(X + i));
    _mm512_storeu_si512((void*)(xb + i), (__m512i)v);
  }
  for (; i < total; i++) xb[i] = f32_to_bf16(X[i]);
  const int T = N / 16;
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int t = 0; t < T; t++) {
    int m = 0;
    for (; m + 4 <= M; m += 4) bf16_tile_rows<4>((const uint16_t*)packed, K, N, t, (const uint32_t*)xb, m, Y);
    for (; m < M; m++) bf16_tile_rows<1>((const uint16_t*)packed, K, N, t, (const uint32_t*)xb, m, Y);
  }
}

// Y [M, N] = swiglu(X2) @ W: X2 [M, 2K] the MLP's gate | up (swiglu_rows).
extern "C" void bf16_gemm_swiglu(const float* X2, int M, int K, const uint8_t* packed, int N, float* Y, int nt) {
  bf16_gemm(swiglu_rows(X2, M, K), M, K, packed, N, Y, nt);
}

extern "C" void bf16_gemm_norm(const float* X, const float* R, const float* w, float eps, int M, int K,
                               const uint8_t* packed, int N, float* Y, float* S, int nt) {
  bf16_gemm(norm_rows(X, R, w, eps, M, K, S), M, K, packed, N, Y, nt);
}
#endif  // __AVX512BF16__
