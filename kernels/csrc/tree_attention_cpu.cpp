// CPU kernel of vllm_eagle2.kernels.cpu_tree_attention: the tree rows of one attention layer,
// read in place from vLLM's own paged KV cache, written in place into the layer's output.
//
// Semantics (the torch twin, tree_attention_cpu_torch.py, is the reference): request r of the plan
// has C = ctx context tokens (storage positions s < C) and T = region tokens after them; its
// queries are the rows first_row .. first_row + nq - 1 of the layer's query and output, the last
// nq of the region. Query i attends to every context token and to region token j (s = C + j) iff
// bit j % 32 of mask[r, i, j / 32] is set. GQA: query head h reads kv head h / (H / Hkv).
//
// KV layouts, per (block, kv head): block_size * D keys, then block_size * D values.
// * "vec" (vLLM's vec and vec16): keys [D, block_size] (token-contiguous per dim), values
//   [block_size, D].
// * "amx" (vLLM's AMX, bf16): keys in groups of 16 tokens, each [D / 2, 16 tokens, 2 dims] (the
//   VNNI B operand of Q x K^T); values in groups of 16 dims, each [block_size / 2, 16 dims,
//   2 tokens] (the VNNI B operand of P x V). A 32-bit word holds a pair: its low half is the even
//   dim (keys) or token (values), so widening a pair to float is a shift or a mask.
//
// Work: items of (request, kv head, tile of up to kRowTile query rows, range of the sequence),
// the range split so that every thread has items at batch 1 (flash-decoding); the splits are
// merged by their log-sum-exp afterwards. Inside an item, chunks of kChunk tokens with an online
// softmax: scores [rows, chunk] as register-blocked outer products (a query row's value broadcast
// against a vector of tokens; on the amx layout a pair of the query's bf16 dims against the cache's
// pairs, one vdpbf16ps where the CPU has AVX-512 BF16), the mask, exp, then P x V the same way in
// float32. All scratch is per thread and kept across calls (every layer of every forward reuses it).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Floats per vector register. EAGLE2_LANES forces a width: the tests build the AVX-512 width on
// AVX2 machines too (GCC splits a 64-byte vector into two registers), so its code runs everywhere.
#if defined(EAGLE2_LANES)
#define EAGLE2_W EAGLE2_LANES
#elif defined(__AVX512F__)
#define EAGLE2_W 16
#else
#define EAGLE2_W 8
#endif
constexpr int kW = EAGLE2_W;
static_assert(kW == 8 || kW == 16, "2 * kW tokens per step must divide 32-token groups");
typedef float VF __attribute__((vector_size(kW * sizeof(float))));
typedef uint32_t VU __attribute__((vector_size(kW * sizeof(uint32_t))));
typedef int32_t VI __attribute__((vector_size(kW * sizeof(int32_t))));
typedef uint16_t VH __attribute__((vector_size(kW * sizeof(uint16_t))));

constexpr int kRB = 6;         // rows per register block: 6 rows x 2 vectors = 12 accumulators
constexpr int kRowTile = 24;   // query rows (query x group head) per item
constexpr int kChunk = 256;    // tokens per softmax chunk (scores stay in L1/L2)
constexpr int kMinSplit = 128; // fewest tokens of a split: shorter ones cost more than they share
constexpr float kHidden = -1e30f;  // the score of a token a row does not see (finite: no inf math)

enum Layout : int64_t { kVec = 0, kAmx = 1 };

inline VF bits_to_float(VU u) {
  VF f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline VU load_u(const void* p) {
  VU u;
  std::memcpy(&u, p, sizeof(u));
  return u;
}
inline VF load_f(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_f(float* p, VF v) { std::memcpy(p, &v, sizeof(v)); }
// x in every lane: one broadcast. (Not VF{} + x: adding +0 is no identity for -0.0, so the compiler
// keeps that add; subtracting +0 is one, and folds away.)
inline VF splat(float x) { return x - VF{}; }

// kW consecutive cache elements as floats.
template <typename T>
inline VF load_as_float(const T* p);
template <>
inline VF load_as_float<float>(const float* p) {
  return load_f(p);
}
template <>
inline VF load_as_float<c10::BFloat16>(const c10::BFloat16* p) {
  // A bf16 is the high half of its float: widen and shift (one zero-extending load where the ISA
  // has it; GCC's generic widening of a vector took four shuffles).
#if EAGLE2_W == 16 && defined(__AVX512F__)
  return (VF)_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif EAGLE2_W == 8 && defined(__AVX2__)
  return (VF)_mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  VH h;
  std::memcpy(&h, p, sizeof(h));
  return bits_to_float(__builtin_convertvector(h, VU) << 16);
#endif
}
template <>
inline VF load_as_float<c10::Half>(const c10::Half* p) {
#if EAGLE2_W == 16 && defined(__AVX512F__)
  return (VF)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif EAGLE2_W == 8 && defined(__F16C__)
  return (VF)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float f[kW];
  for (int i = 0; i < kW; ++i) f[i] = static_cast<float>(p[i]);
  return load_f(f);
#endif
}

// The two halves of kW packed bf16 pairs as floats: low (even element) and high (odd element).
inline void unpack_pairs(const void* p, VF& lo, VF& hi) {
  const VU u = load_u(p);
  lo = bits_to_float(u << 16);
  hi = bits_to_float(u & 0xFFFF0000u);
}

// exp(x) for x <= 0, lane-wise: Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial,
// relative error below 2e-7; exactly 0 below -87 (a hidden token weighs nothing).
inline VF exp_nonpositive(VF x) {
  const VI low = x < -87.0f;
  const VF xc = (VF)(((VI)x & ~low) | ((VI)splat(-87.0f) & low));
  const VF k = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const VF r = (xc - k * 0.693359375f) + k * 2.12194440e-4f;
  VF p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI two_k = (__builtin_convertvector(k, VI) + 127) << 23;
  return (VF)((VI)(p * (VF)two_k) & ~low);
}

struct Geometry {
  int64_t head_dim, block_size, group, num_kv;
  int64_t cache_block_stride, cache_head_stride;  // elements
};

// Scores of kRB rows against the 2 * kW tokens at in-block offset `off` of one (block, kv head):
// s[rr * lds + t]. "vec": q is [kRB, D] float, already scaled. "amx": qp is [kRB, D / 2] words, the
// query's own bf16 pairs (low half the even dim, as the cache's key pairs), and the scores are
// scaled here: a pair of products is one bf16 dot product (vdpbf16ps where the CPU has it, else two
// float FMAs of the same exact products).
template <typename T, int64_t layout>
inline void qk_block(const float* __restrict__ q, const uint32_t* __restrict__ qp, int64_t ldq,
                     const T* __restrict__ kb, int64_t off, const Geometry& g, float scale,
                     float* __restrict__ s, int64_t lds) {
  VF acc[kRB][2] = {};
  const int64_t D = g.head_dim;
  if constexpr (layout == kVec) {
    const T* k = kb + off;
    for (int64_t d = 0; d < D; ++d, k += g.block_size) {
      const VF k0 = load_as_float(k), k1 = load_as_float(k + kW);
      for (int rr = 0; rr < kRB; ++rr) {
        const VF qv = splat(q[rr * ldq + d]);
        acc[rr][0] += qv * k0;
        acc[rr][1] += qv * k1;
      }
    }
  } else {
    // Words of one 16-token group: group (off / 16) at 8 * D words, pair j at 16 words, token off % 16.
    const uint32_t* kw = reinterpret_cast<const uint32_t*>(kb);
    const uint32_t* k[2];
    for (int v = 0; v < 2; ++v) {
      const int64_t t = off + v * kW;
      k[v] = kw + (t / 16) * 8 * D + t % 16;
    }
    for (int64_t j = 0; j < D / 2; ++j) {
#if EAGLE2_W == 16 && defined(__AVX512BF16__)
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k[0] + j * 16);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(k[1] + j * 16);
      for (int rr = 0; rr < kRB; ++rr) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[rr * ldq + j]));
        acc[rr][0] = (VF)_mm512_dpbf16_ps((__m512)acc[rr][0], k0, qv);
        acc[rr][1] = (VF)_mm512_dpbf16_ps((__m512)acc[rr][1], k1, qv);
      }
#else
      VF lo[2], hi[2];
      unpack_pairs(k[0] + j * 16, lo[0], hi[0]);
      unpack_pairs(k[1] + j * 16, lo[1], hi[1]);
      for (int rr = 0; rr < kRB; ++rr) {
        const uint32_t w = qp[rr * ldq + j];
        float q_lo, q_hi;
        const uint32_t w_lo = w << 16, w_hi = w & 0xFFFF0000u;
        std::memcpy(&q_lo, &w_lo, sizeof(q_lo));
        std::memcpy(&q_hi, &w_hi, sizeof(q_hi));
        const VF q0 = splat(q_lo), q1 = splat(q_hi);
        acc[rr][0] += q0 * lo[0] + q1 * hi[0];
        acc[rr][1] += q0 * lo[1] + q1 * hi[1];
      }
#endif
    }
    for (int rr = 0; rr < kRB; ++rr) {
      acc[rr][0] *= scale;
      acc[rr][1] *= scale;
    }
  }
  for (int rr = 0; rr < kRB; ++rr) {
    store_f(s + rr * lds, acc[rr][0]);
    store_f(s + rr * lds + kW, acc[rr][1]);
  }
}

// acc[rr * ldo + d0 ..] += P[rr, 0 .. n) x V[tokens off .. off + n, dims d0 .. d0 + NV * kW) of one
// (block, kv head); n <= block_size - off tokens, all written (no garbage slot is read).
template <typename T, int64_t layout, int NV>
inline void pv_block(const float* __restrict__ p, int64_t ldp, const T* __restrict__ vb, int64_t off,
                     int64_t n, int64_t d0, const Geometry& g, float* __restrict__ o, int64_t ldo) {
  VF acc[kRB][NV];
  for (int rr = 0; rr < kRB; ++rr)
    for (int v = 0; v < NV; ++v) acc[rr][v] = load_f(o + rr * ldo + d0 + v * kW);
  const int64_t D = g.head_dim;
  if constexpr (layout == kVec) {
    const T* vt = vb + off * D + d0;
    for (int64_t t = 0; t < n; ++t, vt += D) {
      VF x[NV];
      for (int v = 0; v < NV; ++v) x[v] = load_as_float(vt + v * kW);
      for (int rr = 0; rr < kRB; ++rr) {
        const VF pv = splat(p[rr * ldp + t]);
        for (int v = 0; v < NV; ++v) acc[rr][v] += pv * x[v];
      }
    }
  } else {
    // Words of dims group d / 16 at 8 * block_size words, token pair t / 2 at 16 words, dim d % 16.
    const uint32_t* vw = reinterpret_cast<const uint32_t*>(vb);
    const uint32_t* base[NV];
    for (int v = 0; v < NV; ++v) {
      const int64_t d = d0 + v * kW;
      base[v] = vw + (d / 16) * 8 * g.block_size + d % 16;
    }
    // off is even (chunks start at multiples of 32); an odd n leaves one token alone at the end,
    // whose pair partner is an unwritten slot: only the pair's low half is used.
    const int64_t pairs = n / 2;
    for (int64_t pi = 0; pi < pairs; ++pi) {
      VF lo[NV], hi[NV];
      for (int v = 0; v < NV; ++v) unpack_pairs(base[v] + (off / 2 + pi) * 16, lo[v], hi[v]);
      for (int rr = 0; rr < kRB; ++rr) {
        const VF p0 = splat(p[rr * ldp + 2 * pi]), p1 = splat(p[rr * ldp + 2 * pi + 1]);
        for (int v = 0; v < NV; ++v) acc[rr][v] += p0 * lo[v] + p1 * hi[v];
      }
    }
    if (n % 2) {
      VF lo[NV], hi[NV];
      for (int v = 0; v < NV; ++v) unpack_pairs(base[v] + (off / 2 + pairs) * 16, lo[v], hi[v]);
      for (int rr = 0; rr < kRB; ++rr) {
        const VF p0 = splat(p[rr * ldp + 2 * pairs]);
        for (int v = 0; v < NV; ++v) acc[rr][v] += p0 * lo[v];
      }
    }
  }
  for (int rr = 0; rr < kRB; ++rr)
    for (int v = 0; v < NV; ++v) store_f(o + rr * ldo + d0 + v * kW, acc[rr][v]);
}

struct Request {
  int64_t first_row, num_q, ctx, region;
};

// One work item: rows [row0, row0 + rows) of request req's kv head, sequence range [s0, s1).
struct Item {
  int32_t req, kv_head, row0, rows;
  int32_t s0, s1, split, first_split;  // split: index into the partials (-1 = whole sequence)
};

// Per-thread scratch, kept across calls: padded queries, scores, accumulators, softmax state.
struct Scratch {
  std::vector<float> q, s, acc, m, l;
  std::vector<uint32_t> qp;  // the amx layout's query pairs
  void fit(int64_t rows, int64_t dim) {
    const int64_t need_q = rows * dim, need_s = rows * (kChunk + 2 * kW);
    if (static_cast<int64_t>(q.size()) < need_q) q.resize(need_q), acc.resize(need_q), qp.resize(need_q / 2);
    if (static_cast<int64_t>(s.size()) < need_s) s.resize(need_s);
    if (static_cast<int64_t>(m.size()) < rows) m.resize(rows), l.resize(rows);
  }
};

template <typename T, int64_t layout>
void run_item(const Item& it, const Request& rq, const T* q_ptr, int64_t qs0, int64_t qs1, int64_t qs2,
              const T* cache, const int32_t* bt, const int32_t* mrow0, int64_t words, const Geometry& g,
              float scale, Scratch& sc, float* partial, T* o_ptr, int64_t os0, int64_t os1, int64_t os2) {
  const int64_t D = g.head_dim, bs = g.block_size, grp = g.group;
  const int64_t rows_pad = (it.rows + kRB - 1) / kRB * kRB;
  sc.fit(rows_pad, D);
  float* __restrict__ qf = sc.q.data();
  uint32_t* __restrict__ qp = sc.qp.data();
  float* __restrict__ acc = sc.acc.data();
  float* __restrict__ m = sc.m.data();
  float* __restrict__ l = sc.l.data();
  // Only the layout's own query buffer is read: padding rows zeroed there alone.
  if constexpr (layout == kAmx)
    std::fill(qp, qp + rows_pad * D / 2, 0u);
  else
    std::fill(qf, qf + rows_pad * D, 0.0f);
  std::fill(acc, acc + rows_pad * D, 0.0f);
  std::fill(m, m + rows_pad, kHidden);
  std::fill(l, l + rows_pad, 0.0f);
  for (int64_t rr = 0; rr < it.rows; ++rr) {
    const int64_t row = it.row0 + rr, i = row / grp, head = it.kv_head * grp + row % grp;
    const T* src = q_ptr + (rq.first_row + i) * qs0 + head * qs1;
    if constexpr (layout == kAmx) {  // T is bf16: its pairs as they are, the scale on the scores
      for (int64_t j = 0; j < D / 2; ++j)
        qp[rr * D / 2 + j] = uint32_t{src[2 * j * qs2].x} | (uint32_t{src[(2 * j + 1) * qs2].x} << 16);
    } else {
      for (int64_t d = 0; d < D; ++d) qf[rr * D + d] = static_cast<float>(src[d * qs2]) * scale;
    }
  }
  const int64_t lds = kChunk + 2 * kW;
  for (int64_t c0 = it.s0; c0 < it.s1; c0 += kChunk) {
    const int64_t c1 = std::min<int64_t>(it.s1, c0 + kChunk);
    float* __restrict__ s = sc.s.data();
    // Scores, 2 * kW tokens at a time (chunks start at multiples of 32, blocks hold multiples of 32).
    for (int64_t t = c0; t < c1; t += 2 * kW) {
      const T* kb = cache + bt[t / bs] * g.cache_block_stride + it.kv_head * g.cache_head_stride;
      for (int64_t r0 = 0; r0 < rows_pad; r0 += kRB)
        qk_block<T, layout>(qf + r0 * D, qp + r0 * D / 2, layout == kAmx ? D / 2 : D, kb, t % bs, g, scale,
                            s + r0 * lds + (t - c0), lds);
    }
    // Only the chunk's n scores are read from here on: the lanes past the sequence (unwritten
    // slots, any bits) are left out of the softmax and P x V.
    const int64_t n = c1 - c0;
    // The region tokens each query's mask row hides.
    const int64_t reg0 = std::max(c0, rq.ctx);
    for (int64_t rr = 0; rr < it.rows && reg0 < c1; ++rr) {
      float* __restrict__ srow = s + rr * lds - c0;
      const int32_t* mr = mrow0 + ((it.row0 + rr) / grp) * words;
      for (int64_t t = reg0; t < c1; ++t) {
        const int64_t j = t - rq.ctx;
        if (!((mr[j >> 5] >> (j & 31)) & 1)) srow[t] = kHidden;
      }
    }
    // Online softmax: the chunk's max, the rescale of what came before, exp and sum.
    for (int64_t rr = 0; rr < rows_pad; ++rr) {
      float* __restrict__ srow = s + rr * lds;
      float cm = kHidden;
      for (int64_t t = 0; t < n; ++t) cm = std::max(cm, srow[t]);
      if (cm <= kHidden) {  // the row sees nothing here (or is padding): its weights are 0
        std::fill(srow, srow + n, 0.0f);
        continue;
      }
      const float mn = std::max(m[rr], cm);
      const float alpha = m[rr] <= kHidden ? 0.0f : std::exp(m[rr] - mn);
      if (alpha != 1.0f)
        for (int64_t d = 0; d < D; ++d) acc[rr * D + d] *= alpha;
      VF sum = {};
      int64_t t = 0;
      for (; t + kW <= n; t += kW) {
        const VF e = exp_nonpositive(load_f(srow + t) - mn);
        store_f(srow + t, e);
        sum += e;
      }
      float total = 0.0f;
      for (int v = 0; v < kW; ++v) total += sum[v];
      for (; t < n; ++t) total += (srow[t] = std::exp(srow[t] - mn));
      l[rr] = l[rr] * alpha + total;
      m[rr] = mn;
    }
    // acc += P x V, block by block over the chunk's tokens.
    for (int64_t t = c0; t < c1;) {
      const int64_t off = t % bs, cnt = std::min(bs - off, c1 - t);
      const T* vb = cache + bt[t / bs] * g.cache_block_stride + it.kv_head * g.cache_head_stride + bs * D;
      for (int64_t r0 = 0; r0 < rows_pad; r0 += kRB) {
        const float* p = s + r0 * lds + (t - c0);
        int64_t d0 = 0;
        for (; d0 + 2 * kW <= D; d0 += 2 * kW) pv_block<T, layout, 2>(p, lds, vb, off, cnt, d0, g, acc + r0 * D, D);
        for (; d0 < D; d0 += kW) pv_block<T, layout, 1>(p, lds, vb, off, cnt, d0, g, acc + r0 * D, D);
      }
      t += cnt;
    }
  }
  if (it.split < 0) {  // the whole sequence: the output rows themselves
    for (int64_t rr = 0; rr < it.rows; ++rr) {
      const int64_t row = it.row0 + rr, i = row / grp, head = it.kv_head * grp + row % grp;
      T* dst = o_ptr + (rq.first_row + i) * os0 + head * os1;
      const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
      for (int64_t d = 0; d < D; ++d) dst[d * os2] = static_cast<T>(acc[rr * D + d] * inv);
    }
    return;
  }
  // A split: its rows' (max, sum, unnormalised output) for the merge.
  float* part = partial + static_cast<int64_t>(it.split) * kRowTile * (D + 2);
  for (int64_t rr = 0; rr < it.rows; ++rr) {
    float* pr = part + rr * (D + 2);
    pr[0] = m[rr];
    pr[1] = l[rr];
    std::memcpy(pr + 2, acc + rr * D, D * sizeof(float));
  }
}

// The splits first .. first + count - 1 of one (request, kv head, row tile), merged into the output.
template <typename T>
void merge_splits(const Item& it, int64_t count, const Request& rq, const float* partial, int64_t D,
                  int64_t grp, T* o_ptr, int64_t os0, int64_t os1, int64_t os2) {
  std::vector<float> out(D);
  for (int64_t rr = 0; rr < it.rows; ++rr) {
    float mx = kHidden;
    for (int64_t k = 0; k < count; ++k)
      mx = std::max(mx, partial[(it.first_split + k) * kRowTile * (D + 2) + rr * (D + 2)]);
    std::fill(out.begin(), out.end(), 0.0f);
    float den = 0.0f;
    for (int64_t k = 0; k < count; ++k) {
      const float* pr = partial + (it.first_split + k) * kRowTile * (D + 2) + rr * (D + 2);
      if (pr[1] <= 0.0f) continue;
      const float w = std::exp(pr[0] - mx);
      den += w * pr[1];
      for (int64_t d = 0; d < D; ++d) out[d] += w * pr[2 + d];
    }
    const int64_t row = it.row0 + rr, i = row / grp, head = it.kv_head * grp + row % grp;
    T* dst = o_ptr + (rq.first_row + i) * os0 + head * os1;
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[d * os2] = static_cast<T>(out[d] * inv);
  }
}

// Items of one call, and where each (request, kv head, row tile)'s splits start (kept per thread).
struct WorkList {
  std::vector<Item> items, merges;  // merges: one per group that was split, its first item
  std::vector<int64_t> merge_count;
  int64_t splits = 0;
};

void list_work(const Request* reqs, int64_t num_req, int64_t num_kv, int64_t grp, int threads, WorkList& w) {
  w.items.clear();
  w.merges.clear();
  w.merge_count.clear();
  w.splits = 0;
  int64_t groups = 0;
  for (int64_t r = 0; r < num_req; ++r)
    if (reqs[r].num_q > 0) groups += (reqs[r].num_q * grp + kRowTile - 1) / kRowTile;
  groups *= num_kv;
  // Enough items to keep every thread busy (about four each), none shorter than kMinSplit tokens.
  const int64_t want = groups >= 2 * threads ? 1 : (4 * threads + groups - 1) / std::max<int64_t>(groups, 1);
  for (int64_t r = 0; r < num_req; ++r) {
    const Request& rq = reqs[r];
    if (rq.num_q == 0) continue;
    const int64_t seq = rq.ctx + rq.region, rows = rq.num_q * grp;
    const int64_t splits = std::max<int64_t>(1, std::min(want, seq / kMinSplit));
    const int64_t step = (seq + splits - 1) / splits + 31;  // rounded to whole 32-token groups below
    const int64_t span = std::max<int64_t>(32, step / 32 * 32);
    for (int64_t h = 0; h < num_kv; ++h) {
      for (int64_t row0 = 0; row0 < rows; row0 += kRowTile) {
        const int32_t nrows = static_cast<int32_t>(std::min<int64_t>(kRowTile, rows - row0));
        const int64_t pieces = (seq + span - 1) / span;
        const int32_t first = pieces > 1 ? static_cast<int32_t>(w.splits) : -1;
        for (int64_t k = 0; k < pieces; ++k) {
          const int32_t s0 = static_cast<int32_t>(k * span);
          const int32_t s1 = static_cast<int32_t>(std::min(seq, (k + 1) * span));
          const int32_t split = pieces > 1 ? static_cast<int32_t>(w.splits++) : -1;
          w.items.push_back({static_cast<int32_t>(r), static_cast<int32_t>(h), static_cast<int32_t>(row0), nrows,
                             s0, s1, split, first});
        }
        if (pieces > 1) {
          w.merges.push_back(w.items.back());
          w.merge_count.push_back(pieces);
        }
      }
    }
  }
}

template <typename T, int64_t layout>
void tree_attention_impl(const at::Tensor& query, const at::Tensor& kv_cache, const int32_t* bt,
                         int64_t max_blocks, const Request* reqs, int64_t num_req, const int32_t* mask,
                         int64_t max_q, int64_t words, double scale, at::Tensor& out) {
  Geometry g{query.size(2), kv_cache.size(2), query.size(1) / kv_cache.size(1), kv_cache.size(1),
             kv_cache.stride(0), kv_cache.stride(1)};
  const int threads = omp_get_max_threads();
  static thread_local WorkList work;  // the caller's: kept across calls
  list_work(reqs, num_req, g.num_kv, g.group, threads, work);
  if (work.items.empty()) return;
  static thread_local std::vector<float> partial;
  const int64_t part_size = work.splits * kRowTile * (g.head_dim + 2);
  if (static_cast<int64_t>(partial.size()) < part_size) partial.resize(part_size);

  const T* q_ptr = query.data_ptr<T>();
  const T* cache = kv_cache.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), qs2 = query.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  const float fscale = static_cast<float>(scale);
  const int64_t num_items = static_cast<int64_t>(work.items.size());
  const int64_t num_merges = static_cast<int64_t>(work.merges.size());
  float* part = partial.data();
  const WorkList& w = work;
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(threads, num_items)))
  {
    static thread_local Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < num_items; ++k) {
      const Item& it = w.items[k];
      run_item<T, layout>(it, reqs[it.req], q_ptr, qs0, qs1, qs2, cache, bt + it.req * max_blocks,
                          mask + it.req * max_q * words, words, g, fscale, sc, part, o_ptr, os0, os1, os2);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < num_merges; ++k) {
      const Item& it = w.merges[k];
      merge_splits<T>(it, w.merge_count[k], reqs[it.req], part, g.head_dim, g.group, o_ptr, os0, os1, os2);
    }
  }
}

// query [N, H, D] and out [N, H, D] (any strides; out written at the plan's rows only);
// kv_cache [num_blocks, Hkv, block_size, 2 * D] as vLLM's CPU backend allocates it; layout 0 = vec,
// 1 = amx; block_table [R, max_blocks] int32; plan [R + 1, 4] int64 (row 0: R, num_blocks,
// block_size, rows; then first_row, num_q, ctx, region per request), validated by its builder
// (tree_attention_cpu.py) once per forward; mask [R, max_q, W] int32.
void tree_attention(const at::Tensor& query, const at::Tensor& kv_cache, int64_t layout,
                    const at::Tensor& block_table, const at::Tensor& plan, const at::Tensor& mask, double scale,
                    at::Tensor& out) {
  // Per layer only what can differ between layers: shapes, dtypes and the cache's geometry.
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "tree_attention runs on CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && kv_cache.dim() == 4,
              "tree_attention: query and out [N, H, D], kv_cache [num_blocks, Hkv, block_size, 2 * D]");
  const int64_t D = query.size(2), num_kv = kv_cache.size(1), bs = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == 2 * D && num_kv > 0 && query.size(1) % num_kv == 0,
              "tree_attention: kv_cache [num_blocks, Hkv, block_size, 2 * D] with H a multiple of Hkv");
  TORCH_CHECK(kv_cache.stride(3) == 1 && kv_cache.stride(2) == 2 * D,
              "tree_attention: kv_cache must be contiguous within each (block, kv head)");
  TORCH_CHECK(D % 16 == 0 && bs % 32 == 0, "tree_attention: head size a multiple of 16, block size of 32");
  TORCH_CHECK(layout == kVec || (layout == kAmx && kv_cache.scalar_type() == at::kBFloat16 && D % 32 == 0),
              "tree_attention: layout 0 (vec) or 1 (amx: bfloat16, head size a multiple of 32)");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type(),
              "tree_attention: query, kv_cache and out must share one dtype");
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.is_contiguous() && plan.dim() == 2 && plan.size(1) == 4,
              "tree_attention: plan must be a contiguous int64 [R + 1, 4]");
  const int64_t* hdr = plan.data_ptr<int64_t>();
  const int64_t num_req = hdr[0];
  TORCH_CHECK(plan.size(0) == num_req + 1 && hdr[1] == kv_cache.size(0) && hdr[2] == bs && hdr[3] <= query.size(0),
              "tree_attention: the plan was validated for another cache or batch (blocks ", hdr[1],
              ", block size ", hdr[2], ", rows ", hdr[3], ")");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.dim() == 2 &&
                  block_table.size(0) == num_req && mask.scalar_type() == at::kInt && mask.is_contiguous() &&
                  mask.dim() == 3 && mask.size(0) == num_req,
              "tree_attention: block_table int32 [R, B] and mask int32 [R, max_q, W], contiguous");
  const Request* reqs = reinterpret_cast<const Request*>(hdr + 4);
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1), max_q = mask.size(1), words = mask.size(2);
  const int32_t* mk = mask.data_ptr<int32_t>();
  switch (query.scalar_type()) {
    case at::kFloat:
      tree_attention_impl<float, kVec>(query, kv_cache, bt, max_blocks, reqs, num_req, mk, max_q, words, scale, out);
      break;
    case at::kHalf:
      tree_attention_impl<c10::Half, kVec>(query, kv_cache, bt, max_blocks, reqs, num_req, mk, max_q, words, scale,
                                           out);
      break;
    case at::kBFloat16:
      if (layout == kAmx)
        tree_attention_impl<c10::BFloat16, kAmx>(query, kv_cache, bt, max_blocks, reqs, num_req, mk, max_q, words,
                                                 scale, out);
      else
        tree_attention_impl<c10::BFloat16, kVec>(query, kv_cache, bt, max_blocks, reqs, num_req, mk, max_q, words,
                                                 scale, out);
      break;
    default:
      TORCH_CHECK(false, "tree_attention: float32, bfloat16 or float16, got ", query.scalar_type());
  }
}

// The plan of one forward's tree rows (see tree_attention_cpu.py: plan_cpu_tree_attention), every
// index value checked once here so that no layer's kernel can read outside the mask, the block
// table, the cache or the batch. rows [Q], query_start_loc [R + 1], context_lens and region_lens [R]:
// int64; block_table [R, B] int32; mask [R, max_q, W].
at::Tensor tree_attention_plan(const at::Tensor& rows, const at::Tensor& query_start_loc,
                               const at::Tensor& block_table, const at::Tensor& context_lens,
                               const at::Tensor& region_lens, const at::Tensor& mask, int64_t num_blocks,
                               int64_t block_size, int64_t num_rows) {
  for (const at::Tensor* t : {&rows, &query_start_loc, &context_lens, &region_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                "tree_attention_plan: index tensors must be contiguous 1-D int64");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.dim() == 2,
              "tree_attention_plan: block_table must be a contiguous int32 [R, B]");
  TORCH_CHECK(mask.dim() == 3, "tree_attention_plan: mask must be [R, max_q, W]");
  const int64_t num_req = query_start_loc.numel() - 1;
  TORCH_CHECK_VALUE(num_req >= 0 && block_table.size(0) == num_req && context_lens.numel() == num_req &&
                        region_lens.numel() == num_req && mask.size(0) == num_req,
                    "query_start_loc [R + 1], block_table [R, B], context_lens and region_lens [R], mask [R, ...] "
                    "disagree on R");
  TORCH_CHECK_VALUE(block_size % 32 == 0, "the CPU tree kernel reads blocks of a multiple of 32 tokens, got ",
                    block_size);
  const int64_t* rw = rows.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* reg = region_lens.data_ptr<int64_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1), max_q = mask.size(1), bits = 32 * mask.size(2);
  const int64_t q_total = rows.numel();
  TORCH_CHECK_VALUE(qsl[0] == 0 && qsl[num_req] == q_total, "query_start_loc must rise from 0 to Q=", q_total);
  at::Tensor plan = at::empty({num_req + 1, 4}, rows.options());
  int64_t* out = plan.data_ptr<int64_t>();
  out[0] = num_req, out[1] = num_blocks, out[2] = block_size, out[3] = num_rows;
  for (int64_t r = 0; r < num_req; ++r) {
    const int64_t nq = qsl[r + 1] - qsl[r];
    TORCH_CHECK_VALUE(nq >= 0, "query_start_loc must rise from 0 to Q=", q_total);
    TORCH_CHECK_VALUE(nq <= max_q && nq <= reg[r] && ctx[r] >= 0 && reg[r] <= bits &&
                          ctx[r] + reg[r] <= max_blocks * block_size,
                      "request ", r, ": ", nq, " queries, context ", ctx[r], ", region ", reg[r],
                      " do not fit mask rows ", max_q, ", mask bits ", bits, " or the block table's ",
                      max_blocks * block_size, " tokens");
    const int64_t first = nq > 0 ? rw[qsl[r]] : 0;
    for (int64_t i = 0; i < nq; ++i)
      TORCH_CHECK_VALUE(rw[qsl[r] + i] == first + i && first >= 0 && first + nq <= num_rows,
                        "each request's rows must be consecutive and within the forward's ", num_rows, " rows");
    for (int64_t b = 0; nq > 0 && b * block_size < ctx[r] + reg[r]; ++b) {
      const int64_t blk = bt[r * max_blocks + b];
      TORCH_CHECK_VALUE(blk >= 0 && blk < num_blocks, "a block_table entry a request reads (", blk,
                        ") is outside [0, ", num_blocks, ")");
    }
    int64_t* row = out + 4 * (r + 1);
    row[0] = first, row[1] = nq, row[2] = ctx[r], row[3] = reg[r];
  }
  return plan;
}

// How tree_attention splits a plan's work on `threads` threads: {items, splits merged}.
std::vector<int64_t> tree_attention_work(const at::Tensor& plan, int64_t num_kv, int64_t group, int64_t threads) {
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.is_contiguous() && plan.dim() == 2 && plan.size(1) == 4,
              "tree_attention_work: plan must be a contiguous int64 [R + 1, 4]");
  WorkList w;
  const int64_t* hdr = plan.data_ptr<int64_t>();
  list_work(reinterpret_cast<const Request*>(hdr + 4), hdr[0], num_kv, group, static_cast<int>(threads), w);
  return {static_cast<int64_t>(w.items.size()), w.splits};
}

}  // namespace

TORCH_LIBRARY(eagle2_cpu, m) {
  m.def(
      "tree_attention(Tensor query, Tensor kv_cache, int layout, Tensor block_table, Tensor plan, "
      "Tensor mask, float scale, Tensor(a!) out) -> ()");
  m.impl("tree_attention", c10::DispatchKey::CPU, &tree_attention);
  m.def(
      "tree_attention_plan(Tensor rows, Tensor query_start_loc, Tensor block_table, Tensor context_lens, "
      "Tensor region_lens, Tensor mask, int num_blocks, int block_size, int num_rows) -> Tensor");
  m.impl("tree_attention_plan", c10::DispatchKey::CPU, &tree_attention_plan);
  m.def("tree_attention_work(Tensor plan, int num_kv, int group, int threads) -> int[]");
  m.impl("tree_attention_work", c10::DispatchKey::CPU, &tree_attention_work);
}
