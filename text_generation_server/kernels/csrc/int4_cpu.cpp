// The product of quantization/int4.py's Int4Linear for calls with more rows than torch's int4
// kernel serves well (prompts) on CPU: its 4-bit weights unpacked to the model's dtype a slice of
// output rows at a time, in one pass that reads each packed byte once and writes each weight once
// (Int4Linear.unpacked's tensor form takes five passes), each slice multiplied in turn.
//
//   packed        [padded, in / 2] uint8 in the layout of torch's CPU int4 kernel
//                 (_convert_weight_to_int4pack_for_cpu): per block of 64 output rows, input
//                 channel k's 32 bytes hold row i's value in the low nibble of byte i and row
//                 32 + i's in the high nibble (i < 32)
//   scale_offset  [groups, padded, 2] (scale, offset) of each group and output row, model dtype
//   -> [out_features, in] model dtype: (value - 8) * scale + offset, rounded once
//
// Blocks and tiles of 64 input channels run in parallel; a tile is built in float in a buffer
// that stays in L1 and written out row by row. Built with the other CPU kernels by
// text_generation_server/kernels/cpu_kernels.py as torch.ops.tgis_cpu.int4_linear_unpacked.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kBlock = 64;  // output rows per block of the packed layout
constexpr int64_t kTile = 64;   // input channels per tile

// Rows [first, last) of the weights into `out` (row `first` at out[0]); `first` is a multiple of 64.
template <typename T>
void unpack(const uint8_t* packed, const T* scale_offset, T* out, int64_t first, int64_t last, int64_t padded,
            int64_t in, int64_t group) {
  const int64_t blocks = (last - first + kBlock - 1) / kBlock, tiles = (in + kTile - 1) / kTile;
  at::parallel_for(0, blocks * tiles, 1, [&](int64_t begin, int64_t end) {
    float tile[kBlock][kTile];
    float scale[kBlock], offset[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = first / kBlock + task / tiles, k0 = (task % tiles) * kTile, k1 = std::min(in, k0 + kTile);
      const uint8_t* bytes = packed + block * in * (kBlock / 2);
      int64_t loaded = -1;  // the group whose scales are in `scale` / `offset`
      for (int64_t k = k0; k < k1; ++k) {
        if (k / group != loaded) {
          loaded = k / group;
          const T* so = scale_offset + (loaded * padded + block * kBlock) * 2;
          for (int64_t i = 0; i < kBlock; ++i) {
            scale[i] = static_cast<float>(so[2 * i]);
            offset[i] = static_cast<float>(so[2 * i + 1]);
          }
        }
        const uint8_t* b = bytes + k * (kBlock / 2);
        const int64_t column = k - k0;
        for (int64_t i = 0; i < kBlock / 2; ++i) {
          tile[i][column] = static_cast<float>((b[i] & 15) - 8) * scale[i] + offset[i];
          const int64_t j = i + kBlock / 2;
          tile[j][column] = static_cast<float>((b[i] >> 4) - 8) * scale[j] + offset[j];
        }
      }
      const int64_t rows = std::min(kBlock, last - block * kBlock);
      for (int64_t i = 0; i < rows; ++i) {
        T* row = out + (block * kBlock + i - first) * in;
        for (int64_t k = k0; k < k1; ++k) row[k] = static_cast<T>(tile[i][k - k0]);
      }
    }
  });
}

void check(const at::Tensor& packed, const at::Tensor& scale_offset, int64_t group_size, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed: contiguous [padded, in / 2] uint8");
  const int64_t padded = packed.size(0), in = packed.size(1) * 2;
  TORCH_CHECK(padded % kBlock == 0 && out_features <= padded, "packed rows come in blocks of 64");
  TORCH_CHECK(group_size > 0 && in % group_size == 0, "groups must tile the input channels");
  TORCH_CHECK(scale_offset.is_contiguous() && scale_offset.dim() == 3 && scale_offset.size(0) == in / group_size &&
                  scale_offset.size(1) == padded && scale_offset.size(2) == 2,
              "scale_offset: contiguous [groups, padded, 2]");
}

// x [rows, in] (the model's dtype, the layer's channel order) times the unpacked weights, plus
// bias: the weights unpacked a slice of output rows (about kSliceBytes) at a time into one
// buffer, each slice's product written to its rows of the transposed output. A large layer's
// whole unpacked matrix is a fresh allocation each call, paid in page faults and memory traffic:
// on a 2-core Xeon with AMX, 8192 x 2048 in bf16, 64 rows took 5.9 ms in 8 MB slices against
// 15.4 ms unpacking it whole (512 rows: 20.6 vs 23.6 ms; slices of 256 KB - 4 MB were slower).
constexpr int64_t kSliceBytes = 8 << 20;

at::Tensor int4_linear_unpacked(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_offset,
                                int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias) {
  check(packed, scale_offset, group_size, out_features);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == scale_offset.scalar_type() && x.size(1) == packed.size(1) * 2,
              "x: [rows, in] in the scales' dtype");
  const int64_t padded = packed.size(0), in = packed.size(1) * 2;
  const int64_t slice = std::max<int64_t>(kBlock, kSliceBytes / (in * x.element_size()) / kBlock * kBlock);
  at::Tensor buffer = at::empty({std::min(slice, out_features), in}, scale_offset.options());
  at::Tensor transposed = at::empty({out_features, x.size(0)}, x.options());  // slices are its rows
  const at::Tensor xt = x.t();
  for (int64_t first = 0; first < out_features; first += slice) {
    const int64_t last = std::min(out_features, first + slice);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int4_linear_unpacked", [&] {
      unpack<scalar_t>(packed.data_ptr<uint8_t>(), scale_offset.data_ptr<scalar_t>(), buffer.data_ptr<scalar_t>(),
                       first, last, padded, in, group_size);
    });
    at::Tensor rows = transposed.narrow(0, first, last - first);
    at::mm_out(rows, buffer.narrow(0, 0, last - first), xt);
  }
  at::Tensor y = transposed.t().contiguous();
  if (bias.has_value()) y.add_(*bias);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgis_cpu, m) {
  m.def(
      "int4_linear_unpacked(Tensor x, Tensor packed, Tensor scale_offset, int group_size, int out_features, "
      "Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tgis_cpu, CPU, m) {
  m.impl("int4_linear_unpacked", &int4_linear_unpacked);
}
