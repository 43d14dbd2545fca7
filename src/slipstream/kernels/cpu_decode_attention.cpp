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
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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
// The cache is walked a block at a time (no division per token), and each row's arithmetic
// is the same whichever rows share its call or thread, so a row's output does not depend on
// its batch.

// The cached token `t` of a block table, as a row pointer: blocks of block_size tokens.
struct TokenRows {
  const float* base;
  const int64_t* table;
  int64_t block_size, token_stride, head_offset;
  const float* row(int64_t block, int64_t i) const {
    return base + (table[block] * block_size + i) * token_stride + head_offset;
  }
};

// Calls fn(token, row) for the first kv_len tokens, in order.
template <typename Fn>
inline void each_token(const TokenRows& rows, int64_t kv_len, Fn&& fn) {
  for (int64_t start = 0, block = 0; start < kv_len; start += rows.block_size, ++block) {
    const int64_t count = std::min(rows.block_size, kv_len - start);
    for (int64_t i = 0; i < count; ++i) fn(start + i, rows.row(block, i));
  }
}

#if defined(__AVX512F__)
// e^x for x <= 0 (scores less their maximum), 16 lanes: x = n ln2 + r with |r| <= ln2 / 2,
// e^r from Cephes' degree-6 polynomial for expf, then scaled by 2^n (vscalefps, which also
// takes a very negative x to zero).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// One query head of VECTORS * 16 dimensions over the tokens of `keys`/`values`; `weights`
// has room for kv_len rounded up to 16.
template <int VECTORS>
void attend_head(const float* q, const TokenRows& keys, const TokenRows& values, int64_t kv_len,
                 float scale, float* weights, float* out) {
  __m512 query[VECTORS];
  for (int v = 0; v < VECTORS; ++v)
    query[v] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * v), _mm512_set1_ps(scale));
  float top = -std::numeric_limits<float>::infinity();
  each_token(keys, kv_len, [&](int64_t t, const float* k) {
    __m512 sum = _mm512_mul_ps(query[0], _mm512_loadu_ps(k));
    for (int v = 1; v < VECTORS; ++v) sum = _mm512_fmadd_ps(query[v], _mm512_loadu_ps(k + 16 * v), sum);
    const float score = _mm512_reduce_add_ps(sum);
    weights[t] = score;
    top = std::max(top, score);
  });
  const __m512 shift = _mm512_set1_ps(top);
  __m512 totals = _mm512_setzero_ps();
  for (int64_t t = 0; t < kv_len; t += 16) {
    const __mmask16 lanes = kv_len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (kv_len - t)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, weights + t), shift));
    _mm512_mask_storeu_ps(weights + t, lanes, e);
    totals = _mm512_add_ps(totals, _mm512_maskz_mov_ps(lanes, e));
  }
  __m512 acc[VECTORS];
  for (int v = 0; v < VECTORS; ++v) acc[v] = _mm512_setzero_ps();
  each_token(values, kv_len, [&](int64_t t, const float* row) {
    const __m512 w = _mm512_set1_ps(weights[t]);
    for (int v = 0; v < VECTORS; ++v) acc[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(row + 16 * v), acc[v]);
  });
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(totals));
  for (int v = 0; v < VECTORS; ++v) _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(acc[v], inverse));
}
#endif

// Any head size, without intrinsics.
void attend_head_scalar(const float* q, const TokenRows& keys, const TokenRows& values,
                        int64_t kv_len, int64_t dim, float scale, float* weights, float* out) {
  float top = -std::numeric_limits<float>::infinity();
  each_token(keys, kv_len, [&](int64_t t, const float* k) {
    weights[t] = scale * dot(q, k, dim);
    top = std::max(top, weights[t]);
  });
  float total = 0.0f;
  for (int64_t t = 0; t < kv_len; ++t) {
    weights[t] = std::exp(weights[t] - top);
    total += weights[t];
  }
  std::fill(out, out + dim, 0.0f);
  each_token(values, kv_len, [&](int64_t t, const float* v) {
    const float w = weights[t];
    for (int64_t d = 0; d < dim; ++d) out[d] += w * v[d];
  });
  const float inverse = 1.0f / total;
  for (int64_t d = 0; d < dim; ++d) out[d] *= inverse;
}

// Query head `h` of one row: query [heads, dim], out [heads, dim].
void attend_direct(const float* query, const float* k_base, const float* v_base,
                   const int64_t* table, int64_t kv_len, int64_t block_size, int64_t heads,
                   int64_t kv_heads, int64_t dim, int64_t h, double scale, float* out) {
  thread_local std::vector<float> weights;
  weights.resize(kv_len + 16);
  const int64_t token_stride = kv_heads * dim, head_offset = (h / (heads / kv_heads)) * dim;
  const TokenRows keys{k_base, table, block_size, token_stride, head_offset};
  const TokenRows values{v_base, table, block_size, token_stride, head_offset};
  const float* q = query + h * dim;
  float* o = out + h * dim;
  const float scale_f = static_cast<float>(scale);
#if defined(__AVX512F__)
  switch (dim) {
    case 64: return attend_head<4>(q, keys, values, kv_len, scale_f, weights.data(), o);
    case 128: return attend_head<8>(q, keys, values, kv_len, scale_f, weights.data(), o);
    case 256: return attend_head<16>(q, keys, values, kv_len, scale_f, weights.data(), o);
    default: break;
  }
#endif
  attend_head_scalar(q, keys, values, kv_len, dim, scale_f, weights.data(), o);
}

// Calls with fewer multiply-adds of scores than this (a short context, a few rows) stay on
// the calling thread: a parallel region costs more than they do.
constexpr int64_t kParallelProducts = 1 << 18;

// Row r of key/value [rows, kv_heads, dim] into flat slot `slot` of a cache.
void write_token(const at::Tensor& flat, int64_t slot, const at::Tensor& source, int64_t r) {
  const int64_t width = flat.size(1) * flat.size(2);
  if (source.scalar_type() == flat.scalar_type() && source.stride(2) == 1 &&
      source.stride(1) == source.size(2)) {
    const int64_t bytes = flat.element_size();
    std::memcpy(static_cast<char*>(flat.data_ptr()) + slot * width * bytes,
                static_cast<const char*>(source.const_data_ptr()) + r * source.stride(0) * bytes,
                width * bytes);
  } else {
    flat.select(0, slot).copy_(source.select(0, r));
  }
}

// Rows of query [rows, heads, dim] (float32, contiguous) over the flat float32 caches
// [slots, kv_heads, dim]: row r attends to the first lengths[r] tokens of the blocks at
// tables[r], into output's row r. (row, head) items run on every thread once a call is worth
// a parallel region; a head's arithmetic is the same wherever it runs.
void attend_rows(const at::Tensor& query, const at::Tensor& k_flat, const at::Tensor& v_flat,
                 int64_t block_size, const std::vector<const int64_t*>& tables,
                 const std::vector<int64_t>& lengths, double scale, at::Tensor& output) {
  const int64_t rows = static_cast<int64_t>(lengths.size());
  const int64_t heads = query.size(1), dim = query.size(2), kv_heads = k_flat.size(1);
  const float* q_base = query.const_data_ptr<float>();
  const float* k_base = k_flat.const_data_ptr<float>();
  const float* v_base = v_flat.const_data_ptr<float>();
  float* out_base = output.data_ptr<float>();
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads;
      attend_direct(q_base + r * heads * dim, k_base, v_base, tables[r], lengths[r],
                    block_size, heads, kv_heads, dim, item % heads, scale,
                    out_base + r * heads * dim);
    }
  };
  int64_t tokens = 0;
  for (int64_t r = 0; r < rows; ++r) tokens += lengths[r];
  const int64_t items = rows * heads;
  if (tokens * heads * dim < kParallelProducts) {
    run(0, items);
  } else {
    const int64_t per_item = std::max<int64_t>(1, tokens * dim / rows);
    at::parallel_for(0, items, std::max<int64_t>(1, kParallelProducts / 4 / per_item), run);
  }
}

// The eager CPU backend's decodes (kernels/torch_ref.py, when the engine compiled its decode
// steps and so built this file): the step's keys and values are already in the caches
// [blocks, block, kv_heads, dim]; row r of query [rows, heads, dim] attends to the first
// kv_lens[r] (at most kDirectTokens) tokens of the blocks block_tables[r]. float32 only.
at::Tensor attend_decodes(const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& kv_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "attend_decodes: query [rows, heads, dim], caches [blocks, block, kv_heads, dim]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "attend_decodes: float32 query and caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "attend_decodes: contiguous caches");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && block_tables.size(0) == query.size(0) &&
                  kv_lens.numel() == query.size(0),
              "attend_decodes: int64 block_tables [rows, blocks] and kv_lens [rows]");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0,
              "attend_decodes: query heads are a multiple of the cache's, of the same size");
  const at::Tensor q = query.contiguous();
  const at::Tensor tables_t = block_tables.contiguous();
  const at::Tensor lengths_t = kv_lens.contiguous();
  const int64_t rows = q.size(0), block_size = k_cache.size(1), width = tables_t.size(1);
  std::vector<const int64_t*> tables(rows);
  std::vector<int64_t> lengths(lengths_t.data_ptr<int64_t>(),
                               lengths_t.data_ptr<int64_t>() + rows);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lengths[r] >= 1 && lengths[r] <= kDirectTokens &&
                    lengths[r] <= width * block_size,
                "attend_decodes: row ", r, " has ", lengths[r], " tokens (1 to ",
                kDirectTokens, ", within its block table)");
    tables[r] = tables_t.const_data_ptr<int64_t>() + r * width;
    for (int64_t b = 0; b < (lengths[r] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[r][b] >= 0 && tables[r][b] < k_cache.size(0), "attend_decodes: row ",
                  r, " names block ", tables[r][b], " of ", k_cache.size(0));
  }
  at::Tensor output = at::empty_like(q);
  attend_rows(q, k_cache.view({-1, k_cache.size(2), k_cache.size(3)}),
              v_cache.view({-1, v_cache.size(2), v_cache.size(3)}), block_size, tables, lengths,
              scale, output);
  return output;
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
    write_token(k_flat, slots[r], key, r);
    write_token(v_flat, slots[r], value, r);
  }
  // float32 throughout and short contexts: attend_direct (tests compare both paths).
  int64_t longest = 0;
  for (int64_t r = 0; r < with_kv; ++r) longest = std::max(longest, info[r][KV_LEN]);
  const bool direct = !force_sdpa && query.scalar_type() == at::kFloat &&
                      k_flat.scalar_type() == at::kFloat && v_flat.scalar_type() == at::kFloat &&
                      query.is_contiguous() && longest <= kDirectTokens;
  at::Tensor output = rows == 1 && with_kv == 1 ? at::Tensor() : at::zeros_like(query);
  if (direct && with_kv > 0) {
    if (!output.defined()) output = at::empty_like(query);
    std::vector<const int64_t*> tables(with_kv);
    std::vector<int64_t> lengths(with_kv);
    for (int64_t r = 0; r < with_kv; ++r) {
      tables[r] = blocks + info[r][BLOCK_START];
      lengths[r] = info[r][KV_LEN];
    }
    attend_rows(query, k_flat, v_flat, block_size, tables, lengths, scale, output);
    return output;
  }
  for (int64_t r = 0; r < with_kv; ++r) {
    const int64_t kv_len = info[r][KV_LEN];
    const int64_t* table = blocks + info[r][BLOCK_START];
    const int64_t num_blocks = (kv_len + block_size - 1) / block_size;
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
  m.def("attend_decodes(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor kv_lens, float scale) -> Tensor", &attend_decodes);
}

TORCH_LIBRARY_IMPL(slipstream, CPU, m) {
  m.impl("cpu_decode_attention", &cpu_decode_attention);
}
