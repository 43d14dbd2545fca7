// Quantized linear layers on x86 CPUs with AVX-512: slipstream::q4_linear (4-bit weights in
// groups, GGUF's Q4_0/Q4_1/Q4_K and --quantization int4) and slipstream::q8_linear (8-bit
// weights in groups, GGUF's Q8_0). cpu_quant_gemm.py defines the operators, packs the weights
// for them and builds this file at start-up (torch.utils.cpp_extension); where it does not
// build, or the CPU lacks AVX-512, the engine keeps ATen's packed int4 kernel.
//
// Why a kernel of our own. ATen's _weight_int4pack_mm_for_cpu turns every weight into a
// float32 and multiplies it in float32, so a one-row decode step of the default model is bound
// by arithmetic rather than by the memory it reads. Here 32 weights become bfloat16 in one or
// two integer instructions (kLowWord below) and one vdpbf16ps multiplies them (32 products,
// summed in float32).
//
// Three instruction sets. With AMX (Sapphire Rapids and later) the products are tdpbf16ps on
// the same bfloat16 words (see "AMX" below). With AVX-512 BF16 (Zen 4 and those Xeons) they
// are vdpbf16ps. Without it (Skylake-SP, Cascade Lake, Ice Lake: most cloud x86 machines before
// 2023), each weight becomes a float32 with one shift and one ternary-logic instruction and is
// multiplied by vfmadd231ps (see "float32 multiply-adds" below). The activations are the same
// bfloat16 values, and every product of a weight and a bfloat16 value is exact in float32, so
// the two paths differ only in the order and grouping of their float32 sums.
//
// Tiles of 16 output rows. A float32 vector's 16 lanes are 16 output rows: one vdpbf16ps takes
// two weights of each row against one broadcast pair of activations, so a group's scale (one
// per row and group) is a vector too, and costs one multiply-add per 16 rows and 32 inputs;
// no output needs a horizontal sum. A tile's weights are unpacked once per group and serve
// every activation row.
//
// The activations are rounded to bfloat16 first, as ATen's kernel does; products and sums are
// float32. A group's scale multiplies its partial sums, and its minimum the group's sum of
// activations. Each output's sums run in the same order whatever the number of rows, so a
// row's result does not depend on the batch it is in.
//
// Layouts (packed by cpu_quant_gemm.py; N padded to a multiple of 16 with zero rows, T = N/16
// tiles, S = K/32 slices of 32 inputs, G = K/group groups):
//   q4: weights uint8 [T, S, 4 loads, 32 words, 2 bytes]. In slice s, nibble p of word j of
//       load l is the weight of row j/2 and input 32 s + 2 (4 l + p) + j%2: each nibble plane
//       of a 64-byte load is 16 rows x 2 inputs, the operand of one vdpbf16ps.
//       scales, mins: float16 [T, G, 16]; w = q * scale + min, q in 0..15.
//   q8: weights uint8 [T, S, 8 loads, 32 words, 2 bytes] holding q + 128; byte b of word j
//       of load l is the weight of row j/2 and input 32 s + 2 (2 l + b) + j%2.
//       scales: float16 [T, G, 16]; w = q * scale.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SLIPSTREAM_QGEMM 1
#include <immintrin.h>
#if defined(__AVX512BF16__) && !defined(SLIPSTREAM_QGEMM_NO_BF16)
#define SLIPSTREAM_QGEMM_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SLIPSTREAM_QGEMM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif
#endif

namespace {

bool q_gemm_supported() {
#ifdef SLIPSTREAM_QGEMM
  return true;
#else
  return false;
#endif
}

#ifdef SLIPSTREAM_QGEMM_AMX
// Whether this process may use the AMX tiles: Linux hands out their 8 KB of register state
// only to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, Linux
// 5.16 and later). Asked once; where it is refused, the vdpbf16ps path serves.
bool amx_ready() {
  static const bool granted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

// On unless use_amx(false) (SLIPSTREAM_CPU_QUANT_KERNEL=avx512_bf16, and the kernel benchmark
// to time both paths in one process).
std::atomic<bool> amx_wanted{true};

bool amx_active() { return amx_wanted.load(std::memory_order_relaxed) && amx_ready(); }
#endif

// Whether AMX multiplies from now on: `enabled`, where the build and the CPU have it.
bool use_amx(bool enabled) {
#ifdef SLIPSTREAM_QGEMM_AMX
  amx_wanted.store(enabled, std::memory_order_relaxed);
  return amx_active();
#else
  (void)enabled;
  return false;
#endif
}

// Which products this build makes: "amx_bf16" (tdpbf16ps), "avx512_bf16" (vdpbf16ps),
// "avx512f" (vfmadd231ps on widened words) or "none".
std::string q_gemm_instructions() {
#if defined(SLIPSTREAM_QGEMM_AMX)
  return amx_active() ? "amx_bf16" : "avx512_bf16";
#elif defined(SLIPSTREAM_QGEMM_BF16)
  return "avx512_bf16";
#elif defined(SLIPSTREAM_QGEMM)
  return "avx512f";
#else
  return "none";
#endif
}

#ifdef SLIPSTREAM_QGEMM

constexpr int64_t kTile = 16;  // output rows per tile: the lanes of a float32 vector

#ifdef SLIPSTREAM_QGEMM_BF16
// An activation as the product instruction takes it: the bfloat16 bits.
using Activation = uint16_t;
#else
// An activation as the product instruction takes it: the bfloat16 value widened to float32.
using Activation = float;
#endif

// 16 float32 values rounded to bfloat16 (round to nearest even, as Tensor.to(torch.bfloat16)),
// in the low half of each 32-bit lane.
inline __m512i to_bfloat16(__m512 values) {
#ifdef SLIPSTREAM_QGEMM_BF16
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(values));
#else
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  // NaNs stay quiet NaNs rather than rounding into the exponent
  const __mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(_mm512_srli_epi32(rounded, 16), nan,
                               _mm512_or_si512(_mm512_srli_epi32(bits, 16),
                                               _mm512_set1_epi32(0x0040)));
#endif
}

// Activations rounded to bfloat16 and, per group, the float32 sum of the rounded values (for
// the minimum term), the rows padded with zeros to a multiple of `pad_to`. The buffers belong
// to the calling thread and are reused from call to call.
void round_rows(const at::Tensor& x, int64_t group, int64_t pad_to,
                std::vector<Activation>& rounded, std::vector<float>& sums) {
  const int64_t rows = x.size(0), width = x.size(1), groups = width / group;
  const int64_t padded = (rows + pad_to - 1) / pad_to * pad_to;
  rounded.resize(padded * width);
  std::fill(rounded.begin() + rows * width, rounded.end(), Activation{0});
  sums.resize(rows * groups);
  // 16 values (the bfloat16 bits in each 32-bit lane) as they are stored, and as float32
  auto store = [&](int64_t i, __m512i words) {
#ifdef SLIPSTREAM_QGEMM_BF16
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rounded.data() + i),
                        _mm512_cvtepi32_epi16(words));
#else
    _mm512_storeu_ps(rounded.data() + i, _mm512_castsi512_ps(_mm512_slli_epi32(words, 16)));
#endif
  };
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* source = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
    for (int64_t i = 0; i < rows * width; i += 16)
      store(i, _mm512_cvtepu16_epi32(
                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(source + i))));
  } else {  // width is a multiple of 32
    const float* source = x.const_data_ptr<float>();
    for (int64_t i = 0; i < rows * width; i += 16) store(i, to_bfloat16(_mm512_loadu_ps(source + i)));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const Activation* row = rounded.data() + r * width;
    for (int64_t g = 0; g < groups; ++g) {
      __m512 total = _mm512_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
#ifdef SLIPSTREAM_QGEMM_BF16
        const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
        total = _mm512_add_ps(total, _mm512_castsi512_ps(
                                         _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
#else
        total = _mm512_add_ps(total, _mm512_loadu_ps(row + k));
#endif
      }
      sums[r * groups + g] = _mm512_reduce_add_ps(total);
    }
  }
}

constexpr int kAndOr = 0xEA;  // ternary logic: (a & b) | c

// A row's 16 lanes += scale * (its four chains of partial sums) + coefficient * x_sum.
inline void add_group(float* lanes, __m512 scale, __m512 coefficient, const __m512 (&p)[4],
                      float x_sum) {
  __m512 total = _mm512_loadu_ps(lanes);
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3]));
  total = _mm512_fmadd_ps(scale, sum, total);
  total = _mm512_fmadd_ps(coefficient, _mm512_set1_ps(x_sum), total);
  _mm512_storeu_ps(lanes, total);
}

inline __m512 group_scale(const at::Half* scale16) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale16)));
}

#ifdef SLIPSTREAM_QGEMM_BF16

// The words of 4-bit values: a value v (0..15) under 0x4300 is bfloat16 128 + v, exactly,
// and under 0x4500 it is 16 (128 + v). So a shift and one ternary-logic instruction
// (v & 0xF | word) turn one nibble of each of 32 words into 32 bfloat16 weights, with no
// shuffle; the offset is undone by the group's coefficient (q4: min - 128 scale; q8:
// -2304 scale, since 16 (128 + h) + 128 + l = q + 2304 for the byte q + 128 = 16 h + l).
constexpr int16_t kLowWord = 0x4300;   // 128 + v
constexpr int16_t kHighWord = 0x4500;  // 16 (128 + v)

inline __m512i plane(__m512i shifted, __m512i nibble, __m512i word) {
  return _mm512_ternarylogic_epi32(shifted, nibble, word, kAndOr);
}

// acc += the two weights of each row (word 2 i: row i's even input, word 2 i + 1: its odd
// input) times the pair of activations.
inline __m512 dot(__m512 acc, __m512i weights, const Activation* pair) {
  int32_t bits;
  std::memcpy(&bits, pair, 4);
  return _mm512_dpbf16_ps(acc, (__m512bh)weights, (__m512bh)_mm512_set1_epi32(bits));
}

// One slice (32 inputs) of one tile as 16 vectors of bfloat16 words, vector p holding inputs
// 2p and 2p + 1 of the 16 rows. q8 slices are 32 vectors: high then low parts, alternating.
struct Q4Slice {
  static constexpr int kVectors = 16;
  static constexpr int64_t kBytes = 256;
  static constexpr float kOffset = -128.0f;
  static inline void unpack(const uint8_t* bytes, __m512i (&v)[kVectors]) {
    const __m512i nibble = _mm512_set1_epi16(0x000F), word = _mm512_set1_epi16(kLowWord);
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
      const __m512i w = _mm512_loadu_si512(bytes + 64 * l);
      v[4 * l] = plane(w, nibble, word);
      v[4 * l + 1] = plane(_mm512_srli_epi16(w, 4), nibble, word);
      v[4 * l + 2] = plane(_mm512_srli_epi16(w, 8), nibble, word);
      v[4 * l + 3] = _mm512_or_si512(_mm512_srli_epi16(w, 12), word);
    }
  }
  // Four chains of partial sums, pair p into chain p % 4.
  static inline void multiply(const __m512i (&v)[kVectors], const Activation* x,
                              __m512 (&p)[4]) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) p[i & 3] = dot(p[i & 3], v[i], x + 2 * i);
  }
  // The slice as tdpbf16ps's B operand (below): row p is vector p, 1 KB.
  static constexpr int kTiles = 1;
  static inline void to_tiles(const uint8_t* bytes, uint16_t* tiles) {
    __m512i v[kVectors];
    unpack(bytes, v);
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) _mm512_store_si512(tiles + 32 * p, v[p]);
  }
};

struct Q8Slice {
  static constexpr int kVectors = 32;
  static constexpr int64_t kBytes = 512;
  static constexpr float kOffset = -2304.0f;
  static inline void unpack(const uint8_t* bytes, __m512i (&v)[kVectors]) {
    const __m512i nibble = _mm512_set1_epi16(0x000F);
    const __m512i low = _mm512_set1_epi16(kLowWord), high = _mm512_set1_epi16(kHighWord);
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      const __m512i w = _mm512_loadu_si512(bytes + 64 * l);
      v[4 * l] = plane(_mm512_srli_epi16(w, 4), nibble, high);      // pair 2l, high part
      v[4 * l + 1] = plane(w, nibble, low);                          // pair 2l, low part
      v[4 * l + 2] = _mm512_or_si512(_mm512_srli_epi16(w, 12), high);  // pair 2l + 1
      v[4 * l + 3] = plane(_mm512_srli_epi16(w, 8), nibble, low);
    }
  }
  static inline void multiply(const __m512i (&v)[kVectors], const Activation* x,
                              __m512 (&p)[4]) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      p[i & 3] = dot(dot(p[i & 3], v[2 * i], x + 2 * i), v[2 * i + 1], x + 2 * i);
  }
  // Two B operands: the high parts' 16 pairs, then the low parts'.
  static constexpr int kTiles = 2;
  static inline void to_tiles(const uint8_t* bytes, uint16_t* tiles) {
    __m512i v[kVectors];
    unpack(bytes, v);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      _mm512_store_si512(tiles + 32 * i, v[2 * i]);
      _mm512_store_si512(tiles + 512 + 32 * i, v[2 * i + 1]);
    }
  }
};

// out[r, 16 t ..] for every activation row r, from tile t. acc holds the rows' 16 lanes.
template <class Slice>
void run_tile(const uint8_t* weights, const at::Half* scale16, const at::Half* min16,
              const Activation* x, const float* x_sums, int64_t rows, int64_t width,
              int64_t group, float* acc) {
  const int64_t slices_per_group = group / 32, groups = width / group;
  const __m512 offset = _mm512_set1_ps(Slice::kOffset);
  for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(acc + kTile * r, _mm512_setzero_ps());
  __m512i v[Slice::kVectors];
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 scale = group_scale(scale16 + kTile * g);
    const __m512 minimum = min16 == nullptr ? _mm512_setzero_ps() : group_scale(min16 + kTile * g);
    const __m512 coefficient = _mm512_fmadd_ps(offset, scale, minimum);
    if (slices_per_group == 1) {  // the slice stays in registers for every row
      Slice::unpack(weights + Slice::kBytes * g, v);
      for (int64_t r = 0; r < rows; ++r) {
        __m512 p[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
        Slice::multiply(v, x + r * width + 32 * g, p);
        add_group(acc + kTile * r, scale, coefficient, p, x_sums[r * groups + g]);
      }
    } else {  // groups of 64 or 128: slice by slice, each row's partial sums kept across them
      for (int64_t r = 0; r < rows; ++r) {
        __m512 p[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
        for (int64_t s = 0; s < slices_per_group; ++s) {
          const int64_t slice = g * slices_per_group + s;
          Slice::unpack(weights + Slice::kBytes * slice, v);
          Slice::multiply(v, x + r * width + 32 * slice, p);
        }
        add_group(acc + kTile * r, scale, coefficient, p, x_sums[r * groups + g]);
      }
    }
  }
}

#ifdef SLIPSTREAM_QGEMM_AMX

// AMX (Sapphire Rapids and later): one tdpbf16ps multiplies 16 activation rows by 32 inputs of
// 16 output rows, 8192 products where vdpbf16ps makes 32. The slice's bfloat16 words above are
// already its B operand (row p: the pairs 2p, 2p + 1 of 16 outputs), so they are stored to L1
// once per tile and group and loaded as a tile; the A operand is 16 rows of the rounded
// activations, loaded in place (past 16 rows, padded with zeros to a multiple of 16). The products
// are the same exact float32 products as vdpbf16ps's, summed inside the instruction. Every row
// count runs here, one row as 16, so a row's result still does not depend on its batch.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// `rows` activation rows per A and C tile: 16, or fewer when the whole batch is fewer (a
// decode step of one sequence loads and stores one row, not 16; the products per row are the
// same).
inline void configure_tiles(int rows) {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.rows[i] = i < 4 ? rows : 16;  // C in 0-1, A in 2-3; B in 4-7
    config.bytes_per_row[i] = 64;
  }
  _tile_loadconfig(&config);
}

// Groups two at a time, each with its own C, A and B tiles (0, 2, 4-5 and 1, 3, 6-7), so that
// one group's products run while the other's are stored and scaled: one tile's chain of
// store, load, multiply and store would otherwise leave the AMX unit idle most of the time.
template <class Slice, int kGroups>
inline void multiply_groups(const Activation* x, int64_t stride, const uint16_t* b,
                            int64_t first_slice, int64_t slices_per_group) {
  constexpr int kB = Slice::kTiles;
  _tile_zero(0);
  if constexpr (kGroups == 2) _tile_zero(1);
  for (int64_t s = 0; s < slices_per_group; ++s) {
    _tile_loadd(2, x + 32 * (first_slice + s), stride);
    _tile_loadd(4, b + 512 * kB * s, 64);
    _tile_dpbf16ps(0, 2, 4);
    if constexpr (kB == 2) {
      _tile_loadd(5, b + 512 * (kB * s + 1), 64);
      _tile_dpbf16ps(0, 2, 5);
    }
    if constexpr (kGroups == 2) {
      const uint16_t* b1 = b + 512 * kB * slices_per_group;
      _tile_loadd(3, x + 32 * (first_slice + slices_per_group + s), stride);
      _tile_loadd(6, b1 + 512 * kB * s, 64);
      _tile_dpbf16ps(1, 3, 6);
      if constexpr (kB == 2) {
        _tile_loadd(7, b1 + 512 * (kB * s + 1), 64);
        _tile_dpbf16ps(1, 3, 7);
      }
    }
  }
}

// Group g's weights (when there is one), from memory into L1 while earlier groups are
// multiplied: a one-row product streams its weights, and the AMX path's chain of stores and
// tile loads left it waiting for them (a one-sequence decode step: 15.0 ms without, 13.5-14.7
// ms with, on a 2-core Xeon with AMX).
template <class Slice>
inline void prefetch_group(const uint8_t* weights, int64_t g, int64_t groups,
                           int64_t slices_per_group) {
  if (g >= groups) return;
  const uint8_t* group_bytes = weights + Slice::kBytes * g * slices_per_group;
  for (int64_t line = 0; line < Slice::kBytes * slices_per_group; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(group_bytes + line), _MM_HINT_T0);
}

template <class Slice>
void run_tile_amx(const uint8_t* weights, const at::Half* scale16, const at::Half* min16,
                  const Activation* x, const float* x_sums, int64_t rows, int64_t width,
                  int64_t group, float* acc) {
  constexpr int kB = Slice::kTiles;
  const int64_t slices_per_group = group / 32, groups = width / group;
  const int64_t blocks = (rows + 15) / 16, stride = width * sizeof(Activation);
  // two groups' B operands (up to 4 slices each), twice: the next pair is unpacked while the
  // tiles still read this one
  alignas(64) uint16_t b[2][2 * 4 * kB * 512];
  alignas(64) float c[2][16 * kTile];
  const __m512 offset = _mm512_set1_ps(Slice::kOffset);
  for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(acc + kTile * r, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; g += 2) {
    const int pair = g == groups - 1 ? 1 : 2;
    uint16_t* operands = b[(g / 2) & 1];
    prefetch_group<Slice>(weights, g + 4, groups, slices_per_group);  // two pairs ahead
    prefetch_group<Slice>(weights, g + 5, groups, slices_per_group);
    for (int64_t s = 0; s < pair * slices_per_group; ++s)
      Slice::to_tiles(weights + Slice::kBytes * (g * slices_per_group + s),
                      operands + 512 * kB * s);
    for (int64_t block = 0; block < blocks; ++block) {
      const Activation* block_x = x + 16 * block * width;
      if (pair == 2)
        multiply_groups<Slice, 2>(block_x, stride, operands, g * slices_per_group,
                                  slices_per_group);
      else
        multiply_groups<Slice, 1>(block_x, stride, operands, g * slices_per_group,
                                  slices_per_group);
      _tile_stored(0, c[0], 64);
      if (pair == 2) _tile_stored(1, c[1], 64);
      const int64_t live = std::min<int64_t>(16, rows - 16 * block);
      for (int h = 0; h < pair; ++h) {
        const __m512 scale = group_scale(scale16 + kTile * (g + h));
        const __m512 minimum =
            min16 == nullptr ? _mm512_setzero_ps() : group_scale(min16 + kTile * (g + h));
        const __m512 coefficient = _mm512_fmadd_ps(offset, scale, minimum);
        for (int64_t r = 0; r < live; ++r) {
          const int64_t row = 16 * block + r;
          float* lanes = acc + kTile * row;
          __m512 total = _mm512_fmadd_ps(scale, _mm512_load_ps(c[h] + kTile * r),
                                         _mm512_loadu_ps(lanes));
          total = _mm512_fmadd_ps(coefficient, _mm512_set1_ps(x_sums[row * groups + g + h]),
                                  total);
          _mm512_storeu_ps(lanes, total);
        }
      }
    }
  }
}

#endif  // SLIPSTREAM_QGEMM_AMX

#else  // float32 multiply-adds

// Without vdpbf16ps a group's weights are widened to float32 once, into a buffer that stays in
// L1 (16 rows x up to 128 inputs: 8 KB), and every activation row multiplies them from there,
// four rows at a time so that each weight vector loaded serves four multiply-adds (one row
// alone multiplies them straight from registers, in the same order). A value placed in the
// mantissa under an exponent is an exact float: 0x41800000 | v << 19 is 16 + v for a nibble,
// 0x43800000 | u << 15 is 256 + u for a byte. So one shift and one ternary-logic instruction
// widen 16 weights; the offset (16 for q4, 256 + 128 = 384 for q8's stored q + 128) is undone
// by the group's coefficient, as in the bfloat16 path. The smaller offsets cancel less there
// than the bfloat16 words' 128 and 2304 do.

// put(n, shifted): the value under kMask in each lane of `shifted`, ORed into the float kMagic
// (exact), handed to use(n, floats).
template <int32_t kMask, int32_t kMagic, class Use>
struct ExactFloats {
  Use& use;
  inline void operator()(int n, __m512i shifted) const {
    use(n, _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
               shifted, _mm512_set1_epi32(kMask), _mm512_set1_epi32(kMagic), kAndOr)));
  }
};

// Slice s of a q4 tile -> use(n, 16 rows of input 32 s + n), n = 8 l + 2 p + e
// (nibble p of word 2 row + e of load l: bits 16 e + 4 p of the row's 32-bit lane).
struct Q4Slice {
  static constexpr int64_t kBytes = 256;
  static constexpr float kOffset = -16.0f;
  template <class Use>
  static inline void widen(const uint8_t* bytes, Use&& use) {
    const ExactFloats<0x00780000, 0x41800000, Use> put{use};  // 16 + v, v at bits 19..22
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {  // nibble at bit 16 e + 4 p -> bits 19..22
      const __m512i w = _mm512_loadu_si512(bytes + 64 * l);
      put(8 * l + 0, _mm512_slli_epi32(w, 19));
      put(8 * l + 1, _mm512_slli_epi32(w, 3));
      put(8 * l + 2, _mm512_slli_epi32(w, 15));
      put(8 * l + 3, _mm512_srli_epi32(w, 1));
      put(8 * l + 4, _mm512_slli_epi32(w, 11));
      put(8 * l + 5, _mm512_srli_epi32(w, 5));
      put(8 * l + 6, _mm512_slli_epi32(w, 7));
      put(8 * l + 7, _mm512_srli_epi32(w, 9));
    }
  }
};

// Slice s of a q8 tile -> use(n, 16 rows of input 32 s + n): byte b of word 2 row + e of load
// l (byte 2 e + b of the row's lane) is input 32 s + 4 l + 2 b + e.
struct Q8Slice {
  static constexpr int64_t kBytes = 512;
  static constexpr float kOffset = -384.0f;
  template <class Use>
  static inline void widen(const uint8_t* bytes, Use&& use) {
    const ExactFloats<0x007F8000, 0x43800000, Use> put{use};  // 256 + u, u at bits 15..22
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      const __m512i w = _mm512_loadu_si512(bytes + 64 * l);
      put(4 * l + 0, _mm512_slli_epi32(w, 15));  // byte 0: e = 0, b = 0
      put(4 * l + 2, _mm512_slli_epi32(w, 7));   // byte 1: e = 0, b = 1
      put(4 * l + 1, _mm512_srli_epi32(w, 1));   // byte 2: e = 1, b = 0
      put(4 * l + 3, _mm512_srli_epi32(w, 9));   // byte 3: e = 1, b = 1
    }
  }
};

// p[r][n % 4] += weights[n] * x[r][n] for n < inputs: R rows against one widened group. A
// row's chains and their order are the same whatever R, so its result is too.
template <int R>
inline void multiply_rows(const float* weights, int64_t inputs, const Activation* const* x,
                          __m512 (&p)[R][4]) {
  for (int64_t n = 0; n < inputs; n += 4) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512 w = _mm512_load_ps(weights + 16 * (n + c));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        p[r][c] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r][n + c]), p[r][c]);
    }
  }
}

template <int R>
inline void run_rows(const float* weights, int64_t group, const Activation* x, int64_t first,
                     int64_t width, int64_t g, __m512 scale, __m512 coefficient,
                     const float* x_sums, int64_t groups, float* acc) {
  const Activation* rows_x[R];
  __m512 p[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    rows_x[r] = x + (first + r) * width + group * g;
    for (int c = 0; c < 4; ++c) p[r][c] = _mm512_setzero_ps();
  }
  multiply_rows<R>(weights, group, rows_x, p);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    add_group(acc + kTile * (first + r), scale, coefficient, p[r],
              x_sums[(first + r) * groups + g]);
}

// Group g of all R rows (R < 4), each weight vector multiplied as it is widened: the same
// chains in the same order as run_rows.
template <class Slice, int R>
inline void run_direct(const uint8_t* weights, int64_t slices_per_group, const Activation* x,
                       int64_t width, int64_t g, __m512 scale, __m512 coefficient,
                       const float* x_sums, int64_t groups, float* acc) {
  const int64_t group = 32 * slices_per_group;
  __m512 p[R][4];
  const Activation* rows_x[R];
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) {
    rows_x[r] = x + r * width + group * g;
    for (int c = 0; c < 4; ++c) p[r][c] = _mm512_setzero_ps();
  }
  for (int64_t s = 0; s < slices_per_group; ++s)
    Slice::widen(weights + Slice::kBytes * (g * slices_per_group + s), [&](int n, __m512 w) {
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r)
        p[r][n & 3] = _mm512_fmadd_ps(w, _mm512_set1_ps(rows_x[r][32 * s + n]), p[r][n & 3]);
    });
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r)
    add_group(acc + kTile * r, scale, coefficient, p[r], x_sums[r * groups + g]);
}

// out[r, 16 t ..] for every activation row r, from tile t. acc holds the rows' 16 lanes.
template <class Slice>
void run_tile(const uint8_t* weights, const at::Half* scale16, const at::Half* min16,
              const Activation* x, const float* x_sums, int64_t rows, int64_t width,
              int64_t group, float* acc) {
  alignas(64) float widened[128 * kTile];
  const int64_t slices_per_group = group / 32, groups = width / group;
  const __m512 offset = _mm512_set1_ps(Slice::kOffset);
  for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(acc + kTile * r, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 scale = group_scale(scale16 + kTile * g);
    const __m512 minimum = min16 == nullptr ? _mm512_setzero_ps() : group_scale(min16 + kTile * g);
    const __m512 coefficient = _mm512_fmadd_ps(offset, scale, minimum);
    if (rows < 4) {  // up to three rows: multiplied as they are widened, from registers
      if (rows == 3)
        run_direct<Slice, 3>(weights, slices_per_group, x, width, g, scale, coefficient, x_sums,
                             groups, acc);
      else if (rows == 2)
        run_direct<Slice, 2>(weights, slices_per_group, x, width, g, scale, coefficient, x_sums,
                             groups, acc);
      else
        run_direct<Slice, 1>(weights, slices_per_group, x, width, g, scale, coefficient, x_sums,
                             groups, acc);
      continue;
    }
    for (int64_t s = 0; s < slices_per_group; ++s) {
      float* out = widened + 32 * kTile * s;
      Slice::widen(weights + Slice::kBytes * (g * slices_per_group + s),
                   [out](int n, __m512 w) { _mm512_store_ps(out + 16 * n, w); });
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      run_rows<4>(widened, group, x, r, width, g, scale, coefficient, x_sums, groups, acc);
    if (rows - r == 3)
      run_rows<3>(widened, group, x, r, width, g, scale, coefficient, x_sums, groups, acc);
    else if (rows - r == 2)
      run_rows<2>(widened, group, x, r, width, g, scale, coefficient, x_sums, groups, acc);
    else if (rows - r == 1)
      run_rows<1>(widened, group, x, r, width, g, scale, coefficient, x_sums, groups, acc);
  }
}

#endif  // SLIPSTREAM_QGEMM_BF16

// out [m, n] = x [m, k] times the weight, tiles of 16 rows split between threads.
template <class Slice>
void run_tiles(const at::Tensor& x, const uint8_t* weights, const at::Half* scale16,
               const at::Half* min16, int64_t group, int64_t n, float* out) {
  thread_local std::vector<Activation> rounded;
  thread_local std::vector<float> sums;
  const int64_t m = x.size(0), width = x.size(1), groups = width / group;
  const int64_t tiles = (n + kTile - 1) / kTile;
#ifdef SLIPSTREAM_QGEMM_AMX
  const bool amx = amx_active();
#else
  constexpr bool amx = false;
#endif
  // AMX blocks of 16 rows read zero rows past the batch; a batch of up to 16 sets its tiles to
  // its own row count (configure_tiles) and needs none
  round_rows(x, group, amx && m > 16 ? 16 : 1, rounded, sums);
  const Activation* xs = rounded.data();
  const float* ss = sums.data();
  const int64_t tile_bytes = Slice::kBytes * (width / 32);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> acc;
    acc.resize(kTile * m);
#ifdef SLIPSTREAM_QGEMM_AMX
    // per chunk: other libraries' kernels (oneDNN's) set tiles of their own in between
    if (amx) configure_tiles(static_cast<int>(std::min<int64_t>(m, 16)));
#endif
    for (int64_t t = begin; t < end; ++t) {
      const at::Half* tile_mins = min16 == nullptr ? nullptr : min16 + kTile * groups * t;
#ifdef SLIPSTREAM_QGEMM_AMX
      if (amx)
        run_tile_amx<Slice>(weights + tile_bytes * t, scale16 + kTile * groups * t, tile_mins,
                            xs, ss, m, width, group, acc.data());
      else
#endif
        run_tile<Slice>(weights + tile_bytes * t, scale16 + kTile * groups * t, tile_mins, xs,
                        ss, m, width, group, acc.data());
      const int64_t live = std::min(kTile, n - kTile * t);
      for (int64_t r = 0; r < m; ++r)
        std::memcpy(out + r * n + kTile * t, acc.data() + kTile * r, live * sizeof(float));
    }
#ifdef SLIPSTREAM_QGEMM_AMX
    if (amx) _tile_release();
#endif
  });
}

#endif  // SLIPSTREAM_QGEMM

void check_common(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& scales,
                  int64_t group, int64_t n, int64_t slice_bytes, const char* name) {
  TORCH_CHECK(q_gemm_supported(), name, ": built without AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": x is a contiguous [rows, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              ": x is float32 or bfloat16");
  TORCH_CHECK(n > 0 && weights.scalar_type() == at::kByte && weights.is_contiguous() &&
                  weights.numel() % (((n + 15) / 16) * slice_bytes) == 0,
              name, ": weights are packed uint8 for ", n, " outputs");
  const int64_t width = weights.numel() / (((n + 15) / 16) * slice_bytes) * 32;
  TORCH_CHECK(x.size(1) == width, name, ": x has ", x.size(1), " columns, the weight ", width);
  TORCH_CHECK((group == 32 || group == 64 || group == 128) && width % group == 0, name,
              ": groups of 32, 64 or 128 that divide the inputs");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == ((n + 15) / 16) * 16 * (width / group),
              name, ": scales are float16 [tiles, groups, 16]");
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& mins, int64_t group, int64_t out_features) {
  check_common(x, packed, scales, group, out_features, 256, "q4_linear");
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf &&
                  mins.is_contiguous(), "q4_linear: mins are like scales");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
#ifdef SLIPSTREAM_QGEMM
  if (x.size(0) > 0 && out_features > 0)
    run_tiles<Q4Slice>(x, packed.const_data_ptr<uint8_t>(), scales.const_data_ptr<at::Half>(),
                       mins.const_data_ptr<at::Half>(), group, out_features,
                       out.data_ptr<float>());
#endif
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                     int64_t group, int64_t out_features) {
  check_common(x, values, scales, group, out_features, 512, "q8_linear");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
#ifdef SLIPSTREAM_QGEMM
  if (x.size(0) > 0 && out_features > 0)
    run_tiles<Q8Slice>(x, values.const_data_ptr<uint8_t>(), scales.const_data_ptr<at::Half>(),
                       nullptr, group, out_features, out.data_ptr<float>());
#endif
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slipstream_cpu_quant, m) {
  m.def("supported() -> bool", &q_gemm_supported);
  m.def("instructions() -> str", &q_gemm_instructions);
  m.def("use_amx(bool enabled) -> bool", &use_amx);
}

TORCH_LIBRARY_IMPL(slipstream, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
}
