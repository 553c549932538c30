#include "server/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "server/util/absl_string_view.h"

namespace ttt {
namespace {

// SplitMix64: a counter-based generator, so draw number `step` needs no earlier state.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double UniformDraw(uint64_t seed, uint64_t step) {
  return static_cast<double>(Mix(Mix(seed) ^ step) >> 11) * 0x1.0p-53;  // [0, 1)
}

float LogSoftmaxAt(std::span<const float> logits, int32_t id) {
  const float max = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float v : logits) sum += std::exp(double(v) - max);
  return static_cast<float>(double(logits[id]) - max - std::log(sum));
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& p) {
  auto bad = [](std::string_view field, float value, std::string_view rule) {
    return absl::InvalidArgumentError(
        absl::StrCat(AbslView(field), " = ", value, ": ", AbslView(rule)));
  };
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature)) {
    return bad("temperature", p.temperature, "must be finite and >= 0");
  }
  if (p.top_k < 0) return bad("top_k", p.top_k, "must be >= 0 (0: no limit)");
  if (!(p.top_p > 0 && p.top_p <= 1)) return bad("top_p", p.top_p, "must be in (0, 1]");
  if (!(p.min_p >= 0 && p.min_p <= 1)) return bad("min_p", p.min_p, "must be in [0, 1]");
  if (!(p.repetition_penalty > 0) || !std::isfinite(p.repetition_penalty)) {
    return bad("repetition_penalty", p.repetition_penalty, "must be finite and > 0");
  }
  if (!std::isfinite(p.presence_penalty)) {
    return bad("presence_penalty", p.presence_penalty, "must be finite");
  }
  if (!std::isfinite(p.frequency_penalty)) {
    return bad("frequency_penalty", p.frequency_penalty, "must be finite");
  }
  return absl::OkStatus();
}

SampledToken SampleToken(std::span<const float> logits, const SamplingParams& p,
                         std::span<const int32_t> prompt, std::span<const int32_t> output,
                         uint64_t step) {
  const int32_t vocab = static_cast<int32_t>(logits.size());
  // A NaN logit (a broken model) ranks below every number, so the sort below stays well defined.
  std::vector<float> scores(logits.size());
  std::transform(logits.begin(), logits.end(), scores.begin(), [](float l) {
    return std::isnan(l) ? -std::numeric_limits<float>::infinity() : l;
  });
  auto in_vocab = [&](int32_t id) { return id >= 0 && id < vocab; };

  if (p.repetition_penalty != 1.0f) {
    std::vector<bool> seen(vocab, false);
    for (auto tokens : {prompt, output}) {
      for (int32_t id : tokens) {
        if (!in_vocab(id) || seen[id]) continue;
        seen[id] = true;
        scores[id] = scores[id] > 0 ? scores[id] / p.repetition_penalty
                                    : scores[id] * p.repetition_penalty;
      }
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    absl::flat_hash_map<int32_t, int32_t> counts;
    for (int32_t id : output) {
      if (in_vocab(id)) ++counts[id];
    }
    for (auto [id, count] : counts) {
      scores[id] -= p.frequency_penalty * count + p.presence_penalty;
    }
  }

  const bool truncates = (p.top_k > 0 && p.top_k < vocab) || p.min_p > 0.0f || p.top_p < 1.0f;
  int32_t chosen;
  if (p.temperature == 0.0f || p.top_k == 1) {
    chosen = static_cast<int32_t>(std::max_element(scores.begin(), scores.end()) - scores.begin());
  } else if (!truncates) {
    // Every token is kept: no ranking needed, the draw walks the ids in order.
    chosen = static_cast<int32_t>(std::max_element(scores.begin(), scores.end()) - scores.begin());
    std::vector<double> probs(vocab);
    double total = 0;
    for (int32_t id = 0; id < vocab; ++id) {
      probs[id] = std::exp(double(scores[id] - scores[chosen]) / p.temperature);
      total += probs[id];
    }
    double target = UniformDraw(p.seed, step) * total;
    for (int32_t id = 0; id < vocab; ++id) {
      target -= probs[id];
      if (target < 0) {
        chosen = id;
        break;
      }
    }
  } else {
    // Candidates by decreasing tempered score (l − top)·(1/T) in float, as the GPU sampler ranks
    // them, so that both keep the same tokens where rounding makes distinct logits tie (ties:
    // lower id first, so the order is deterministic). A threshold keeps every token tied with
    // the last one it keeps, so which of equal tokens stay never depends on their ids: as the GPU
    // sampler does, and as top-k does in Hugging Face's and vLLM's samplers, which also compare
    // scores after temperature.
    const float top = *std::max_element(scores.begin(), scores.end());
    const float inv_t = 1.0f / p.temperature;
    std::vector<float> ranks(vocab);
    std::transform(scores.begin(), scores.end(), ranks.begin(), [&](float score) {
      const float tempered = (score - top) * inv_t;
      return std::isnan(tempered) ? -std::numeric_limits<float>::infinity() : tempered;
    });
    std::vector<int32_t> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    int32_t keep = p.top_k > 0 ? std::min(p.top_k, vocab) : vocab;
    std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), [&](int32_t a, int32_t b) {
      return ranks[a] != ranks[b] ? ranks[a] > ranks[b] : a < b;
    });
    // The rest of the k-th rank's ties, in id order: all come after the ties partial_sort kept.
    const float kth = ranks[ids[keep - 1]];
    const auto tied_end =
        std::partition(ids.begin() + keep, ids.end(), [&](int32_t id) { return ranks[id] == kth; });
    std::sort(ids.begin() + keep, tied_end);
    keep = static_cast<int32_t>(tied_end - ids.begin());
    ids.resize(keep);
    std::vector<double> probs(keep);
    double total = 0;
    for (int32_t i = 0; i < keep; ++i) {
      probs[i] = std::exp(double(scores[ids[i]] - scores[ids[0]]) / p.temperature);
      total += probs[i];
    }
    // min_p against the most likely token, then the top-p nucleus; the first candidate stays.
    int32_t kept = keep;
    for (int32_t i = 1; i < kept; ++i) {
      if (probs[i] < p.min_p * probs[0]) kept = i;
    }
    double mass = 0;
    for (int32_t i = 0; i < kept; ++i) {
      mass += probs[i] / total;
      if (mass >= p.top_p) {
        const int32_t last = i;
        while (i + 1 < kept && ranks[ids[i + 1]] == ranks[ids[last]]) ++i;
        kept = i + 1;
        break;
      }
    }
    // The draw walks the kept tokens in id order, as the GPU sampler does, so both backends pick
    // the same token for the same seed.
    std::vector<std::pair<int32_t, double>> by_id;
    double kept_total = 0;
    for (int32_t i = 0; i < kept; ++i) {
      by_id.push_back({ids[i], probs[i]});
      kept_total += probs[i];
    }
    std::sort(by_id.begin(), by_id.end());
    double target = UniformDraw(p.seed, step) * kept_total;
    chosen = ids[0];  // If rounding leaves the target past the end: the most likely token.
    for (const auto& [id, prob] : by_id) {
      target -= prob;
      if (target < 0) {
        chosen = id;
        break;
      }
    }
  }
  return {chosen, LogSoftmaxAt(logits, chosen)};
}

}  // namespace ttt
