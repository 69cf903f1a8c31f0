// Page copies between the L1 (device) KV pool and the L2 (pinned host) pool.
//
// The Python side (kernels/ref.py: plan) reduces every layout, direction and layer choice to
//   dst[dst_idx[i]*dst_page + l*dst_layer + c*dst_chunk + b] = src[same with src strides]
// for item i, layer l in [layer0, layer0 + n_layers), chunk c < n_chunks and byte b < chunk_bytes,
// all strides in BYTES. One warp copies one (item, layer) pair, lanes striding over its
// n_chunks * chunk_bytes bytes in vectors of the widest size every address and size allows (16 B
// normally). Loads and stores carry L1::no_allocate: each byte is touched once, and streaming a page
// through L1 would only evict the attention kernels' working set. The L2 side is host memory reached
// through its device mapping (pinned, UVA), so the same kernel serves both directions.
//
// C ABI (loaded with ctypes by kernels/cuda/loader.py; no torch headers needed):
//   int strata_hicache_abi_version(void);
//   int strata_copy_pages(...);  returns a cudaError_t (0 = launched).

#include <cstdint>
#include <cuda_runtime.h>

namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kUnroll = 4;  // vectors in flight per lane: hides host-memory latency over PCIe/C2C

struct Geometry {
  int64_t src_page, src_layer, src_chunk;
  int64_t dst_page, dst_layer, dst_chunk;
  int64_t n_chunks, chunk_vecs;  // chunk size in vectors of the chosen width
};

template <typename V> struct NoAlloc;

template <> struct NoAlloc<uint4> {
  static __device__ __forceinline__ uint4 load(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
  }
  static __device__ __forceinline__ void store(uint4* p, uint4 v) {
    asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  }
};

template <> struct NoAlloc<uint2> {
  static __device__ __forceinline__ uint2 load(const uint2* p) {
    uint2 v;
    asm volatile("ld.global.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
  }
  static __device__ __forceinline__ void store(uint2* p, uint2 v) {
    asm volatile("st.global.L1::no_allocate.v2.u32 [%0], {%1, %2};" :: "l"(p), "r"(v.x), "r"(v.y) : "memory");
  }
};

template <> struct NoAlloc<uint32_t> {
  static __device__ __forceinline__ uint32_t load(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.global.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
  }
  static __device__ __forceinline__ void store(uint32_t* p, uint32_t v) {
    asm volatile("st.global.L1::no_allocate.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
  }
};

template <> struct NoAlloc<uint16_t> {
  static __device__ __forceinline__ uint16_t load(const uint16_t* p) {
    uint16_t v;
    asm volatile("ld.global.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
  }
  static __device__ __forceinline__ void store(uint16_t* p, uint16_t v) {
    asm volatile("st.global.L1::no_allocate.u16 [%0], %1;" :: "l"(p), "h"(v) : "memory");
  }
};

// Sub-word loads may target a wider register in PTX; a 16-bit one keeps the u8 case like the u16 one.
template <> struct NoAlloc<uint8_t> {
  static __device__ __forceinline__ uint8_t load(const uint8_t* p) {
    uint16_t v;
    asm volatile("ld.global.L1::no_allocate.u8 %0, [%1];" : "=h"(v) : "l"(p));
    return static_cast<uint8_t>(v);
  }
  static __device__ __forceinline__ void store(uint8_t* p, uint8_t v) {
    asm volatile("st.global.L1::no_allocate.u8 [%0], %1;" :: "l"(p), "h"(static_cast<uint16_t>(v)) : "memory");
  }
};

template <typename V>
__global__ void __launch_bounds__(kWarp * kWarpsPerBlock)
copy_pages_kernel(const char* __restrict__ src, char* __restrict__ dst,
                  const int64_t* __restrict__ src_idx, const int64_t* __restrict__ dst_idx,
                  int64_t n_items, int64_t layer0, int64_t n_layers, Geometry g) {
  const int lane = threadIdx.x % kWarp;
  const int64_t n_work = n_items * n_layers;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int64_t page_vecs = g.n_chunks * g.chunk_vecs;
  // Grid-stride over (item, layer) so any grid size is correct; the launcher sizes it to the work.
  for (int64_t w = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / kWarp; w < n_work;
       w += warps) {
    const int64_t item = w / n_layers;
    const int64_t layer = layer0 + w % n_layers;
    const char* s = src + src_idx[item] * g.src_page + layer * g.src_layer;
    char* d = dst + dst_idx[item] * g.dst_page + layer * g.dst_layer;
    for (int64_t base = lane; base < page_vecs; base += kWarp * kUnroll) {
      V v[kUnroll];
      // All loads first, then all stores: kUnroll independent requests per lane in flight.
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = base + u * kWarp;
        if (j < page_vecs) {
          const int64_t c = j / g.chunk_vecs, k = j - c * g.chunk_vecs;
          v[u] = NoAlloc<V>::load(reinterpret_cast<const V*>(s + c * g.src_chunk) + k);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = base + u * kWarp;
        if (j < page_vecs) {
          const int64_t c = j / g.chunk_vecs, k = j - c * g.chunk_vecs;
          NoAlloc<V>::store(reinterpret_cast<V*>(d + c * g.dst_chunk) + k, v[u]);
        }
      }
    }
  }
}

template <typename V>
cudaError_t launch(const void* src, void* dst, const int64_t* src_idx, const int64_t* dst_idx,
                   int64_t n_items, int64_t layer0, int64_t n_layers, Geometry g, int64_t chunk_bytes,
                   cudaStream_t stream) {
  g.chunk_vecs = chunk_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t n_work = n_items * n_layers;
  // Enough blocks to fill any current GPU several times over; more only adds scheduling overhead.
  const int64_t blocks_needed = (n_work + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const unsigned blocks = static_cast<unsigned>(blocks_needed < 65535 ? blocks_needed : 65535);
  copy_pages_kernel<V><<<blocks, kWarp * kWarpsPerBlock, 0, stream>>>(
      static_cast<const char*>(src), static_cast<char*>(dst), src_idx, dst_idx, n_items, layer0, n_layers, g);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

int strata_hicache_abi_version(void) { return 1; }

// src/dst: base pointers of the two pools (device, or mapped pinned host); src_idx/dst_idx: n_items
// device-readable int64 page indices; strides and chunk_bytes in bytes; stream: a cudaStream_t (0 =
// legacy default stream). The copy is asynchronous on that stream.
int strata_copy_pages(const void* src, void* dst, const int64_t* src_idx, const int64_t* dst_idx,
                      int64_t n_items, int64_t layer0, int64_t n_layers,
                      int64_t src_page, int64_t src_layer, int64_t src_chunk,
                      int64_t dst_page, int64_t dst_layer, int64_t dst_chunk,
                      int64_t n_chunks, int64_t chunk_bytes, void* stream) {
  if (n_items <= 0 || n_layers <= 0 || n_chunks <= 0 || chunk_bytes <= 0) return 0;
  const Geometry g{src_page, src_layer, src_chunk, dst_page, dst_layer, dst_chunk, n_chunks, 0};
  // The widest vector that divides every address and size keeps each access naturally aligned.
  const uint64_t bits = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                        static_cast<uint64_t>(src_page | src_layer | src_chunk | dst_page | dst_layer |
                                              dst_chunk | chunk_bytes);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (bits % 16 == 0) return launch<uint4>(src, dst, src_idx, dst_idx, n_items, layer0, n_layers, g, chunk_bytes, s);
  if (bits % 8 == 0) return launch<uint2>(src, dst, src_idx, dst_idx, n_items, layer0, n_layers, g, chunk_bytes, s);
  if (bits % 4 == 0) return launch<uint32_t>(src, dst, src_idx, dst_idx, n_items, layer0, n_layers, g, chunk_bytes, s);
  if (bits % 2 == 0) return launch<uint16_t>(src, dst, src_idx, dst_idx, n_items, layer0, n_layers, g, chunk_bytes, s);
  return launch<uint8_t>(src, dst, src_idx, dst_idx, n_items, layer0, n_layers, g, chunk_bytes, s);
}

}  // extern "C"
