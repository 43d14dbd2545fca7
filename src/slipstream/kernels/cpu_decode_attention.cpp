// slipstream::cpu_decode_attention in C++: the same operator as the Python implementation in
// cpu_static_decode.py (which documents it), without the Python call per layer. Built at
// start-up by cpu_static_decode.load_native() with torch.utils.cpp_extension; if the build
// fails, the Python implementation serves. The KV caches are not arguments (so they stay out
// of the compiled graph): kv_caches_in_use() hands them to this thread with
// slipstream_cpu::set_kv_caches for the duration of one program run.
//
// KV_LEN and BLOCK_START, the columns of seq_info it reads, are defined by the loader from
// kernels/attention.py, so the two implementations cannot disagree on the layout.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// k0, v0, k1, v1, ...: one (k, v) pair per layer, each [num_blocks, block, kv_heads, dim].
thread_local std::vector<at::Tensor> caches_in_use;

void set_kv_caches(at::TensorList caches) {
  caches_in_use.assign(caches.begin(), caches.end());
}

void clear_kv_caches() { caches_in_use.clear(); }

// Tests set this to run the SDPA path on rows the direct path would take.
bool force_sdpa = false;

void set_force_sdpa(bool value) { force_sdpa = value; }

// The first kv_len tokens of the blocks in table, from a contiguous flat cache
// [num_blocks * block, kv_heads, dim] -> [kv_len, kv_heads, dim].
at::Tensor gather(const at::Tensor& flat, const int64_t* table, int64_t kv_len,
                  int64_t block_size) {
  TORCH_CHECK(flat.is_contiguous(), "cpu_decode_attention: the KV cache is contiguous");
  at::Tensor out = at::empty({kv_len, flat.size(1), flat.size(2)}, flat.options());
  const int64_t token_bytes = flat.size(1) * flat.size(2) * flat.element_size();
  const char* source = static_cast<const char*>(flat.const_data_ptr());
  char* sink = static_cast<char*>(out.data_ptr());
  for (int64_t start = 0; start < kv_len; start += block_size) {
    const int64_t count = std::min(block_size, kv_len - start);
    std::memcpy(sink + start * token_bytes,
                source + table[start / block_size] * block_size * token_bytes,
                count * token_bytes);
  }
  return out;
}

// One row: query [heads, dim] over keys/values [kv_len, kv_heads, dim] -> [heads, dim].
at::Tensor attend(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                  double scale) {
  auto dtype = query.scalar_type();
  auto out = at::scaled_dot_product_attention(
      query.unsqueeze(1), keys.transpose(0, 1).to(dtype), values.transpose(0, 1).to(dtype),
      /*attn_mask=*/std::nullopt, /*dropout_p=*/0.0, /*is_causal=*/false, scale,
      /*enable_gqa=*/true);
  return out.squeeze(1);
}

// Contexts up to this many tokens attend in attend_direct; longer ones through SDPA, whose
// blocked kernel runs on every thread.
constexpr int64_t kDirectTokens = 4096;

// The dot product of two float32 rows in 16 fixed lanes (the compiler vectorises them without
// reordering any sum), then the lanes in order.
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) lanes[i & 15] += a[i] * b[i];
  float total = 0.0f;
  for (int j = 0; j < 16; ++j) total += lanes[j];
  return total;
}

// The same row without SDPA: float32 query and cache, read in place through the block table
// (no gather, no tensors made). SDPA's CPU kernel costs tens of microseconds a call whatever
// the context, most of a short decode's attention; this costs what the arithmetic does. Each
// query head: scores, a two-pass softmax (max, then exp and sum), then the weighted values.
void attend_direct(const float* query, const float* k_base, const float* v_base,
                   const int64_t* table, int64_t kv_len, int64_t block_size, int64_t heads,
                   int64_t kv_heads, int64_t dim, double scale, float* out) {
  thread_local std::vector<float> weights;
  weights.resize(kv_len);
  const int64_t token_stride = kv_heads * dim, group = heads / kv_heads;
  const float scale_f = static_cast<float>(scale);
  for (int64_t h = 0; h < heads; ++h) {
    const float* q = query + h * dim;
    const int64_t head_offset = (h / group) * dim;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < kv_len; ++t) {
      const int64_t slot = table[t / block_size] * block_size + t % block_size;
      const float score = scale_f * dot(q, k_base + slot * token_stride + head_offset, dim);
      weights[t] = score;
      top = std::max(top, score);
    }
    float total = 0.0f;
    for (int64_t t = 0; t < kv_len; ++t) {
      weights[t] = std::exp(weights[t] - top);
      total += weights[t];
    }
    float* o = out + h * dim;
    std::fill(o, o + dim, 0.0f);
    for (int64_t t = 0; t < kv_len; ++t) {
      const int64_t slot = table[t / block_size] * block_size + t % block_size;
      const float* v = v_base + slot * token_stride + head_offset;
      const float w = weights[t];
      for (int64_t d = 0; d < dim; ++d) o[d] += w * v[d];
    }
    const float inverse = 1.0f / total;
    for (int64_t d = 0; d < dim; ++d) o[d] *= inverse;
  }
}

at::Tensor cpu_decode_attention(const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, int64_t layer,
                                const at::Tensor& slot_mapping, const at::Tensor& seq_info,
                                const at::Tensor& block_indices, double scale) {
  TORCH_CHECK(!caches_in_use.empty(), "cpu_decode_attention runs inside kv_caches_in_use()");
  TORCH_CHECK(layer >= 0 && 2 * layer + 1 < static_cast<int64_t>(caches_in_use.size()),
              "cpu_decode_attention: no KV cache for layer ", layer);
  TORCH_CHECK(seq_info.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  block_indices.scalar_type() == at::kLong,
              "cpu_decode_attention: seq_info, slot_mapping and block_indices are int64");
  const at::Tensor& k_cache = caches_in_use[2 * layer];
  const at::Tensor& v_cache = caches_in_use[2 * layer + 1];
  const int64_t block_size = k_cache.size(1);
  at::Tensor k_flat = k_cache.view({-1, k_cache.size(2), k_cache.size(3)});
  at::Tensor v_flat = v_cache.view({-1, v_cache.size(2), v_cache.size(3)});
  at::Tensor info_t = seq_info.contiguous();
  at::Tensor slots_t = slot_mapping.contiguous();
  at::Tensor blocks_t = block_indices.contiguous();
  auto info = info_t.accessor<int64_t, 2>();
  const int64_t* slots = slots_t.data_ptr<int64_t>();
  const int64_t* blocks = blocks_t.data_ptr<int64_t>();
  const int64_t rows = info.size(0);

  // Rows with KV come first; padding rows (no KV, slot -1) write nothing and get zeros.
  int64_t with_kv = 0;
  while (with_kv < rows && info[with_kv][KV_LEN] > 0) ++with_kv;
  for (int64_t r = 0; r < with_kv; ++r) {
    k_flat.select(0, slots[r]).copy_(key.select(0, r));
    v_flat.select(0, slots[r]).copy_(value.select(0, r));
  }
  // float32 throughout and short contexts: attend_direct (tests compare both paths).
  int64_t longest = 0;
  for (int64_t r = 0; r < with_kv; ++r) longest = std::max(longest, info[r][KV_LEN]);
  const bool direct = !force_sdpa && query.scalar_type() == at::kFloat &&
                      k_flat.scalar_type() == at::kFloat && v_flat.scalar_type() == at::kFloat &&
                      query.is_contiguous() && longest <= kDirectTokens;
  at::Tensor output;
  if (!(rows == 1 && with_kv == 1)) output = at::zeros_like(query);
  for (int64_t r = 0; r < with_kv; ++r) {
    const int64_t kv_len = info[r][KV_LEN];
    const int64_t* table = blocks + info[r][BLOCK_START];
    const int64_t num_blocks = (kv_len + block_size - 1) / block_size;
    if (direct) {
      if (!output.defined()) output = at::empty_like(query);
      attend_direct(query.select(0, r).const_data_ptr<float>(), k_flat.const_data_ptr<float>(),
                    v_flat.const_data_ptr<float>(), table, kv_len, block_size,
                    query.size(1), k_flat.size(1), query.size(2), scale,
                    output.select(0, r).data_ptr<float>());
      continue;
    }
    bool consecutive = true;
    for (int64_t b = 1; b < num_blocks && consecutive; ++b)
      consecutive = table[b] == table[0] + b;
    at::Tensor keys, values;
    if (consecutive) {  // a view of the cache: no gather
      keys = k_flat.narrow(0, table[0] * block_size, kv_len);
      values = v_flat.narrow(0, table[0] * block_size, kv_len);
    } else {  // gathered a block at a time, on this thread (a few KB: no thread pool)
      keys = gather(k_flat, table, kv_len, block_size);
      values = gather(v_flat, table, kv_len, block_size);
    }
    at::Tensor out = attend(query.select(0, r), keys, values, scale);
    if (!output.defined()) return out.unsqueeze(0);  // one stream: no copy
    output.select(0, r).copy_(out);
  }
  return output;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slipstream_cpu, m) {
  m.def("set_kv_caches(Tensor[] caches) -> ()", &set_kv_caches);
  m.def("clear_kv_caches() -> ()", &clear_kv_caches);
  m.def("set_force_sdpa(bool value) -> ()", &set_force_sdpa);
}

TORCH_LIBRARY_IMPL(slipstream, CPU, m) {
  m.impl("cpu_decode_attention", &cpu_decode_attention);
}
