// CPU kernel of vllm_eagle2.kernels.move_kv_slots: after a verification, the accepted tree nodes'
// keys and values move from their slots to the slots after the root, in every target layer's
// cache, in the layout vLLM chose (see tree_attention_cpu.cpp for the "vec" and "amx" layouts).
// One call moves every layer: the torch twin (read_kv_slots, then write_kv_slots per layer) costs
// a few tensor ops per layer, about 50 us each on 2 cores, where these copies are a few hundred
// elements. A copy within one layout converts nothing, so the moved K/V are bit-for-bit vLLM's.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Layout : int64_t { kVec = 0, kAmx = 1 };

// Element offsets, within one (block, kv head), of token t's key and value dim d.
struct Addr {
  int64_t bs, D;
  Layout layout;
  int64_t key(int64_t t, int64_t d) const {
    if (layout == kVec) return d * bs + t;                                 // keys [D, bs]
    return (t / 16) * 16 * D + (d / 2) * 32 + (t % 16) * 2 + (d % 2);      // [bs/16][D/2][16 tokens][2 dims]
  }
  int64_t value(int64_t t, int64_t d) const {
    if (layout == kVec) return bs * D + t * D + d;                         // values [bs, D]
    return bs * D + (d / 16) * bs * 16 + (t / 2) * 32 + (d % 16) * 2 + (t % 2);  // [D/16][bs/2][16 dims][2 tokens]
  }
};

template <typename E>
void move_one(const at::Tensor& cache, Layout layout, const int64_t* src, const int64_t* dst, int64_t n,
              std::vector<E>& held) {
  const int64_t hkv = cache.size(1), bs = cache.size(2), D = cache.size(3) / 2;
  const int64_t s0 = cache.stride(0), s1 = cache.stride(1);
  E* base = reinterpret_cast<E*>(cache.data_ptr());
  const Addr a{bs, D, layout};
  held.resize(static_cast<size_t>(n * hkv * 2 * D));
  // Every source is read before any destination is written: a path's slots may overlap.
  E* h = held.data();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < hkv; ++k) {
      const E* p = base + (src[i] / bs) * s0 + k * s1;
      const int64_t t = src[i] % bs;
      for (int64_t d = 0; d < D; ++d) *h++ = p[a.key(t, d)];
      for (int64_t d = 0; d < D; ++d) *h++ = p[a.value(t, d)];
    }
  h = held.data();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < hkv; ++k) {
      if (dst[i] < 0) {  // a padding slot: written by no one (as vLLM's writers skip it)
        h += 2 * D;
        continue;
      }
      E* p = base + (dst[i] / bs) * s0 + k * s1;
      const int64_t t = dst[i] % bs;
      for (int64_t d = 0; d < D; ++d) p[a.key(t, d)] = *h++;
      for (int64_t d = 0; d < D; ++d) p[a.value(t, d)] = *h++;
    }
}

// caches: each [num_blocks, Hkv, block_size, 2 * D], contiguous within each (block, kv head);
// src, dst: [K] int64 slots (dst -1: none). Checks every cache and slot before writing any.
void move_kv_slots(const std::vector<at::Tensor>& caches, int64_t layout, const at::Tensor& src,
                   const at::Tensor& dst) {
  TORCH_CHECK(layout == kVec || layout == kAmx, "move_kv_slots: layout 0 (vec) or 1 (amx), got ", layout);
  TORCH_CHECK(src.scalar_type() == at::kLong && dst.scalar_type() == at::kLong && src.is_contiguous() &&
                  dst.is_contiguous() && src.dim() == 1 && dst.sizes() == src.sizes() && src.device().is_cpu() &&
                  dst.device().is_cpu(),
              "move_kv_slots: src and dst contiguous int64 [K] CPU tensors");
  const int64_t n = src.numel();
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* t = dst.data_ptr<int64_t>();
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.device().is_cpu() && c.dim() == 4 && c.size(3) % 2 == 0 && c.stride(3) == 1 &&
                    c.stride(2) == c.size(3) && c.element_size() <= 4 && c.element_size() >= 2,
                "move_kv_slots: CPU caches [num_blocks, Hkv, block_size, 2 * D] of 2- or 4-byte elements, "
                "contiguous within each (block, kv head)");
    TORCH_CHECK(layout == kVec || (c.size(2) % 16 == 0 && c.size(3) % 64 == 0 && c.element_size() == 2),
                "move_kv_slots: the amx layout holds bfloat16 in blocks of a multiple of 16 tokens, "
                "head sizes of a multiple of 32");
    const int64_t slots = c.size(0) * c.size(2);
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK_VALUE(s[i] >= 0 && s[i] < slots && t[i] >= -1 && t[i] < slots, "move_kv_slots: slot pair (",
                        s[i], ", ", t[i], ") outside the cache's ", slots, " slots");
  }
  std::vector<uint16_t> held16;
  std::vector<uint32_t> held32;
  for (const at::Tensor& c : caches) {
    if (c.element_size() == 2)
      move_one<uint16_t>(c, static_cast<Layout>(layout), s, t, n, held16);
    else
      move_one<uint32_t>(c, static_cast<Layout>(layout), s, t, n, held32);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle2_cpu, m) {
  m.def("move_kv_slots(Tensor(a!)[] caches, int layout, Tensor src, Tensor dst) -> ()");
  m.impl("move_kv_slots", c10::DispatchKey::CPU, &move_kv_slots);
}
