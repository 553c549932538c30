// Helpers shared by the tests: test data, golden vectors, random models, scratch directories.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "server/engine/engine.h"
#include "server/model/model.h"

namespace ttt::testing {

// A file or directory under tests/data.
std::string TestDataPath(const std::string& relative);
// The golden model directories under tests/data/golden.
std::vector<std::string> GoldenModelNames();

// A golden folder's reference outputs (see tests/data/golden/README.md).
struct Golden {
  int64_t batch = 0, length = 0, vocab = 0, greedy_steps = 0, prefill_len = 0;
  std::vector<std::vector<int32_t>> input_ids;     // [batch][length]
  std::vector<float> prefill_logits, decode_logits;  // [batch, length, vocab]
  std::vector<std::vector<int32_t>> greedy_ids;    // [batch][greedy_steps]
  std::vector<float> greedy_logits;                // [batch, greedy_steps, vocab]

  // Row `t` of sequence `b` in a [batch, steps, vocab] tensor.
  std::span<const float> Row(const std::vector<float>& logits, int64_t b, int64_t t,
                             int64_t steps) const {
    return std::span(logits).subspan((b * steps + t) * vocab, vocab);
  }
};
Golden LoadGolden(const std::string& model_name);

// A model with random weights (not tied to any file).
std::shared_ptr<const Model> RandomModel(const ModelConfig& config, uint64_t seed,
                                         const std::string& name = "random");

float MaxAbsDiff(std::span<const float> a, std::span<const float> b);

struct CommandResult {
  int exit_code;       // -1 when the command did not exit normally.
  std::string output;  // stdout and stderr together.
};
// Runs a shell command line and collects what it prints.
CommandResult RunCommand(const std::string& command_line);

// A fresh empty directory for this test.
std::string ScratchDir();

// Feeds `tokens` to `slot` in chunks of the given sizes (cycled) and returns every position's
// logits.
std::vector<float> FeedInChunks(Engine& engine, SequenceSlot slot, std::span<const int32_t> tokens,
                                const std::vector<int64_t>& chunk_sizes);

// A scripted generation through StartForwardAndSample: five sequences, three of which start
// with prompts of 5, 17 and 3 tokens and two with 40 and 9 tokens one step later (so that the
// second step is larger than the first in rows and in sequences), then one token each per step,
// `steps` steps in all. Pipelined, each step is queued before the previous one is
// finished and its sequences take the tokens in flight; otherwise each step is finished first and
// the tokens go back in from the host. Sequence i samples with `sampling` and seed 100 + i.
// Returns the tokens chosen at each step.
std::vector<std::vector<SampledToken>> GenerateScripted(Engine& engine, bool pipelined, int steps,
                                                        const SamplingParams& sampling);

}  // namespace ttt::testing
