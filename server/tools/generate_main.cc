// ttt-generate: offline generation, and a way to check an engine against a reference.
//
//   ttt-generate --model DIR --prompt "Once upon a time" --max-new-tokens 64
//   ttt-generate --model DIR --prompt-ids 5,17,9 --logits-out logits.safetensors --chunk 1
#include <chrono>
#include <cmath>
#include <fstream>
#include <sstream>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/engine/engine_factory.h"
#include "server/engine/sampler.h"
#include "server/model/model.h"
#include "server/model/safetensors.h"
#include "server/tools/default_model.h"
#include "server/tools/flag_names.h"
#include "server/util/status_macros.h"

ABSL_FLAG(
    std::string, model, "",
    "Model directory (config.json, model.safetensors, tokenizer); default: the bundled model.");
ABSL_FLAG(std::string, prompt, "", "Prompt text (needs a tokenizer).");
ABSL_FLAG(std::string, prompt_ids, "", "Prompt as token ids, comma separated, fed as they are.");
ABSL_FLAG(bool, add_bos, true, "Start a text prompt with the BOS token.");
ABSL_FLAG(int32_t, max_new_tokens, 32, "Tokens to generate after the prompt.");
ABSL_FLAG(bool, ignore_eos, false, "Keep generating after the EOS token.");
ABSL_FLAG(float, temperature, 0.0f, "0: greedy; otherwise sample at this temperature.");
ABSL_FLAG(int32_t, top_k, 0, "Sample among the k most likely tokens (0: all).");
ABSL_FLAG(float, top_p, 1.0f, "Nucleus sampling threshold.");
ABSL_FLAG(float, min_p, 0.0f, "Drop tokens below min_p times the top probability.");
ABSL_FLAG(float, repetition_penalty, 1.0f, "> 1 discourages tokens already seen.");
ABSL_FLAG(uint64_t, seed, 0, "Sampling seed: the same seed gives the same tokens.");
ABSL_FLAG(int32_t, chunk, 0, "Feed the prompt this many tokens per engine call (0: all at once).");
ABSL_FLAG(
    std::string, logits_out, "",
    "Write the F32 logits of every prompt position here, as safetensors tensor 'logits' [T, V].");
ABSL_FLAG(bool, print_ids, false, "Print the generated token ids instead of text.");
ABSL_FLAG(std::string, backend, "cpu", "cpu, cuda or auto (cuda when a GPU is present).");
ABSL_FLAG(std::string, eval_text, "",
          "Instead of generating: the model's bits per byte on this text file, scored in windows "
          "of --eval-window tokens, each after BOS on a fresh state. Prints JSON.");
ABSL_FLAG(int32_t, eval_window, 1024, "Tokens per --eval-text window.");
ABSL_FLAG(std::string, precision, "bf16", "CUDA weight precision: bf16 or f32.");

namespace ttt {
namespace {

absl::StatusOr<std::vector<int32_t>> PromptTokens(const Model& model) {
  const std::string text = absl::GetFlag(FLAGS_prompt), ids = absl::GetFlag(FLAGS_prompt_ids);
  if (!text.empty() && !ids.empty()) {
    return absl::InvalidArgumentError("--prompt and --prompt-ids: give one, not both");
  }
  std::vector<int32_t> tokens;
  if (!ids.empty()) {
    for (absl::string_view piece : absl::StrSplit(ids, absl::ByAnyChar(", "), absl::SkipEmpty())) {
      int32_t id;
      if (!absl::SimpleAtoi(piece, &id)) {
        return absl::InvalidArgumentError(absl::StrCat("--prompt-ids: '", piece, "' is not an id"));
      }
      if (id < 0 || id >= model.config.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("--prompt-ids: id ", id,
                                                       " is outside the vocabulary [0, ",
                                                       model.config.vocab_size, ")"));
      }
      tokens.push_back(id);
    }
  } else if (!text.empty()) {
    if (model.tokenizer == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--prompt: model '", model.name, "' has no tokenizer; use --prompt-ids"));
    }
    if (absl::GetFlag(FLAGS_add_bos)) tokens.push_back(model.config.bos_token_id);
    TTT_ASSIGN_OR_RETURN(std::vector<int32_t> encoded, model.tokenizer->Encode(text));
    tokens.insert(tokens.end(), encoded.begin(), encoded.end());
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError("--prompt / --prompt-ids: the prompt is empty");
  }
  return tokens;
}

// Bits per byte of `path`'s text: the mean negative log2-likelihood of every token of each
// window (BOS first, fresh state), over the bytes those tokens stand for. A trailing partial
// window is left out, as the training program does.
absl::Status EvaluateText(Engine& engine, const Model& model, const std::string& path) {
  if (model.tokenizer == nullptr)
    return absl::InvalidArgumentError("--eval-text: the model has no tokenizer");
  const int32_t window = absl::GetFlag(FLAGS_eval_window);
  if (window < 1) return absl::InvalidArgumentError("--eval-window: must be >= 1");
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--eval-text: cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  TTT_ASSIGN_OR_RETURN(std::vector<int32_t> ids, model.tokenizer->Encode(text.str()));
  const int64_t V = model.config.vocab_size;
  const int32_t bos = static_cast<int32_t>(model.config.bos_token_id);
  double nats = 0;
  int64_t bytes = 0, windows = 0;
  std::vector<float> logits;
  for (size_t at = 0; at + window <= ids.size(); at += window, ++windows) {
    std::vector<int32_t> tokens = {bos};
    tokens.insert(tokens.end(), ids.begin() + at, ids.begin() + at + window);
    TTT_ASSIGN_OR_RETURN(SequenceSlot slot, engine.CreateSequence());
    const SequenceChunk chunk{slot, std::span(tokens).first(window)};  // Predicts tokens[1..].
    TTT_RETURN_IF_ERROR(engine.Forward({&chunk, 1}, LogitsFor::kEveryToken, &logits));
    TTT_RETURN_IF_ERROR(engine.ReleaseSequence(slot));
    for (int32_t i = 0; i < window; ++i) {
      std::span<const float> row = std::span(logits).subspan(int64_t{i} * V, V);
      const float max = *std::max_element(row.begin(), row.end());
      double sum = 0;
      for (float v : row) sum += std::exp(double(v) - max);
      nats += std::log(sum) + max - row[tokens[i + 1]];
      bytes += static_cast<int64_t>(model.tokenizer->TokenBytes(tokens[i + 1]).size());
    }
  }
  if (windows == 0) return absl::InvalidArgumentError("--eval-text: shorter than one window");
  std::printf(
      "{\"bits_per_byte\": %.6f, \"windows\": %lld, \"window_tokens\": %d, \"bytes\": %lld}\n",
      nats / std::log(2.0) / bytes, static_cast<long long>(windows), window,
      static_cast<long long>(bytes));
  return absl::OkStatus();
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

absl::Status Run() {
  std::string model_dir = absl::GetFlag(FLAGS_model);
  if (model_dir.empty()) model_dir = DefaultModelDir();
  TTT_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, LoadModel(model_dir));
  if (!absl::GetFlag(FLAGS_eval_text).empty()) {
    TTT_ASSIGN_OR_RETURN(WeightPrecision precision,
                         ParseWeightPrecision(absl::GetFlag(FLAGS_precision)));
    TTT_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                         CreateEngine(model, {.backend = absl::GetFlag(FLAGS_backend),
                                              .precision = precision,
                                              .max_sequences = 1}));
    return EvaluateText(*engine, *model, absl::GetFlag(FLAGS_eval_text));
  }
  TTT_ASSIGN_OR_RETURN(std::vector<int32_t> prompt, PromptTokens(*model));
  const SamplingParams sampling{.temperature = absl::GetFlag(FLAGS_temperature),
                                .top_k = absl::GetFlag(FLAGS_top_k),
                                .top_p = absl::GetFlag(FLAGS_top_p),
                                .min_p = absl::GetFlag(FLAGS_min_p),
                                .repetition_penalty = absl::GetFlag(FLAGS_repetition_penalty),
                                .seed = absl::GetFlag(FLAGS_seed)};
  TTT_RETURN_IF_ERROR(ValidateSamplingParams(sampling));
  const int32_t chunk = absl::GetFlag(FLAGS_chunk);
  if (chunk < 0) return absl::InvalidArgumentError("--chunk: must be >= 0");
  const std::string logits_out = absl::GetFlag(FLAGS_logits_out);
  const int64_t V = model->config.vocab_size;

  TTT_ASSIGN_OR_RETURN(WeightPrecision precision,
                       ParseWeightPrecision(absl::GetFlag(FLAGS_precision)));
  TTT_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine_ptr,
                       CreateEngine(model, {.backend = absl::GetFlag(FLAGS_backend),
                                            .precision = precision,
                                            .max_sequences = 1}));
  Engine& engine = *engine_ptr;
  TTT_ASSIGN_OR_RETURN(SequenceSlot slot, engine.CreateSequence());

  // Prefill, chunk by chunk; the logits of every position are kept only when asked for.
  const auto prefill_start = std::chrono::steady_clock::now();
  const LogitsFor which = logits_out.empty() ? LogitsFor::kLastToken : LogitsFor::kEveryToken;
  std::vector<float> prompt_logits, logits;
  const size_t step = chunk > 0 ? chunk : prompt.size();
  for (size_t at = 0; at < prompt.size(); at += step) {
    const SequenceChunk piece{slot,
                              std::span(prompt).subspan(at, std::min(step, prompt.size() - at))};
    TTT_RETURN_IF_ERROR(engine.Forward({&piece, 1}, which, &logits));
    if (which == LogitsFor::kEveryToken) {
      prompt_logits.insert(prompt_logits.end(), logits.begin(), logits.end());
    }
  }
  const double prefill_seconds = SecondsSince(prefill_start);
  std::vector<float> last(logits.end() - V, logits.end());
  if (!logits_out.empty()) {
    const TensorToWrite tensor{"logits", DType::kF32,
                               {static_cast<int64_t>(prompt.size()), V},
                               std::as_bytes(std::span(prompt_logits))};
    TTT_RETURN_IF_ERROR(WriteSafetensors(logits_out, {&tensor, 1}));
  }

  // Decode.
  const auto decode_start = std::chrono::steady_clock::now();
  std::vector<int32_t> output;
  std::unique_ptr<StreamingDetokenizer> detokenizer;
  const bool print_ids = absl::GetFlag(FLAGS_print_ids) || model->tokenizer == nullptr;
  if (!print_ids) detokenizer = std::make_unique<StreamingDetokenizer>(*model->tokenizer);
  for (int32_t i = 0; i < absl::GetFlag(FLAGS_max_new_tokens); ++i) {
    const SampledToken token = SampleToken(last, sampling, prompt, output, prompt.size() + i);
    output.push_back(token.id);
    if (print_ids) {
      std::cout << (i > 0 ? " " : "") << token.id << std::flush;
    } else {
      std::cout << detokenizer->Push(token.id) << std::flush;
    }
    if (token.id == model->config.eos_token_id && !absl::GetFlag(FLAGS_ignore_eos)) break;
    if (i + 1 == absl::GetFlag(FLAGS_max_new_tokens)) break;
    const SequenceChunk next{slot, std::span(&output.back(), 1)};
    TTT_RETURN_IF_ERROR(engine.Forward({&next, 1}, LogitsFor::kLastToken, &last));
  }
  if (detokenizer) std::cout << detokenizer->Flush();
  std::cout << std::endl;
  const double decode_seconds = SecondsSince(decode_start);
  std::fprintf(
      stderr,
      "prompt: %zu tokens in %.3f s (%.1f tokens/s); generated %zu in %.3f s (%.1f tokens/s)\n",
      prompt.size(), prefill_seconds, prompt.size() / prefill_seconds, output.size(),
      decode_seconds, output.size() / std::max(decode_seconds, 1e-9));
  return absl::OkStatus();
}

}  // namespace
}  // namespace ttt

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Generates text with a TTT model on the CPU.\n"
      "  ttt-generate --model DIR --prompt TEXT [--max-new-tokens N] [--temperature T ...]\n"
      "  ttt-generate --model DIR --prompt-ids 1,2,3 --logits-out FILE [--chunk N]");
  ttt::ParseFlags(argc, argv);
  if (absl::Status status = ttt::Run(); !status.ok()) {
    std::fprintf(stderr, "ttt-generate: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
