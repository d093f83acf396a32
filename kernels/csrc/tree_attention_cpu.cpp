// CPU kernel of vllm_eagle2.kernels.paged_tree_attention (backend "cpp").
//
// Same semantics as the torch twin in tree_attention.py: query i of request r attends to every
// context token (storage position s < C) and to region token j (s = C + j) iff bit j % 32 of
// mask[r, i, j / 32] is set. It reads K/V in place through the block table and the caches'
// strides, so vLLM's CPU cache layout (keys stored [D, block_size] per block and head) needs no
// gather or copy: that copying was most of the torch twin's time.
//
// One work item = (request, tile of up to 8 of its queries, kv head): each K/V block is turned into
// float once per item and shared by the tile's queries and the group's query heads, so the inner
// loops are float GEMMs the compiler vectorises. Scores are float32; the softmax runs in two passes
// over a per-thread buffer of (tile rows) x (C + T) floats.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Scores of hidden tokens: finite, so the loops below need no infinity arithmetic.
constexpr float kHidden = -1e30f;

// n elements at src with stride `stride` into dst as float; the stride-1 case vectorises.
template <typename scalar_t>
inline void to_float(const scalar_t* src, int64_t stride, int64_t n, float* __restrict__ dst) {
  if (stride == 1) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i * stride]);
  }
}

// Query tokens of one request per work item: each K/V block is converted to float once per item.
constexpr int64_t kQueryTile = 8;
// Register blocking of the two matrix products: 4 rows x 16 float lanes of accumulators stay in
// registers over the whole reduction (accumulating through memory made them store-bound).
constexpr int64_t kLanes = 16;
constexpr int64_t kRowBlock = 4;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// kLanes floats as one value (GCC/Clang vector extension: the compiler picks the ISA's widest
// registers, no intrinsics); loads and stores are unaligned.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

typedef int32_t IntLanes __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// exp(x) for x <= 0, lane-wise (glibc's vector expf needs -ffast-math, which would also flush
// denormals process-wide): Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial, relative
// error below 2e-7; exactly 0 below -87 (so hidden tokens weigh nothing).
inline Lanes exp_nonpositive(Lanes x) {
  const IntLanes low = x < -87.0f;
  const Lanes xc = (Lanes)(((IntLanes)x & ~low) | ((IntLanes)(Lanes{} - 87.0f) & low));
  const Lanes k = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const Lanes r = (xc - k * 0.693359375f) + k * 2.12194440e-4f;
  Lanes p = Lanes{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const IntLanes two_k = (__builtin_convertvector(k, IntLanes) + 127) << 23;
  return (Lanes)((IntLanes)(p * (Lanes)two_k) & ~low);
}

template <typename scalar_t>
void tree_attention_kernel(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const int64_t* block_table,
                           int64_t num_req, int64_t max_blocks, const int64_t* qsl, const int64_t* ctx,
                           const int64_t* reg, const int32_t* mask, int64_t max_q, int64_t words,
                           double scale, at::Tensor& out) {
  const int64_t head_dim = query.size(2);
  const int64_t num_kv = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t group = query.size(1) / num_kv;

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), qs2 = query.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1), ks2 = key_cache.stride(2),
                ks3 = key_cache.stride(3);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1),
                vs2 = value_cache.stride(2), vs3 = value_cache.stride(3);

  // Work items: (request, query tile, kv head), listed on the host (requests are few).
  std::vector<int64_t> item_req, item_q0;
  int64_t max_len = 1, work = 0;
  for (int64_t r = 0; r < num_req; ++r) {
    const int64_t q_len = qsl[r + 1] - qsl[r];
    for (int64_t q0 = 0; q0 < q_len; q0 += kQueryTile) {
      item_req.push_back(r);
      item_q0.push_back(q0);
    }
    if (q_len > 0) {
      max_len = std::max(max_len, ctx[r] + reg[r]);
      work += q_len * (ctx[r] + reg[r]);
    }
  }
  const int64_t num_items = static_cast<int64_t>(item_req.size()) * num_kv;
  if (num_items == 0) return;
  // Below ~256k multiply-adds per thread a second thread costs more than it saves.
  const int64_t per_item = std::max<int64_t>(1, 4 * work * head_dim * group / num_items);
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / per_item);
  const float fscale = static_cast<float>(scale);

  const int64_t dim_pad = round_up(head_dim, kLanes);
  const int64_t rows_max = round_up(kQueryTile * group, kRowBlock);
  const int64_t block_pad = round_up(block_size, kLanes);
  at::parallel_for(0, num_items, grain, [&](int64_t begin, int64_t end) {
    // Rows and lanes are padded to whole row blocks and lanes: the padding of the queries and of
    // each key block is zero, so it adds nothing to real rows, and padding rows are never written.
    std::vector<float> qbuf(rows_max * dim_pad, 0.0f), accbuf(rows_max * dim_pad);
    std::vector<float> sbuf(rows_max * round_up(max_len, kLanes), 0.0f), kvbuf(block_pad * dim_pad, 0.0f);
    // Per row, the softmax's sum (0 = the row sees nothing): the output is divided by it at the
    // end, as flash-style kernels do, rather than the probabilities scaled before P x V (that
    // extra rounding made bf16 outputs differ from vLLM's own kernel 1.7x as often).
    std::vector<float> denom(rows_max);
    float* __restrict__ qf = qbuf.data();
    float* __restrict__ acc = accbuf.data();
    float* __restrict__ kv = kvbuf.data();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kvh = item % num_kv, tile = item / num_kv;
      const int64_t r = item_req[tile], q0 = item_q0[tile];
      const int64_t nq = std::min(kQueryTile, qsl[r + 1] - qsl[r] - q0);
      const int64_t rows = nq * group;  // row = query * group + g
      const int64_t rows_pad = round_up(rows, kRowBlock);
      const int64_t c_len = ctx[r], s_len = c_len + reg[r];
      const int64_t s_pad = round_up(s_len, kLanes);  // row stride: whole lanes for the softmax
      const int64_t* bt = block_table + r * max_blocks;
      float* __restrict__ sc = sbuf.data();  // [rows_pad, s_pad]

      std::fill(qf, qf + rows_max * dim_pad, 0.0f);
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t tok = qsl[r] + q0 + i;
        for (int64_t g = 0; g < group; ++g) {
          float* dst = qf + (i * group + g) * dim_pad;
          to_float(q_ptr + tok * qs0 + (kvh * group + g) * qs1, qs2, head_dim, dst);
          for (int64_t d = 0; d < head_dim; ++d) dst[d] *= fscale;
        }
      }

      // Scores: per cache block, keys as float [D, n_pad], then [rows, D] x [D, n].
      for (int64_t start = 0; start < s_len; start += block_size) {
        const int64_t n = std::min(block_size, s_len - start), n_pad = round_up(n, kLanes);
        const scalar_t* kb = k_ptr + bt[start / block_size] * ks0 + kvh * ks1;
        for (int64_t d = 0; d < head_dim; ++d) {
          to_float(kb + d * ks3, ks2, n, kv + d * n_pad);
          std::fill(kv + d * n_pad + n, kv + (d + 1) * n_pad, 0.0f);
        }
        for (int64_t t0 = 0; t0 < n_pad; t0 += kLanes) {
          const int64_t width = std::min(kLanes, n - t0);
          for (int64_t row0 = 0; row0 < rows_pad; row0 += kRowBlock) {
            Lanes blk[kRowBlock] = {};
            for (int64_t d = 0; d < head_dim; ++d) {
              const Lanes kd = load_lanes(kv + d * n_pad + t0);
              for (int64_t rr = 0; rr < kRowBlock; ++rr) blk[rr] += qf[(row0 + rr) * dim_pad + d] * kd;
            }
            for (int64_t rr = 0; rr < kRowBlock; ++rr) {
              float lanes[kLanes];
              std::memcpy(lanes, &blk[rr], sizeof(lanes));
              std::copy(lanes, lanes + width, sc + (row0 + rr) * s_pad + start + t0);
            }
          }
        }
      }

      // Tree mask over the region, then exp(score - row max) and its sum per row; a query that
      // sees nothing gets zeros.
      bool seen[kQueryTile];
      for (int64_t i = 0; i < nq; ++i) {
        const int32_t* mrow = mask + (r * max_q + q0 + i) * words;
        seen[i] = c_len > 0;
        for (int64_t j = 0; j < s_len - c_len; ++j) {
          if ((mrow[j >> 5] >> (j & 31)) & 1) {
            seen[i] = true;
          } else {
            for (int64_t g = 0; g < group; ++g) sc[(i * group + g) * s_pad + c_len + j] = kHidden;
          }
        }
      }
      for (int64_t row = 0; row < rows; ++row) {
        float* __restrict__ s = sc + row * s_pad;
        if (!seen[row / group]) {
          std::fill(s, s + s_pad, 0.0f);
          denom[row] = 0.0f;
          continue;
        }
        std::fill(s + s_len, s + s_pad, kHidden);
        // Reductions vectorise only where reassociation is allowed: "omp simd" allows it here
        // alone, where -ffast-math would everywhere.
        float m = kHidden;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < s_pad; ++t) m = std::max(m, s[t]);
        Lanes sum = {};
        for (int64_t t = 0; t < s_pad; t += kLanes) {
          const Lanes e = exp_nonpositive(load_lanes(s + t) - m);
          std::memcpy(s + t, &e, sizeof(e));
          sum += e;
        }
        denom[row] = 0.0f;
        for (int64_t l = 0; l < kLanes; ++l) denom[row] += sum[l];
      }

      // Output: per cache block, values as float [n, D_pad], then [rows, n] x [n, D]; / sum at the end.
      std::fill(acc, acc + rows_pad * dim_pad, 0.0f);
      for (int64_t start = 0; start < s_len; start += block_size) {
        const int64_t n = std::min(block_size, s_len - start);
        const scalar_t* vb = v_ptr + bt[start / block_size] * vs0 + kvh * vs1;
        for (int64_t t = 0; t < n; ++t) to_float(vb + t * vs2, vs3, head_dim, kv + t * dim_pad);
        for (int64_t d0 = 0; d0 < dim_pad; d0 += kLanes) {
          for (int64_t row0 = 0; row0 < rows_pad; row0 += kRowBlock) {
            Lanes blk[kRowBlock] = {};
            for (int64_t t = 0; t < n; ++t) {
              const Lanes vt = load_lanes(kv + t * dim_pad + d0);
              for (int64_t rr = 0; rr < kRowBlock; ++rr) blk[rr] += sc[(row0 + rr) * s_pad + start + t] * vt;
            }
            for (int64_t rr = 0; rr < kRowBlock; ++rr) {
              float* a = acc + (row0 + rr) * dim_pad + d0;
              const Lanes sum = load_lanes(a) + blk[rr];
              std::memcpy(a, &sum, sizeof(sum));
            }
          }
        }
      }
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t tok = qsl[r] + q0 + i;
        for (int64_t g = 0; g < group; ++g) {
          const float* a = acc + (i * group + g) * dim_pad;
          const float den = denom[i * group + g];
          scalar_t* dst = o_ptr + tok * os0 + (kvh * group + g) * os1;
          for (int64_t d = 0; d < head_dim; ++d) {
            dst[d * os2] = static_cast<scalar_t>(den > 0.0f ? a[d] / den : 0.0f);
          }
        }
      }
    }
  });
}

// query [Q, H, D]; key_cache/value_cache [num_blocks, Hkv, block_size, D] (any strides);
// block_table [R, max_blocks], query_start_loc [R + 1], context_lens/region_lens [R] (int64);
// mask [R, max_q, W] int32; out [Q, H, D] written in place.
void tree_attention(const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& block_table,
                    const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                    const at::Tensor& region_lens, const at::Tensor& mask, double scale,
                    at::Tensor& out) {
  // Shapes and dtypes (paged_tree_attention checks them with clearer messages first).
  TORCH_CHECK(query.device().is_cpu(), "tree_attention (cpp) runs on CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  out.sizes() == query.sizes() && key_cache.size(3) == query.size(2) &&
                  key_cache.size(1) > 0 && query.size(1) % key_cache.size(1) == 0,
              "tree_attention (cpp): query [Q, H, D], caches [blocks, Hkv, block_size, D], out like query");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "tree_attention (cpp): query, caches and out must share one dtype");
  for (const at::Tensor* t : {&block_table, &query_start_loc, &context_lens, &region_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "tree_attention (cpp): index tensors must be contiguous int64");
  }
  TORCH_CHECK(mask.scalar_type() == at::kInt && mask.is_contiguous() && mask.dim() == 3,
              "tree_attention (cpp): mask must be a contiguous int32 [R, max_q, W]");
  const int64_t num_req = block_table.size(0), max_blocks = block_table.size(1);
  TORCH_CHECK(block_table.dim() == 2 && query_start_loc.numel() == num_req + 1 &&
                  context_lens.numel() == num_req && region_lens.numel() == num_req && mask.size(0) == num_req,
              "tree_attention (cpp): block_table [R, B], query_start_loc [R + 1], lengths [R], mask [R, ...]");
  const int64_t max_q = mask.size(1), words = mask.size(2);
  const int64_t block_size = key_cache.size(2), num_blocks = key_cache.size(0);
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* reg = region_lens.data_ptr<int64_t>();
  const int64_t* bt = block_table.data_ptr<int64_t>();

  // The torch twin's value checks (ValueError in Python), as plain loops: after them no read can
  // leave the mask, the block table or the cache.
  TORCH_CHECK_VALUE(qsl[0] == 0 && qsl[num_req] == query.size(0),
                    "query_start_loc must start at 0 and end at Q=", query.size(0));
  for (int64_t r = 0; r < num_req; ++r) {
    const int64_t q_len = qsl[r + 1] - qsl[r];
    TORCH_CHECK_VALUE(q_len >= 0, "query_start_loc must be non-decreasing");
    TORCH_CHECK_VALUE(q_len <= max_q, "a request has more queries than mask rows (max_q=", max_q, ")");
    TORCH_CHECK_VALUE(ctx[r] >= 0 && reg[r] >= 0, "context_lens and region_lens must be >= 0");
    TORCH_CHECK_VALUE(q_len <= reg[r],
                      "a request has more queries (query_start_loc) than region tokens (region_lens)");
    TORCH_CHECK_VALUE(reg[r] <= 32 * words, "region_lens up to ", reg[r], " do not fit in mask's ", words,
                      " packed words");
    const int64_t s_len = ctx[r] + reg[r];
    TORCH_CHECK_VALUE(s_len <= max_blocks * block_size, "context_lens + region_lens up to ", s_len,
                      " exceed block_table capacity ", max_blocks, " x ", block_size);
    if (q_len == 0) continue;
    for (int64_t b = 0; b * block_size < s_len; ++b) {
      const int64_t blk = bt[r * max_blocks + b];
      TORCH_CHECK_VALUE(blk >= 0 && blk < num_blocks, "block_table entry ", blk, " out of range [0, ",
                        num_blocks, ")");
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "tree_attention", [&] {
    tree_attention_kernel<scalar_t>(query, key_cache, value_cache, bt, num_req, max_blocks, qsl, ctx, reg,
                                    mask.data_ptr<int32_t>(), max_q, words, scale, out);
  });
}

}  // namespace

TORCH_LIBRARY(eagle2_cpu, m) {
  m.def(
      "tree_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "Tensor query_start_loc, Tensor context_lens, Tensor region_lens, Tensor mask, float scale, "
      "Tensor(a!) out) -> ()");
  m.impl("tree_attention", c10::DispatchKey::CPU, &tree_attention);
}
