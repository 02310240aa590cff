// Greedy decoding's last step on CPU: per row of float32 logits [B, V], the token torch.argmax
// picks (the first index of the row's maximum) and its log-probability, logits[t] - logsumexp.
//
// In torch that is argmax plus logsumexp's five passes (max, subtract, exp, sum, log), about
// 1.6 ms for 32 rows of a 32K vocabulary on the 2-core dev VM; here it is one pass for the
// maximum, a scan to its first index and one pass summing exponentials, parallel over rows.
// `sampling.sample`'s torch code stays the reference.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "fast_exp.h"
#include "vec_width.h"

namespace {

// The row's maximum, ignoring NaNs (the caller finds them through the sum). Four vectors of
// running maxima in the `a > b ? a : b` form the compiler turns into vector max instructions
// (four independent chains hide the max's latency); an `omp simd reduction(max)` does not
// vectorise without -ffast-math.
float row_max(const float* row, int64_t vocab) {
  constexpr int kLanes = 4 * quiver_vec::VL;
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, -std::numeric_limits<float>::infinity());
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    for (int k = 0; k < kLanes; ++k) lanes[k] = lanes[k] > row[v + k] ? lanes[k] : row[v + k];
  }
  float best = lanes[0];
  for (int k = 1; k < kLanes; ++k) best = best > lanes[k] ? best : lanes[k];
  for (; v < vocab; ++v) best = best > row[v] ? best : row[v];
  return best;
}

// sum_v exp(row[v] - best), in blocks of kSumBlock terms summed in float32 lanes whose totals
// add up in float64. A block's float32 sum has at most kSumBlock - 1 roundings in a chain
// whatever the vector width, so the sum's relative error stays within kSumBlock * 2^-24 (plus
// fast_exp's 2 ulp per term) for any vocabulary, instead of growing with V / lanes: the bound
// `test_sampling.py` holds this kernel to on AVX2 and AVX-512 builds alike.
constexpr int64_t kSumBlock = 128;

double sum_exp(const float* row, int64_t vocab, float best) {
  double total = 0.0;
  for (int64_t start = 0; start < vocab; start += kSumBlock) {
    const int64_t stop = std::min(vocab, start + kSumBlock);
    float block = 0.f;
#pragma omp simd reduction(+ : block)
    for (int64_t v = start; v < stop; ++v) block += quiver::fast_exp(row[v] - best);
    total += block;
  }
  return total;
}

std::tuple<at::Tensor, at::Tensor> greedy_logprob(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous() && logits.size(1) > 0,
              "logits must be a contiguous float32 CPU [B, V] with V > 0");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  auto logprobs = at::empty({rows}, logits.options());
  const float* data = logits.data_ptr<float>();
  int64_t* token_data = tokens.data_ptr<int64_t>();
  float* logprob_data = logprobs.data_ptr<float>();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* row = data + b * vocab;
      const float best = row_max(row, vocab);
      const double sum = sum_exp(row, vocab, best);
      int64_t index = 0;
      if (std::isnan(sum) || std::isnan(best)) {
        // A NaN logit (or only NaNs and infinities): torch.argmax picks the first NaN.
        while (index < vocab && !std::isnan(row[index])) ++index;
        if (index == vocab) {  // no NaN after all: +inf and -inf only
          index = 0;
          while (index < vocab && !(row[index] == best)) ++index;
        }
        token_data[b] = index < vocab ? index : 0;
        logprob_data[b] = kNaN;
        continue;
      }
      while (index < vocab && !(row[index] == best)) ++index;
      token_data[b] = index;
      // logits[index] - (best + log(sum)) with logits[index] == best; torch's is NaN as well
      // when the maximum is infinite (all -inf, or a +inf logit).
      logprob_data[b] = std::isinf(best) ? kNaN : static_cast<float>(-std::log(sum));
    }
  });
  return {tokens, logprobs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("greedy_logprob(Tensor logits) -> (Tensor, Tensor)");
  m.impl("greedy_logprob", c10::DispatchKey::CPU, &greedy_logprob);
}
