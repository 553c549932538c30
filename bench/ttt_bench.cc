// ttt-bench: decode speed of an engine, one JSON object per configuration on stdout.
//
//   ttt-bench --model DIR --batch 1,16 --steps 256
//   ttt-bench --backend cuda --preset 125m --inner linear --batch 1,64,256 --offset 1024
//   ttt-bench --backend cuda --preset 1b --batch 1 --timeline steps.csv   (then timeline.py)
//   ttt-bench --backend cuda --preset 1b --batch 1 --single_sequence_kernel off   (one path)
//
// Each configuration creates `batch` sequences, brings each to `offset` tokens (prefill; with
// --staggered, to offsets spread over a window, as a server's sequences are), then
// times `steps` decode steps of one token per sequence, the engine choosing the tokens (greedy,
// or sampled with --temperature, --top_k, --top_p and --min_p). On CUDA it also reports the
// memory floor: the weights plus every sequence's state read once per step, over the
// device-to-device copy bandwidth measured in the same run. With --timeline it then records a few
// more steps' kernels as they ran. At batch 1 it records which path the engine decoded by
// (single_sequence_decode). With --joining N, each step also takes N new sequences' prompts in
// place of N finished ones, as a server's steps do while requests arrive. With --steps_in_flight 2,
// steps are queued as the server queues them: the next before the last is collected, so the host's
// part of a step hides behind the device's. Every configuration also reports tokens_digest, a hash
// of every id the decode steps chose (in step order, then sequence order; warmup included): runs
// that should choose the same tokens — steps queued one or two at a time, a change meant to be
// exact — can be told apart from runs that do not. The prefill runs twice, the sequences created
// again in between: the first of a process also plans its products, loads their kernels and grows
// the engine's buffers, as a server does once as it starts (first_prefill_tokens_per_s), the second
// is the rate that recurs (prefill_tokens_per_s).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/engine/engine_factory.h"
#include "server/engine/sampler.h"
#include "server/model/model.h"
#include "server/model/presets.h"
#include "server/model/weights.h"
#include "server/tools/flag_names.h"
#include "server/util/percentile.h"
#include "server/util/status_macros.h"
#if TTT_WITH_CUDA
#include "kernels/cuda_device.h"
#endif
#if TTT_BENCH_TIMELINE
#include "bench/kernel_timeline.h"
#endif

ABSL_FLAG(std::string, model, "", "Model directory; or use --preset for random weights.");
ABSL_FLAG(std::string, preset, "", "125m, 350m, 760m or 1b, with random weights.");
ABSL_FLAG(std::string, inner, "linear", "With --preset: linear or mlp.");
ABSL_FLAG(std::string, backbone, "mamba", "With --preset: mamba or transformer.");
ABSL_FLAG(std::string, batch, "1,16", "Batch sizes, comma separated.");
ABSL_FLAG(int64_t, offset, 64, "Tokens each sequence holds before the timed steps.");
ABSL_FLAG(bool, staggered, false,
          "Sequence b holds offset + b % mini_batch_size tokens, so that every step closes the "
          "windows of one sequence in mini_batch_size, as a server's sequences do, rather than "
          "every window at once in every mini_batch_size-th step.");
ABSL_FLAG(int32_t, joining, 0,
          "Before each decode step, this many of the batch's sequences (in turn) end and new ones "
          "take their places, each step's chunk for them being a prompt of --joining_prompt "
          "tokens: steps that mix prompts with decode rows, as a server's do.");
ABSL_FLAG(int32_t, joining_prompt, 16, "Prompt tokens of each sequence that --joining adds.");
ABSL_FLAG(int64_t, prefill_tokens_per_step, -1,
          "The engine prepares at start for steps with this many prompt tokens, as a server "
          "with that prefill budget does (CUDA: the graphs of the steps that mix prompts with "
          "decode rows among others). -1: --joining × --joining_prompt; 0: none.");
ABSL_FLAG(int32_t, steps_in_flight, 1,
          "1: each step is timed alone, from queueing it to its tokens on the host (its latency). "
          "2: as the server drives the engine, the next step is queued before the one in flight "
          "is collected, taking that step's tokens on the device; steps are then timed from one "
          "collected step to the next (the rate a server's steps come at).");
ABSL_FLAG(int32_t, steps, 128, "Timed decode steps per configuration.");
ABSL_FLAG(int32_t, warmup, 8, "Untimed decode steps before them.");
ABSL_FLAG(int32_t, prefill_chunk, 2048, "Prefill tokens per sequence per engine call.");
ABSL_FLAG(std::string, backend, "auto", "auto, cpu or cuda.");
ABSL_FLAG(std::string, precision, "bf16", "CUDA weight precision: bf16 or f32.");
ABSL_FLAG(float, temperature, 0, "Sampling temperature of every sequence (0: greedy).");
ABSL_FLAG(int32_t, top_k, 0, "With --temperature: keep the k most likely tokens (0: all).");
ABSL_FLAG(float, top_p, 1, "With --temperature: keep the nucleus of this much probability.");
ABSL_FLAG(float, min_p, 0, "With --temperature: keep tokens at least this likely against the top.");
ABSL_FLAG(std::string, timeline, "",
          "CUDA: after the timed steps, record the kernels of --timeline_steps more steps as "
          "they ran (start and end on the GPU), and the host's CUDA calls, into this CSV file, "
          "for bench/timeline.py. Both are traced all along, the timed steps too.");
ABSL_FLAG(int32_t, timeline_steps, 4, "Decode steps recorded by --timeline.");
ABSL_FLAG(std::string, single_sequence_kernel, "auto",
          "CUDA: decode batch 1 with every layer in one kernel: auto (whichever the engine times "
          "faster at start), on (wherever the model fits it) or off.");

namespace ttt {
namespace {

absl::StatusOr<std::shared_ptr<const Model>> BenchModel() {
  if (!absl::GetFlag(FLAGS_model).empty()) return LoadModel(absl::GetFlag(FLAGS_model));
  const std::string preset = absl::GetFlag(FLAGS_preset), inner = absl::GetFlag(FLAGS_inner);
  const std::string backbone = absl::GetFlag(FLAGS_backbone);
  if (preset.empty()) return absl::InvalidArgumentError("give --model or --preset");
  if (inner != "linear" && inner != "mlp") {
    return absl::InvalidArgumentError("--inner: linear or mlp");
  }
  if (backbone != "mamba" && backbone != "transformer") {
    return absl::InvalidArgumentError("--backbone: mamba or transformer");
  }
  TTT_ASSIGN_OR_RETURN(
      ModelConfig config,
      PresetConfig(preset, inner == "mlp" ? TttLayerType::kMlp : TttLayerType::kLinear,
                   backbone == "mamba"));
  ModelWeights weights = ModelWeights::Random(config, /*seed=*/1);
  return std::make_shared<const Model>(
      Model{absl::StrCat(preset, "-", inner, "-", backbone), config, std::move(weights), nullptr});
}

// Device copy bandwidth (bytes read + written per second), or 0 on the CPU.
absl::StatusOr<double> CopyBandwidth([[maybe_unused]] std::string_view backend) {
#if TTT_WITH_CUDA
  if (backend.starts_with("cuda")) {
    std::string error;
    const double bandwidth = kernels::cuda::MeasureCopyBandwidth(size_t{1} << 31, &error);
    if (!error.empty()) return absl::InternalError(error);
    return bandwidth;
  }
#endif
  return 0.0;
}

#if TTT_BENCH_TIMELINE
// Appends `batch`'s kernels and the host's CUDA calls to the CSV file at `path` (a new file, with
// its header, unless `append`): one line each, names quoted; a call's stream is "host".
absl::Status WriteTimeline(const std::string& path, int32_t batch, const Timeline& timeline,
                           bool append) {
  std::ofstream out(path, append ? std::ios::app : std::ios::trunc);
  if (!append) out << "batch,launch,stream,kernel,grid,block,start_ns,end_ns\n";
  auto quoted = [](std::string_view name) {
    std::string text = "\"";
    for (char c : name) text += c == '"' ? std::string("\"\"") : std::string(1, c);
    return text + '"';
  };
  for (const KernelSpan& k : timeline.kernels) {
    out << batch << ',' << k.launch << ',' << k.stream << ',' << quoted(k.name) << ',' << k.grid
        << ',' << k.block << ',' << k.start_ns << ',' << k.end_ns << '\n';
  }
  for (const HostCall& call : timeline.host_calls) {
    out << batch << ",0,host," << quoted(call.name) << ",0,0," << call.start_ns << ','
        << call.end_ns << '\n';
  }
  out.flush();
  if (!out) return absl::InternalError(absl::StrCat("--timeline: cannot write ", path));
  return absl::OkStatus();
}
#endif

absl::Status Run() {
  const SamplingParams sampling_flags = {.temperature = absl::GetFlag(FLAGS_temperature),
                                         .top_k = absl::GetFlag(FLAGS_top_k),
                                         .top_p = absl::GetFlag(FLAGS_top_p),
                                         .min_p = absl::GetFlag(FLAGS_min_p)};
  TTT_RETURN_IF_ERROR(ValidateSamplingParams(sampling_flags));
  TTT_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, BenchModel());
  TTT_ASSIGN_OR_RETURN(WeightPrecision precision,
                       ParseWeightPrecision(absl::GetFlag(FLAGS_precision)));
  TTT_ASSIGN_OR_RETURN(const CudaEngineOptions::SingleSequenceKernel single_sequence_kernel,
                       ParseSingleSequenceKernel(absl::GetFlag(FLAGS_single_sequence_kernel)));
  const EngineOptions engine_options{.backend = absl::GetFlag(FLAGS_backend),
                                     .precision = precision,
                                     .single_sequence_kernel = single_sequence_kernel};
  const ModelConfig& c = model->config;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> token(0, c.vocab_size - 1);
  const std::string timeline = absl::GetFlag(FLAGS_timeline);
  [[maybe_unused]] bool first_timeline = true;
  if (!timeline.empty()) {  // Recording from the start, before the engines capture graphs.
#if TTT_BENCH_TIMELINE
    if (absl::GetFlag(FLAGS_backend) == "cpu") {
      return absl::InvalidArgumentError("--timeline: the CUDA backend only");
    }
    if (const absl::Status started = StartTimeline(); !started.ok()) {
      return absl::Status(started.code(), absl::StrCat("--timeline: ", started.message()));
    }
#else
    return absl::InvalidArgumentError("--timeline: built without CUDA's CUPTI");
#endif
  }
  for (absl::string_view batch_text : absl::StrSplit(absl::GetFlag(FLAGS_batch), ',')) {
    int32_t batch;
    if (!absl::SimpleAtoi(batch_text, &batch) || batch <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("--batch: '", batch_text, "' is not a size"));
    }
    EngineOptions options = engine_options;
    options.max_sequences = batch;
    options.prefill_tokens_per_step = absl::GetFlag(FLAGS_prefill_tokens_per_step);
    if (options.prefill_tokens_per_step < 0) {
      options.prefill_tokens_per_step =
          int64_t{absl::GetFlag(FLAGS_joining)} * absl::GetFlag(FLAGS_joining_prompt);
    }
    const auto creating = std::chrono::steady_clock::now();
    TTT_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine_ptr, CreateEngine(model, options));
    const double engine_start_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - creating).count();
    Engine& engine = *engine_ptr;
    TTT_ASSIGN_OR_RETURN(const double bandwidth, CopyBandwidth(engine.backend()));
    std::vector<SequenceChunk> chunks(batch);
    std::vector<std::vector<int32_t>> tokens(batch);
    const int64_t offset = absl::GetFlag(FLAGS_offset), step = absl::GetFlag(FLAGS_prefill_chunk);
    const bool staggered = absl::GetFlag(FLAGS_staggered);
    const int32_t joining = absl::GetFlag(FLAGS_joining);
    const int32_t joining_prompt = absl::GetFlag(FLAGS_joining_prompt);
    if (joining < 0 || joining > batch) {
      return absl::InvalidArgumentError(absl::StrCat("--joining: 0 to the batch (", batch, ")"));
    }
    if (joining > 0 && joining_prompt < 1) {
      return absl::InvalidArgumentError("--joining_prompt: at least 1");
    }
    const int32_t steps_in_flight = absl::GetFlag(FLAGS_steps_in_flight);
    if (steps_in_flight < 1 || steps_in_flight > Engine::kMaxStepsInFlight) {
      return absl::InvalidArgumentError(
          absl::StrCat("--steps_in_flight: 1 to ", Engine::kMaxStepsInFlight));
    }
    int64_t prompt_tokens = 0;
    for (int32_t b = 0; b < batch; ++b) {
      tokens[b].resize(offset + (staggered ? b % c.mini_batch_size : 0));
      for (int32_t& t : tokens[b]) t = token(rng);
      prompt_tokens += tokens[b].size();
    }
    // New sequences brought to their prompts, chunk by chunk (a sequence whose prompt has ended
    // sits the later chunks out); returns the seconds it took.
    std::vector<float> logits;
    auto prefill_sequences = [&]() -> absl::StatusOr<double> {
      for (int32_t b = 0; b < batch; ++b) {
        TTT_ASSIGN_OR_RETURN(chunks[b].slot, engine.CreateSequence());
      }
      const auto start = std::chrono::steady_clock::now();
      for (int64_t at = 0;; at += step) {
        std::vector<SequenceChunk> prefill;
        for (int32_t b = 0; b < batch; ++b) {
          const int64_t held = tokens[b].size();
          if (at >= held) continue;
          prefill.push_back(chunks[b]);
          prefill.back().tokens = std::span(tokens[b]).subspan(at, std::min(step, held - at));
        }
        if (prefill.empty()) break;
        TTT_RETURN_IF_ERROR(engine.Forward(prefill, LogitsFor::kNone, &logits));
      }
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    TTT_ASSIGN_OR_RETURN(const double first_prefill_seconds, prefill_sequences());
    for (int32_t b = 0; b < batch; ++b) {
      TTT_RETURN_IF_ERROR(engine.ReleaseSequence(chunks[b].slot));
    }
    TTT_ASSIGN_OR_RETURN(const double prefill_seconds, prefill_sequences());
    for (int32_t b = 0; b < batch; ++b) tokens[b] = {token(rng)};
    for (int32_t b = 0; b < batch; ++b) chunks[b].tokens = tokens[b];

    // Decoding as a server runs it: the engine picks each token, ids come back.
    std::vector<double> step_seconds;
    std::vector<SamplingParams> sampling(batch);
    for (int32_t b = 0; b < batch; ++b) {
      sampling[b] = sampling_flags;
      sampling[b].seed = b;
    }
    std::vector<SampledToken> sampled;
    std::vector<double> launch_seconds;  // Of the host queueing the step.
    int32_t next_to_end = 0;             // --joining's turn.
    // --joining's sequences for the next step: new slots, and their prompts as their chunks.
    // Untimed, as a server's engine steps do not include creating sequences.
    auto join = [&]() -> absl::Status {
      for (int32_t j = 0; j < joining; ++j) {
        const int32_t b = next_to_end;
        next_to_end = (next_to_end + 1) % batch;
        TTT_RETURN_IF_ERROR(engine.ReleaseSequence(chunks[b].slot));
        TTT_ASSIGN_OR_RETURN(chunks[b].slot, engine.CreateSequence());
        tokens[b].resize(joining_prompt);
        for (int32_t& t : tokens[b]) t = token(rng);
        chunks[b].tokens = tokens[b];
        chunks[b].takes_token_in_flight = false;
      }
      return absl::OkStatus();
    };
    // Steps queued and not yet collected. Each collected step's tokens feed the next: through
    // the host once none is in flight, else on the device (the chunks take the tokens in flight).
    int32_t in_flight = 0;
    uint64_t tokens_digest = Fnv1a64({});  // Of no ids yet.
    int64_t graph_steps = 0;  // Of those collected.
    auto collect_step = [&]() -> absl::Status {
      TTT_RETURN_IF_ERROR(engine.FinishForwardAndSample(&sampled));
      graph_steps += engine.CollectedStepReplayedGraph().value_or(false);
      for (const SampledToken& token : sampled) {
        tokens_digest = Fnv1a64(std::as_bytes(std::span(&token.id, 1)), tokens_digest);
      }
      if (--in_flight > 0) return absl::OkStatus();
      for (int32_t b = 0; b < batch; ++b) {
        tokens[b].assign(1, sampled[b].id);
        chunks[b].tokens = tokens[b];
        chunks[b].takes_token_in_flight = false;
      }
      return absl::OkStatus();
    };
    // Queues a step, then collects the oldest once --steps_in_flight are queued; with more than
    // one, the next step's chunks take this one's tokens. `queued` gets the time the host had
    // queued it, `collected` the time the oldest step's tokens were back.
    using Clock = std::chrono::steady_clock;
    auto decode_step = [&](Clock::time_point* queued, Clock::time_point* collected) {
      TTT_RETURN_IF_ERROR(engine.StartForwardAndSample(chunks, sampling));
      *queued = Clock::now();
      if (steps_in_flight > 1) {
        for (SequenceChunk& chunk : chunks) {
          chunk = {.slot = chunk.slot, .tokens = {}, .takes_token_in_flight = true};
        }
      }
      if (++in_flight == steps_in_flight) TTT_RETURN_IF_ERROR(collect_step());
      *collected = Clock::now();
      return absl::OkStatus();
    };
    const int32_t steps = absl::GetFlag(FLAGS_steps), warmup = absl::GetFlag(FLAGS_warmup);
    Clock::time_point last_collected;
    for (int32_t s = 0; s < warmup + steps; ++s) {
      TTT_RETURN_IF_ERROR(join());
      const auto start = Clock::now();
      Clock::time_point queued, collected;
      TTT_RETURN_IF_ERROR(decode_step(&queued, &collected));
      if (s >= warmup) {
        const Clock::time_point from = steps_in_flight == 1 ? start : last_collected;
        step_seconds.push_back(std::chrono::duration<double>(collected - from).count());
        launch_seconds.push_back(std::chrono::duration<double>(queued - start).count());
      }
      last_collected = collected;
    }
    while (in_flight > 0) TTT_RETURN_IF_ERROR(collect_step());
    double total = 0;
    for (double s : step_seconds) total += s;
    const double p50 = Percentile(step_seconds, 0.5);
    const double floor_bytes =
        static_cast<double>(engine.weight_bytes()) + double(batch) * engine.state_bytes();
    nlohmann::json result = {
        {"backend", engine.backend()},
        {"model", model->name},
        {"inner", c.ttt_layer_type == TttLayerType::kMlp ? "mlp" : "linear"},
        {"batch", batch},
        {"offset", offset},
        {"staggered", staggered},
        {"joining", joining},
        {"joining_prompt", joining_prompt},
        {"prefill_tokens_per_step", options.prefill_tokens_per_step},
        {"engine_start_s", engine_start_seconds},
        {"steps", steps},
        {"graph_steps", graph_steps},
        {"steps_in_flight", steps_in_flight},
        {"temperature", sampling_flags.temperature},
        {"top_k", sampling_flags.top_k},
        {"top_p", sampling_flags.top_p},
        {"min_p", sampling_flags.min_p},
        {"tokens_per_s", batch / p50},
        {"tokens_per_s_mean", batch * steps / total},
        {"step_ms_p50", 1e3 * p50},
        {"step_ms_p99", 1e3 * Percentile(step_seconds, 0.99)},
        {"launch_ms_p50", 1e3 * Percentile(launch_seconds, 0.5)},
        {"state_bytes_per_sequence", engine.state_bytes()},
        {"weight_bytes", engine.weight_bytes()},
        {"tokens_digest", absl::StrCat(absl::Hex(tokens_digest, absl::kZeroPad16))},
    };
    if (prompt_tokens > 0) {
      result["prefill_tokens_per_s"] = prompt_tokens / prefill_seconds;
      result["first_prefill_tokens_per_s"] = prompt_tokens / first_prefill_seconds;
    }
    if (batch == 1 && !engine.single_sequence_decode().empty()) {
      result["single_sequence_decode"] = engine.single_sequence_decode();
    }
    if (!engine.preparation().empty()) result["preparation"] = engine.preparation();
    if (bandwidth > 0) {
      result["copy_bandwidth_gb_per_s"] = bandwidth / 1e9;
      result["memory_floor_ms"] = 1e3 * floor_bytes / bandwidth;
      result["fraction_of_memory_floor"] = floor_bytes / bandwidth / p50;
    }
    std::printf("%s\n", result.dump().c_str());
    std::fflush(stdout);

#if TTT_BENCH_TIMELINE
    if (!timeline.empty()) {
      TTT_RETURN_IF_ERROR(TakeTimeline().status());  // Forgets the steps before.
      for (int32_t s = 0; s < absl::GetFlag(FLAGS_timeline_steps); ++s) {
        TTT_RETURN_IF_ERROR(join());
        Clock::time_point queued, collected;
        TTT_RETURN_IF_ERROR(decode_step(&queued, &collected));
      }
      while (in_flight > 0) TTT_RETURN_IF_ERROR(collect_step());
      TTT_ASSIGN_OR_RETURN(const Timeline recorded, TakeTimeline());
      TTT_RETURN_IF_ERROR(WriteTimeline(timeline, batch, recorded, /*append=*/!first_timeline));
      first_timeline = false;
    }
#endif
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace ttt

int main(int argc, char** argv) {
  ttt::ParseFlags(argc, argv);
  if (absl::Status status = ttt::Run(); !status.ok()) {
    std::fprintf(stderr, "ttt-bench: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
