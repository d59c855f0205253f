// LoRA for the tokens of a step that use an adapter, on CPU: for each token i whose adapter is s,
//
//   y[i] += scale_s * (x[i] A_s^T) Bt_s        (A_s [r_s, in], Bt_s [r_s, out]: B_s transposed)
//
// in one pass over those tokens only: tokens of the base model cost nothing, and the step pays
// one operator call per module whatever the mix of adapters, where the matmul form pays three
// on every token of the step (lora.py). Float accumulation; x's chunk of 16 features is loaded
// once for all r rows of A, and y's chunk of 16 outputs is read, updated and written once.
//
//   y       [tokens, out]   updated in place (rows may be strided, features contiguous)
//   x       [tokens, in]    the module's input (same dtype)
//   slots   [tokens / per_row] int64: the adapter of each row (index into a / bt / scales), or
//           -1 for the base model; token i belongs to row i / per_row (per_row > 1: padded
//           batches, whose rows hold several tokens)
//   a, bt   one entry per adapter, None where the adapter does not target this module
//
// Built with the other CPU kernels by text_generation_server/kernels/cpu_kernels.py as
// torch.ops.tgis_cpu.lora_apply.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "float_vectors.h"

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using namespace tgis_cpu;

struct Adapter {
  const void* a = nullptr;   // [rank, in]
  const void* bt = nullptr;  // [rank, out]
  int64_t rank = 0;
  float scale = 0.f;
};

template <typename T>
void apply(
    T* y, int64_t y_stride, const T* x, int64_t x_stride, const int64_t* slots, int64_t per_row, int64_t tokens,
    int64_t in, int64_t out, const std::vector<Adapter>& adapters, int64_t max_rank) {
  const int64_t in_vec = in - in % kLanes, out_vec = out - out % kLanes;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, max_rank * (in + out)));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<vf> partial(max_rank);
    std::vector<float> h(max_rank);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i / per_row];
      if (slot < 0 || adapters[slot].a == nullptr) continue;
      const Adapter& ad = adapters[slot];
      const T* a = static_cast<const T*>(ad.a);
      const T* bt = static_cast<const T*>(ad.bt);
      const int64_t rank = ad.rank;
      const T* xi = x + i * x_stride;
      // h = scale * A x: each chunk of x feeds every row of A
      std::fill(partial.begin(), partial.begin() + rank, vf{});
      for (int64_t j = 0; j < in_vec; j += kLanes) {
        const vf xv = load(xi + j);
        for (int64_t k = 0; k < rank; ++k) partial[k] += xv * load(a + k * in + j);
      }
      for (int64_t k = 0; k < rank; ++k) {
        float total = sum(partial[k]);
        for (int64_t j = in_vec; j < in; ++j) total += scalar(xi[j]) * scalar(a[k * in + j]);
        h[k] = total * ad.scale;
      }
      // y += h Bt, one chunk of outputs at a time
      T* yi = y + i * y_stride;
      for (int64_t j = 0; j < out_vec; j += kLanes) {
        vf acc = load(yi + j);
        for (int64_t k = 0; k < rank; ++k) acc += h[k] * load(bt + k * out + j);
        store(yi + j, acc);
      }
      for (int64_t j = out_vec; j < out; ++j) {
        float acc = scalar(yi[j]);
        for (int64_t k = 0; k < rank; ++k) acc += h[k] * scalar(bt[k * out + j]);
        yi[j] = static_cast<T>(acc);
      }
    }
  });
}

void lora_apply(
    at::Tensor& y, const at::Tensor& x, const at::Tensor& slots, int64_t per_row,
    const c10::List<std::optional<at::Tensor>>& a, const c10::List<std::optional<at::Tensor>>& bt,
    at::ArrayRef<double> scales) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "y and x must be [tokens, features]");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "features must be contiguous");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "y and x dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "slots: int64 [rows]");
  TORCH_CHECK(per_row > 0 && slots.size(0) * per_row == x.size(0), "slots * per_row must equal the tokens");
  TORCH_CHECK(a.size() == bt.size() && a.size() == scales.size(), "one A, Bt and scale per adapter");
  const int64_t in = x.size(1), out = y.size(1);
  std::vector<Adapter> adapters(a.size());
  int64_t max_rank = 0;
  for (size_t s = 0; s < a.size(); ++s) {
    const std::optional<at::Tensor> as = a.get(s), bs = bt.get(s);
    TORCH_CHECK(as.has_value() == bs.has_value(), "adapter ", s, ": A and Bt must both be given or both None");
    if (!as.has_value()) continue;
    TORCH_CHECK(as->scalar_type() == x.scalar_type() && bs->scalar_type() == x.scalar_type(),
                "adapter ", s, ": dtype differs from x");
    TORCH_CHECK(as->is_contiguous() && bs->is_contiguous(), "adapter ", s, ": A and Bt must be contiguous");
    TORCH_CHECK(as->dim() == 2 && bs->dim() == 2 && as->size(1) == in && bs->size(1) == out &&
                    as->size(0) == bs->size(0),
                "adapter ", s, ": A must be [rank, in] and Bt [rank, out]");
    adapters[s] = Adapter{as->data_ptr(), bs->data_ptr(), as->size(0), static_cast<float>(scales[s])};
    max_rank = std::max(max_rank, as->size(0));
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < slots.size(0); ++r)
    TORCH_CHECK(slot[r] < static_cast<int64_t>(adapters.size()), "slot ", slot[r], " names no adapter");
  if (max_rank == 0) return;
  auto run = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    apply<T>(y.data_ptr<T>(), y.stride(0), x.data_ptr<T>(), x.stride(0), slot, per_row, x.size(0), in, out,
             adapters, max_rank);
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "lora_apply: float32, bfloat16 or float16, not ", x.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tgis_cpu, m) {
  m.def(
      "lora_apply(Tensor(a!) y, Tensor x, Tensor slots, int per_row, Tensor?[] a, Tensor?[] bt, "
      "float[] scales) -> ()");
}

TORCH_LIBRARY_IMPL(tgis_cpu, CPU, m) { m.impl("lora_apply", &lora_apply); }
