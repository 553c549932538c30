#include "server/engine/cpu_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_ops.h"
#include "server/engine/state_codec.h"
#include "server/util/absl_string_view.h"
#include "server/util/status_macros.h"

namespace ttt {
namespace {

namespace cpu = kernels::cpu;

// The inner LayerNorm and PostLN use a fixed epsilon (spec §3.5, §3.8); RMSNorms use the config's.
constexpr float kLayerNormEps = 1e-6f;

std::string TttTensor(std::string_view name) { return absl::StrCat(kTttBlock, AbslView(name)); }

}  // namespace

CpuEngine::CpuEngine(std::shared_ptr<const Model> model, CpuEngineOptions options)
    : model_(std::move(model)),
      options_(options),
      layout_(model_->config),
      fresh_state_(FreshState(model_->config, model_->weights, layout_)) {
  const ModelConfig& c = model_->config;
  const ModelWeights& w = model_->weights;
  embedding_ = w.Data("model.embed_tokens.weight");
  final_norm_ = w.Data("model.norm.weight");
  lm_head_ = w.Data("lm_head.weight");
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    auto get = [&](std::string_view suffix) { return w.LayerData(i, suffix); };
    auto ttt = [&](std::string_view name) { return get(TttTensor(name)); };
    LayerWeights& l = layers_.emplace_back();
    if (c.pre_conv) {
      l.conv_norm = get("conv.norm.weight");
      l.conv_w = get("conv.conv.weight");
      l.conv_b = get("conv.conv.bias");
    }
    l.seq_norm = get("seq_norm.weight");
    l.q_proj = ttt("q_proj.weight");
    if (c.share_qk) {
      l.conv_q_w = ttt("conv_q.weight");
      l.conv_q_b = ttt("conv_q.bias");
      l.conv_k_w = ttt("conv_k.weight");
      l.conv_k_b = ttt("conv_k.bias");
    } else {
      l.k_proj = ttt("k_proj.weight");
    }
    l.v_proj = ttt("v_proj.weight");
    l.o_proj = ttt("o_proj.weight");
    if (c.use_gate) l.g_proj = ttt("g_proj.weight");
    l.lr_w = ttt("learnable_ttt_lr_weight");
    l.lr_b = ttt("learnable_ttt_lr_bias");
    l.ttt_norm_w = ttt("ttt_norm_weight");
    l.ttt_norm_b = ttt("ttt_norm_bias");
    l.post_norm_w = ttt("post_norm.weight");
    l.post_norm_b = ttt("post_norm.bias");
    l.ffn_norm = get("ffn_norm.weight");
    l.gate_proj = get("mlp.gate_proj.weight");
    l.up_proj = get("mlp.up_proj.weight");
    l.down_proj = get("mlp.down_proj.weight");
    l.tau = WindowStepScales(c, w, i);
  }
}

absl::StatusOr<SequenceSlot> CpuEngine::AddSequence(Sequence sequence) {
  if (options_.max_sequences > 0 && live_sequences_ >= options_.max_sequences) {
    return absl::ResourceExhaustedError(
        absl::StrCat("all ", options_.max_sequences, " sequence slots are in use"));
  }
  SequenceSlot slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<SequenceSlot>(slots_.size());
    slots_.emplace_back();
  }
  slots_[slot] = std::make_unique<Sequence>(std::move(sequence));
  ++live_sequences_;
  return slot;
}

absl::StatusOr<CpuEngine::Sequence*> CpuEngine::Find(SequenceSlot slot, std::string_view field) {
  if (slot < 0 || slot >= static_cast<SequenceSlot>(slots_.size()) || slots_[slot] == nullptr) {
    return absl::NotFoundError(absl::StrCat(AbslView(field), ": no sequence in slot ", slot));
  }
  return slots_[slot].get();
}

absl::StatusOr<const CpuEngine::Sequence*> CpuEngine::Find(SequenceSlot slot,
                                                           std::string_view field) const {
  return const_cast<CpuEngine*>(this)->Find(slot, field);
}

absl::StatusOr<SequenceSlot> CpuEngine::CreateSequence() {
  return AddSequence(Sequence{fresh_state_, 0});
}

absl::Status CpuEngine::ReleaseSequence(SequenceSlot slot) {
  TTT_RETURN_IF_ERROR(Find(slot, "slot").status());
  slots_[slot].reset();
  free_slots_.push_back(slot);
  --live_sequences_;
  return absl::OkStatus();
}

absl::StatusOr<SequenceSlot> CpuEngine::ForkSequence(SequenceSlot source) {
  TTT_ASSIGN_OR_RETURN(const Sequence* original, Find(source, "source"));
  return AddSequence(*original);
}

absl::StatusOr<int64_t> CpuEngine::SequenceLength(SequenceSlot slot) const {
  TTT_ASSIGN_OR_RETURN(const Sequence* sequence, Find(slot, "slot"));
  return sequence->length;
}

absl::StatusOr<std::string> CpuEngine::SaveSequence(SequenceSlot slot) const {
  TTT_ASSIGN_OR_RETURN(const Sequence* sequence, Find(slot, "slot"));
  return EncodeState({model_->weights.fingerprint(), model_->name}, sequence->length,
                     sequence->state);
}

absl::StatusOr<SequenceSlot> CpuEngine::RestoreSequence(std::string_view bytes) {
  TTT_ASSIGN_OR_RETURN(DecodedState decoded,
                       DecodeState(bytes, {model_->weights.fingerprint(), model_->name},
                                   layout_.total_floats()));
  return AddSequence(Sequence{std::move(decoded.state), decoded.length});
}

absl::Status CpuEngine::Validate(std::span<const SequenceChunk> batch, LogitsFor which) const {
  return ValidateBatch(batch, which, model_->config.vocab_size, [this](SequenceSlot slot) {
    return slot >= 0 && slot < static_cast<SequenceSlot>(slots_.size()) && slots_[slot] != nullptr;
  });
}

absl::Status CpuEngine::Forward(std::span<const SequenceChunk> batch, LogitsFor which,
                                std::vector<float>* logits) {
  if (default_step_in_flight()) return StepInFlightError();
  TTT_RETURN_IF_ERROR(Validate(batch, which));
  const ModelConfig& c = model_->config;
  const int64_t D = c.hidden_size, V = c.vocab_size;

  std::vector<Segment> segments;
  int64_t rows = 0;
  for (const SequenceChunk& chunk : batch) {
    const int64_t n = static_cast<int64_t>(chunk.tokens.size());
    segments.push_back({slots_[chunk.slot].get(), rows, n});
    rows += n;
  }

  // Embedding, then the blocks over all tokens of the batch stacked as rows.
  std::vector<float> h(rows * D);
  int64_t row = 0;
  for (const SequenceChunk& chunk : batch) {
    for (int32_t token : chunk.tokens) {
      std::memcpy(&h[row++ * D], embedding_ + int64_t{token} * D, D * sizeof(float));
    }
  }
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    ForwardLayer(layer, segments, rows, h);
  }
  for (const Segment& segment : segments) segment.sequence->length += segment.count;

  if (which == LogitsFor::kNone) return absl::OkStatus();
  std::vector<int64_t> out_rows;
  if (which == LogitsFor::kEveryToken) {
    for (int64_t r = 0; r < rows; ++r) out_rows.push_back(r);
  } else {
    for (const Segment& segment : segments) out_rows.push_back(segment.row + segment.count - 1);
  }
  const int64_t n = static_cast<int64_t>(out_rows.size());
  std::vector<float> selected(n * D), normed(n * D);
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(&selected[i * D], &h[out_rows[i] * D], D * sizeof(float));
  }
  cpu::RmsNorm(selected.data(), n, D, final_norm_, c.rms_norm_eps, normed.data());
  logits->resize(n * V);
  cpu::Linear(normed.data(), n, D, lm_head_, V, logits->data());
  return absl::OkStatus();
}

absl::Status CpuEngine::ForwardAndSample(std::span<const SequenceChunk> batch,
                                         std::span<const SamplingParams> sampling,
                                         std::vector<SampledToken>* tokens) {
  TTT_RETURN_IF_ERROR(ValidateBatchSampling(batch, sampling));
  std::vector<float> logits;
  TTT_RETURN_IF_ERROR(Forward(batch, LogitsFor::kLastToken, &logits));
  const int64_t V = model_->config.vocab_size;
  tokens->clear();
  for (size_t b = 0; b < batch.size(); ++b) {
    tokens->push_back(SampleToken(std::span(logits).subspan(b * V, V), sampling[b], {}, {},
                                  slots_[batch[b].slot]->length));
  }
  return absl::OkStatus();
}

void CpuEngine::ForwardLayer(int64_t layer, std::span<const Segment> segments, int64_t rows,
                             std::vector<float>& h) {
  const ModelConfig& c = model_->config;
  const LayerWeights& w = layers_[layer];
  const int64_t D = c.hidden_size, I = c.intermediate_size, nh = c.num_attention_heads;
  const int64_t f = c.head_dim(), f1 = c.inner_width(), K = c.mini_batch_size;
  const int64_t ck = c.conv_kernel;
  const float rms_eps = static_cast<float>(c.rms_norm_eps);
  const bool mlp = c.ttt_layer_type == TttLayerType::kMlp;
  auto state_of = [&](const Segment& s) {
    return s.sequence->state.data() + layout_.layer_offset(layer);
  };
  // Causal conv over each segment, continuing (and then advancing) that sequence's history.
  auto conv = [&](const float* in, const float* cw, const float* cb, size_t history_offset,
                  float* out) {
    for (const Segment& s : segments) {
      cpu::CausalConv(in + s.row * D, s.count, D, cw, cb, ck, state_of(s) + history_offset,
                      out + s.row * D);
    }
  };
  auto advance_history = [&](const float* in, size_t history_offset) {
    for (const Segment& s : segments) {
      cpu::AdvanceConvHistory(in + s.row * D, s.count, D, ck, state_of(s) + history_offset);
    }
  };
  auto add_into_h = [&](const std::vector<float>& delta) {
    for (int64_t i = 0; i < rows * D; ++i) h[i] += delta[i];
  };

  std::vector<float> x(rows * D), tmp(rows * D);
  if (c.pre_conv) {
    cpu::RmsNorm(h.data(), rows, D, w.conv_norm, rms_eps, x.data());
    conv(x.data(), w.conv_w, w.conv_b, layout_.conv_pre, tmp.data());
    advance_history(x.data(), layout_.conv_pre);
    add_into_h(tmp);
  }

  // The TTT layer's inputs (spec §3.2–3.4).
  cpu::RmsNorm(h.data(), rows, D, w.seq_norm, rms_eps, x.data());
  std::vector<float> q(rows * D), k(rows * D), v(rows * D);
  if (c.share_qk) {
    cpu::Linear(x.data(), rows, D, w.q_proj, D, tmp.data());
    conv(tmp.data(), w.conv_q_w, w.conv_q_b, layout_.conv_qk, q.data());
    conv(tmp.data(), w.conv_k_w, w.conv_k_b, layout_.conv_qk, k.data());
    advance_history(tmp.data(), layout_.conv_qk);
  } else {
    cpu::Linear(x.data(), rows, D, w.q_proj, D, q.data());
    cpu::Linear(x.data(), rows, D, w.k_proj, D, k.data());
  }
  cpu::Linear(x.data(), rows, D, w.v_proj, D, v.data());
  for (const Segment& s : segments) {
    const int64_t start = s.sequence->length;
    cpu::ApplyRope(q.data() + s.row * D, s.count, D, nh, f, start, K, c.rope_theta);
    cpu::ApplyRope(k.data() + s.row * D, s.count, D, nh, f, start, K, c.rope_theta);
  }
  std::vector<float> lr(rows * nh);
  cpu::Linear(x.data(), rows, D, w.lr_w, nh, lr.data());
  const float* lr_bias = w.lr_b;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t head = 0; head < nh; ++head) {
      float& value = lr[r * nh + head];
      value = static_cast<float>(c.ttt_base_lr) / (1.0f + std::exp(-(value + lr_bias[head]))) /
              static_cast<float>(f);
    }
  }

  // The inner loop, one (sequence, head) pair per task.
  const float* ln_weight = w.ttt_norm_w;
  const float* ln_bias = w.ttt_norm_b;
  std::vector<float> ttt_out(rows * D);
  const int64_t tasks = static_cast<int64_t>(segments.size()) * nh;
  // Threads pay off only beyond a few tens of microseconds of work (flops ≈ rows·nh·f·f1·const).
  const bool worth_threads = tasks > 1 && rows * nh * f * f1 > (1 << 16);
#pragma omp parallel for schedule(dynamic) if (worth_threads)
  for (int64_t task = 0; task < tasks; ++task) {
    const Segment& s = segments[task / nh];
    const int64_t head = task % nh;
    if (s.count == 0) continue;
    const cpu::TttHeadParams params{.f = f,
                                    .f1 = f1,
                                    .K = K,
                                    .mlp = mlp,
                                    .ln_weight = ln_weight + head * f,
                                    .ln_bias = ln_bias + head * f,
                                    .tau = w.tau.data(),
                                    .ln_eps = kLayerNormEps};
    float* base = state_of(s);
    const cpu::TttHeadState state{.W1 = base + layout_.W1 + head * f * f1,
                                  .b1 = base + layout_.b1 + head * f1,
                                  .W2 = base + layout_.W2 + head * f1 * f,
                                  .b2 = base + layout_.b2 + head * f,
                                  .k = base + layout_.pending_k + head * K * f,
                                  .g1 = base + layout_.pending_g1 + head * K * f1,
                                  .lr = base + layout_.pending_lr + head * K,
                                  .x2 = base + layout_.pending_x2 + head * K * f1,
                                  .g2 = base + layout_.pending_g2 + head * K * f};
    const int64_t offset = s.row * D + head * f;
    cpu::TttHeadForward(params, state, s.sequence->length, s.count, q.data() + offset,
                        k.data() + offset, v.data() + offset, D, lr.data() + s.row * nh + head, nh,
                        ttt_out.data() + offset);
  }

  // Layer output (spec §3.8).
  cpu::LayerNorm(ttt_out.data(), rows, D, w.post_norm_w,
                 w.post_norm_b, kLayerNormEps, tmp.data());
  if (c.use_gate) {
    cpu::Linear(x.data(), rows, D, w.g_proj, D, q.data());
    for (int64_t i = 0; i < rows * D; ++i) tmp[i] *= cpu::Gelu(q[i]);
  }
  cpu::Linear(tmp.data(), rows, D, w.o_proj, D, x.data());
  add_into_h(x);

  // SwiGLU feed-forward.
  cpu::RmsNorm(h.data(), rows, D, w.ffn_norm, rms_eps, x.data());
  std::vector<float> gate(rows * I), up(rows * I);
  cpu::Linear(x.data(), rows, D, w.gate_proj, I, gate.data());
  cpu::Linear(x.data(), rows, D, w.up_proj, I, up.data());
  cpu::SwiGluActivation(gate.data(), up.data(), rows * I, gate.data());
  cpu::Linear(gate.data(), rows, I, w.down_proj, D, tmp.data());
  add_into_h(tmp);
}

}  // namespace ttt
