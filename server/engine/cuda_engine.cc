#include "server/engine/cuda_engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cpu_ops.h"
#include "kernels/cuda_ops.h"
#include "server/engine/cuda_gemm.h"
#include "server/engine/cuda_support.h"
#include "server/engine/decode_order.h"
#include "server/engine/state_codec.h"
#include "server/engine/state_layout.h"
#include "server/util/absl_string_view.h"
#include "server/util/percentile.h"
#include "server/util/status_macros.h"

namespace ttt {
namespace {

namespace cu = kernels::cuda;

constexpr float kLayerNormEps = 1e-6f;  // Inner LayerNorm and PostLN (spec §3.5, §3.8).

// A captured decode step for a fixed number of rows, replayed with new inputs in place.
class DecodeGraph {
 public:
  DecodeGraph() = default;
  DecodeGraph(const DecodeGraph&) = delete;
  DecodeGraph& operator=(const DecodeGraph&) = delete;
  ~DecodeGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
  }
  cudaGraph_t* graph() { return &graph_; }
  cudaGraphExec_t* exec() { return &exec_; }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Rows of a and b [n, width] taken in turn: a's row 0, b's row 0, a's row 1, …
std::vector<float> InterleavedRows(std::span<const float> a, std::span<const float> b,
                                   int64_t width) {
  std::vector<float> rows;
  rows.reserve(a.size() + b.size());
  for (size_t at = 0; at < a.size(); at += width) {
    rows.insert(rows.end(), a.begin() + at, a.begin() + at + width);
    rows.insert(rows.end(), b.begin() + at, b.begin() + at + width);
  }
  return rows;
}

// Where each part of a step's inputs lies in the block that one copy uploads: in stream order
// each copy waits for the one before it, and the copies between two steps' kernels are time the
// GPU idles. Each part starts on a 16-byte boundary. The layout follows from the step's sizes
// alone, so a decode graph's bucket always finds its parts where the graph was captured.
struct StepInputLayout {
  size_t segments = 0, sampling = 0, tokens = 0, row_segment = 0, out_rows = 0, bytes = 0;

  StepInputLayout(int64_t rows, int64_t segment_count, int64_t logit_rows) {
    auto part = [this](int64_t count, size_t element_bytes) {
      const size_t at = bytes;
      bytes += (static_cast<size_t>(count) * element_bytes + 15) / 16 * 16;
      return at;
    };
    segments = part(2 * segment_count, sizeof(cu::Segment));
    sampling = part(segment_count, sizeof(cu::SamplingRow));
    tokens = part(rows, sizeof(int32_t));
    row_segment = part(rows, sizeof(int32_t));
    out_rows = part(logit_rows, sizeof(int32_t));
  }
};

// A step's inputs in a block laid out by StepInputLayout, in pinned memory or on the device.
struct StepInputs {
  cu::Segment* segments = nullptr;  // The step's, then the same in the TTT kernels' order.
  cu::SamplingRow* sampling = nullptr;
  int32_t* tokens = nullptr;
  int32_t* row_segment = nullptr;
  int32_t* out_rows = nullptr;

  StepInputs() = default;
  StepInputs(void* block, const StepInputLayout& layout) {
    char* base = static_cast<char*>(block);
    segments = reinterpret_cast<cu::Segment*>(base + layout.segments);
    sampling = reinterpret_cast<cu::SamplingRow*>(base + layout.sampling);
    tokens = reinterpret_cast<int32_t*>(base + layout.tokens);
    row_segment = reinterpret_cast<int32_t*>(base + layout.row_segment);
    out_rows = reinterpret_cast<int32_t*>(base + layout.out_rows);
  }
};

// GEMM operands (weights and the activations fed to them) are in the weight precision. The
// projections that read the same input are stacked into one weight, one GEMM each:
// in_proj = [W_q; W_k; W_v; w_lr; W_g] (k and g when the model has them; see
// ProjectionColumns) and gate_up, whose rows interleave W_gate's and W_up's (gate row j, then up
// row j), so that a product's two sums for output j of the feed-forward meet in one warp.
struct LayerWeights {
  const float *conv_norm = nullptr, *conv_w = nullptr, *conv_b = nullptr;  // pre_conv
  const float* seq_norm = nullptr;
  const void *in_proj = nullptr, *o_proj = nullptr;
  const float *conv_q_w = nullptr, *conv_q_b = nullptr, *conv_k_w = nullptr, *conv_k_b = nullptr;
  const float *lr_b = nullptr, *tau = nullptr, *ttt_norm_w = nullptr, *ttt_norm_b = nullptr;
  const float *post_norm_w = nullptr, *post_norm_b = nullptr, *ffn_norm = nullptr;
  const void *gate_up = nullptr, *down_proj = nullptr;
};

class CudaEngine : public Engine {
 public:
  CudaEngine(std::shared_ptr<const Model> model, const CudaEngineOptions& options)
      : model_(std::move(model)), options_(options), layout_(model_->config) {}

  ~CudaEngine() override {
    graphs_.clear();
    mixed_graphs_.clear();
    for (const std::array<cudaEvent_t, kMaxStepsInFlight>& events : {step_start_, step_done_}) {
      for (cudaEvent_t event : events) {
        if (event != nullptr) cudaEventDestroy(event);
      }
    }
    for (const std::array<cudaEvent_t, kMaxStepsInFlight>& events : {uploaded_, finished_}) {
      for (cudaEvent_t event : events) {
        if (event != nullptr) cudaEventDestroy(event);
      }
    }
    for (cudaEvent_t event : {projected_, scanned_}) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    for (cudaStream_t stream : {scan_stream_, upload_stream_, download_stream_, stream_}) {
      if (stream != nullptr) cudaStreamDestroy(stream);
    }
  }

  absl::Status Initialize();

  const ModelConfig& config() const override { return model_->config; }
  std::string_view backend() const override {
    return options_.precision == WeightPrecision::kBFloat16 ? "cuda-bf16" : "cuda-f32";
  }
  size_t state_bytes() const override { return layout_.total_bytes(); }
  int64_t max_sequences() const override { return capacity_; }
  size_t weight_bytes() const override {
    size_t bytes = 0;
    for (const DeviceBuffer& buffer : weight_buffers_) bytes += buffer.bytes();
    return bytes;
  }

  absl::StatusOr<SequenceSlot> CreateSequence() override;
  absl::Status ReleaseSequence(SequenceSlot slot) override;
  absl::StatusOr<SequenceSlot> ForkSequence(SequenceSlot source) override;
  absl::StatusOr<int64_t> SequenceLength(SequenceSlot slot) const override;
  absl::StatusOr<std::string> SaveSequence(SequenceSlot slot) const override;
  absl::StatusOr<SequenceSlot> RestoreSequence(std::string_view bytes) override;
  absl::Status Forward(std::span<const SequenceChunk> batch, LogitsFor which,
                       std::vector<float>* logits) override;
  absl::Status ForwardAndSample(std::span<const SequenceChunk> batch,
                                std::span<const SamplingParams> sampling,
                                std::vector<SampledToken>* tokens) override;
  absl::Status StartForwardAndSample(std::span<const SequenceChunk> batch,
                                     std::span<const SamplingParams> sampling) override;
  absl::Status FinishForwardAndSample(std::vector<SampledToken>* tokens) override;
  std::optional<absl::Duration> CollectedStepDeviceTime() const override {
    return collected_device_time_;
  }
  std::optional<bool> CollectedStepReplayedGraph() const override {
    return collected_replayed_graph_;
  }
  std::string single_sequence_decode() const override { return single_sequence_decode_; }
  std::string preparation() const override { return preparation_; }

 private:
  cu::ElementType gemm_type() const {
    return options_.precision == WeightPrecision::kBFloat16 ? cu::ElementType::kBFloat16
                                                            : cu::ElementType::kFloat32;
  }
  size_t gemm_element_bytes() const {
    return options_.precision == WeightPrecision::kBFloat16 ? 2 : 4;
  }
  float* slot_state(SequenceSlot slot) const {
    return pool_.get<float>() + static_cast<size_t>(slot) * layout_.total_floats();
  }

  // Copies host memory to the device, ordered with (and waiting for) the engine's stream: the
  // stream is non-blocking, so a plain cudaMemcpy, which from pageable memory may return before
  // the data has landed, is not ordered with the kernels that read it.
  absl::Status CopyToDevice(void* device, const void* host, size_t bytes);
  absl::Status UploadWeights();
  // Uploads float32 values as they are, or GEMM weights in the weight precision.
  absl::StatusOr<const float*> UploadFloats(std::span<const float> values);
  absl::StatusOr<const void*> UploadGemmWeight(std::span<const float> values);
  absl::Status CheckSlot(SequenceSlot slot, std::string_view field) const;
  absl::StatusOr<SequenceSlot> TakeSlot();
  // Writes the fresh state into every slot in unfilled_, in one launch per cu::SlotList.
  absl::Status FillFreshStates();
  absl::Status Validate(std::span<const SequenceChunk> batch, LogitsFor which) const;
  // Grows the per-call buffers; growing moves them, which retires every captured graph (and
  // first waits for the steps in flight, which use them).
  absl::Status EnsureScratch(int64_t rows, int64_t segments, int64_t logit_rows);
  // Lays out the inputs of a step of these sizes in its output set's staging and device blocks,
  // which EnsureScratch has sized: scratch_.host_in and scratch_.in then point at their parts.
  void LayOutInputs(int64_t rows, int64_t segments, int64_t logit_rows);
  // A decode step's, in its bucket's layout: its graph reads them where they were at capture.
  void LayOutDecodeInputs(int64_t bucket) { LayOutInputs(bucket, bucket, /*logit_rows=*/0); }
  // The token to stage for position i of a chunk: its own, or -(r + 1) for the one that the
  // step in flight chose, r its place in chosen_ (EmbeddingGather reads it there).
  int32_t StagedToken(const SequenceChunk& chunk, size_t i) const {
    if (!chunk.takes_token_in_flight) return chunk.tokens[i];
    return -(chosen_set_ * chosen_stride_ + chosen_row_[chunk.slot] + 1);
  }
  // Stages `chunk` as the step's segment b from `row` on: the segment, its tokens and their
  // segment. Returns the row after it.
  int32_t StageChunk(const SequenceChunk& chunk, int64_t b, int32_t row) {
    const StepInputs& staged = scratch_.host_in;
    const int32_t length = static_cast<int32_t>(chunk.length());
    staged.segments[b] = {
        .row = row, .count = length, .slot = chunk.slot, .start = lengths_[chunk.slot]};
    for (int32_t i = 0; i < length; ++i) {
      staged.tokens[row + i] = StagedToken(chunk, i);
      staged.row_segment[row + i] = static_cast<int32_t>(b);
    }
    return row + length;
  }
  // Where the tokens a step of output set `set` chooses go on the device: ids, then log-probs.
  int32_t* chosen_ids(int set) const { return chosen_.get<int32_t>() + set * chosen_stride_; }
  // Marks `batch` as the newest step in flight that chooses tokens (none when empty).
  void SetChosenRows(std::span<const SequenceChunk> batch);
  // After queueing a step: its results' copy to pinned memory on download_stream_ and its
  // completion event. A step that samples chose tokens for `sampled_rows` rows, of which the
  // first output_rows are the batch's. `replays_graph`: the step launched a captured graph.
  absl::Status EndStep(bool has_output, int64_t output_rows, bool sample, int64_t sampled_rows,
                       bool replays_graph = false);
  // Copies the step's inputs staged in pinned memory (LayOutInputs) to the device, in one copy on
  // upload_stream_, which the step's kernels wait for.
  absl::Status UploadInputs();
  // Stages, after the step's `segments` segments, the same segments in the order the TTT layer's
  // kernels take them, and returns how many come first: those of at most one token, which
  // cu::TttDecode takes where the model fits it, in the order PlanDecodeOrder gives (those whose
  // token closes a window, and so commits θ0, where the kernel's warps take an item fewer). The
  // longer ones follow, for cu::TttScan. A step that mixes prompts with decode rows so runs its
  // decode rows as fast as a decode step does (bench/README.md v29).
  // Segments from `scanned_padding` on (a mixed step's graph pads with them) go to the scan's
  // part, whatever their count.
  int64_t StageDecodeOrder(int64_t segments,
                           int64_t scanned_padding = std::numeric_limits<int64_t>::max());
  // Enqueues the forward pass over inputs already on the device, ending with the logits of the
  // `logit_rows` rows listed in out_rows (or rows 0.. when !gather) in scratch_.logits, or, when
  // `sample`, the tokens chosen from them and their log-probs in the step's part of chosen_.
  // Enqueues only: safe to capture in a graph. `decode_segments`: StageDecodeOrder's count.
  // Where that is every segment and each has one row (a decode step), the layers' other kernels
  // take their decode forms too.
  absl::Status EnqueueForward(int64_t rows, int64_t num_segments, int64_t decode_segments,
                              int64_t logit_rows, bool gather, bool sample);
  // Queues Forward (!sample) or ForwardAndSample over a validated batch, advancing the
  // sequences' lengths; Complete waits for it and hands over its results.
  absl::Status Enqueue(std::span<const SequenceChunk> batch, LogitsFor which,
                       std::span<const SamplingParams> sampling, bool sample);
  // Sizes the buffers for steps of up to `max_rows` rows and `decode_rows` sequences, runs every
  // GEMM shape such steps use once, and captures the decode graph of every bucket up to
  // decode_rows and the graphs of the steps that mix prompts into them (CaptureMixedGraphs).
  absl::Status PrepareForSteps(int64_t max_rows, int64_t decode_rows);
  // EnqueueForward's work captured as a graph (stream_ capturing, nothing launched), instantiated.
  absl::StatusOr<std::unique_ptr<DecodeGraph>> CaptureForward(int64_t rows, int64_t num_segments,
                                                              int64_t decode_segments,
                                                              int64_t logit_rows, bool gather,
                                                              bool sample);
  // The decode graph of a batch-size bucket for the step's output set, captured on first use.
  absl::StatusOr<cudaGraphExec_t> DecodeGraphFor(int64_t bucket, bool sample);
  // Drops a bucket's sampling graphs (every output set's), to be captured again on next use.
  void ForgetSamplingGraphs(int64_t bucket) {
    for (int set = 0; set < kMaxStepsInFlight; ++set) graphs_.erase({bucket, true, set});
  }
  // A step that mixes prompts into decode rows launches ~190 kernels, which one by one cost the
  // host more time than the GPU spends on them (bench/README.md v73). Such steps that sample run
  // as graphs too, by bucket: their rows as GemmRows rounds them (the products compute those
  // rows anyway), up to kMixedGraphMaxRows; their scanned segments up mixed_scanned_ladder_; all
  // their segments, the rows of the LM head and the sampler, as GemmRows rounds them, the decode
  // segments filling what the scanned ones leave (rounding the decode segments alone would push
  // 255 of them and a prompt to an LM head of 512 rows: v76). Padding segments are empty (count
  // 0), which every kernel of the step passes over; padding rows belong to the last prompt, past
  // its count, where they compute what no row of it reads; the sampler's rows follow the
  // segments, padding included. The graphs are captured at start (PrepareForSteps) for every
  // bucket the server's steps can fall in, not one by one while serving: each capture holds up
  // every stream for milliseconds (v74). Steps outside them launch kernel by kernel.
  struct MixedBucket {
    int64_t rows, segments, scanned_segments;
    int64_t decode_segments() const { return segments - scanned_segments; }
    auto operator<=>(const MixedBucket&) const = default;
  };
  static constexpr int64_t kMixedGraphMaxRows = 1024, kMixedGraphMaxScanned = 16;
  // The bucket of a step of `rows` rows and these segments, if one could take it.
  std::optional<MixedBucket> MixedBucketFor(int64_t rows, int64_t decode_segments,
                                            int64_t scanned_segments) const;
  // Captures the graphs of every bucket of the steps that mix up to mixed_decode_rows_ decode
  // rows with up to mixed_prompt_rows_ rows of prompts, for every output set.
  absl::Status CaptureMixedGraphs();
  // A mixed step that samples, through `graph`, its bucket's for the step's output set.
  absl::Status EnqueueMixedStep(std::span<const SequenceChunk> batch,
                                std::span<const SamplingParams> sampling,
                                const MixedBucket& bucket, cudaGraphExec_t graph);
  // One token for each sequence of `batch`, through the graph of its batch-size bucket.
  absl::Status EnqueueDecodeStep(std::span<const SequenceChunk> batch,
                                 std::span<const SamplingParams> sampling, bool sample);
  // Waits for the oldest step in flight and hands over its results.
  absl::Status Complete(std::vector<float>* logits, std::vector<SampledToken>* tokens);
  // Stages row b's sampling parameters, its draw counter the sequence's length after the step.
  void StageSampling(int64_t b, const SamplingParams& params, uint64_t step);
  struct PendingStep;
  // Copies a step's results from pinned memory (its output set of chosen tokens) to the caller.
  void CollectOutputs(const PendingStep& step, std::vector<float>* logits,
                      std::vector<SampledToken>* tokens) const;
  // The rows Gemm computes for `rows`: rounded up to a few shapes.
  static int64_t GemmRows(int64_t rows);
  // y [rows, out] (+)= x [rows, in] · wᵀ, w [out, in]; computes a few more rows of scratch. y is
  // float32, or bf16 where y_type says so (a store, with bf16 weights).
  absl::Status Gemm(const void* x, int64_t rows, int64_t in, const void* w, int64_t out, void* y,
                    bool accumulate, cu::ElementType y_type = cu::ElementType::kFloat32);
  // The type of gate_up's sums for x [rows, in] · wᵀ [out]: float32 where SkinnyGemm takes them
  // (a few rows), else the weight precision: cuBLASLt rounds them as the activation is, and the
  // SwiGLU kernel then reads half the bytes (bench/README.md v37).
  cu::ElementType GateUpSums(int64_t rows, const void* x, int64_t in, const void* w,
                             int64_t out) const {
    return gemm_->TakesSkinnyGemm({.rows = GemmRows(rows), .in = in, .out = out}, x, w)
               ? cu::ElementType::kFloat32
               : gemm_type();
  }
  // input · wᵀ for an input made by a norm, written to y as `output` says (kSwiGlu: the
  // feed-forward's activation [rows, out / 2] in the weight precision, from gate_up): one
  // SkinnyGemm, the norm made inside it, where it fits (decode at small batch); otherwise the
  // norm's kernel writes the input rows into `staging` and Gemm multiplies them (for kSwiGlu
  // into scratch_.ffn as GateUpSums says, then the SwiGLU kernel).
  absl::Status Product(const cu::ProductInput& input, int64_t rows, int64_t in, const void* w,
                       int64_t out, cu::ProductOutput output, void* y, void* staging);
  absl::Status ForwardLayer(int64_t layer, int64_t rows, int64_t num_segments,
                            int64_t decode_segments);
  // Makes stream_ wait for what scan_stream_ took since the last join, if anything.
  absl::Status JoinScanStream();
  // A decode step's shape: every segment one row, and each among the decode segments.
  static bool OneTokenEach(int64_t rows, int64_t num_segments, int64_t decode_segments) {
    return rows == num_segments && decode_segments == num_segments;
  }
  // Whether a step of `rows` rows takes our tensor-core products (cu::TensorCoreProduct for
  // in_proj; cu::FeedForwardEntry for o_proj, its norm, gate_up and SwiGLU): at 64–256 rows, on
  // models no wider than kTensorCoreProductsMaxWidth. The kernels' tiles are sized for 256 rows;
  // at 512 their blocks take two waves (bench/README.md v26, v27), and fewer than 64 rows were not
  // measured with them. Other steps take cuBLASLt's products and the row kernels.
  bool TensorCoreProducts(int64_t rows) const {
    return tensor_core_products_ && rows >= 64 && rows <= 256;
  }
  // Our kernels were slower than cuBLASLt's on the 1b preset's wider products (bench/README.md
  // v14, v26), and so was the entry with 1b's tiles (v43, v44), so wider models keep cuBLASLt's.
  static constexpr int kTensorCoreProductsMaxWidth = 1024;
  // The TTT layer's parts as its kernels take them.
  cu::TttProjectionInputs TttInputs(int64_t layer) const;
  cu::TttScanParams TttParams(int64_t layer) const;
  cu::TttStateOffsets TttOffsets() const;
  // Decode at batch 1 (cu::SequenceStep): its layer table, built once, and its arguments, which
  // name the scratch buffers as they are now.
  absl::Status PrepareSequenceStep();
  cu::SequenceStepArgs SequenceStepArgs() const;
  // Sets how a decode step of a single sequence runs: as the options say, or, where they leave
  // it to the engine and the model fits cu::SequenceStep, by timing both paths.
  absl::Status ChooseSingleSequencePath();
  // The median device time of a decode step of `slot` alone, through the path now set.
  absl::StatusOr<absl::Duration> TimeSingleSequenceStep(SequenceSlot slot);

  std::shared_ptr<const Model> model_;
  CudaEngineOptions options_;
  StateLayout layout_;
  cudaStream_t stream_ = nullptr;
  // A step's inputs go up on upload_stream_ and its results come down on download_stream_, so
  // that with two steps in flight the next step's upload and the last step's download run under
  // the kernels rather than between them (on stream_ each copy would wait for the kernels before
  // it, and the kernels after it for the copy). Each step in flight has an output set: its input
  // blocks, its part of chosen_, its pinned results and its events.
  cudaStream_t upload_stream_ = nullptr, download_stream_ = nullptr;
  // In a step that mixes prompts with single tokens, the prompts' TTT kernels run on
  // scan_stream_ beside the decode kernel on stream_: forked after in_proj (projected_), joined
  // before the layer's output (scanned_). The scan's inputs and the history's advance then run
  // under the decode kernel, and the scan's blocks start as its warps retire (bench/README.md
  // v29: -2.3% at 125m, -3.4% at 1b). The q/k conv's history advances there after the scan, joined
  // only before the next layer's in_proj rewrites the rows it reads (v69).
  cudaStream_t scan_stream_ = nullptr;
  bool scan_stream_joined_ = true;
  cudaEvent_t projected_ = nullptr, scanned_ = nullptr;
  std::unique_ptr<CudaGemm> gemm_;

  std::vector<DeviceBuffer> weight_buffers_;
  std::vector<LayerWeights> layers_;
  const void* embedding_ = nullptr;
  const void* lm_head_ = nullptr;
  const float* final_norm_ = nullptr;
  cu::ProjectionColumns columns_{};  // Of in_proj's output.
  const float2* rope_ = nullptr;     // [K, f/2] (cos, sin) by position in the mini-batch.

  DeviceBuffer pool_;         // capacity_ slots of layout_.total_floats() floats.
  DeviceBuffer fresh_state_;  // θ0 from the checkpoint, everything else zero.
  // With bf16 weights TTT-Linear's W1 is held in halves (SplitW1), so that the decode step reads
  // θ0 as bf16 from the upper half: 8 of a head's 16 KB at f = 64, where it reads ~24 KB an item.
  // The state stays float32 to the bit, so nothing drifts. With float32 weights, for exactness,
  // W1 is held whole and read whole.
  bool w1_split_ = false;
  int64_t capacity_ = 0;
  std::vector<int64_t> lengths_;  // Per slot; -1: free.
  std::vector<SequenceSlot> free_slots_;
  // Slots that CreateSequence took whose fresh state is not written yet. The next step (or fork)
  // writes them all at once: a step that takes on a dozen sequences then pays for one launch
  // rather than a device copy each, every one of them the host's time and a wait on the GPU
  // between two steps (bench/README.md v72).
  std::vector<SequenceSlot> unfilled_;

  // Per-Forward scratch, grown to the largest batch seen.
  struct Scratch {
    // The step's inputs: staged in pinned memory, uploaded as one block (StepInputLayout), by
    // output set.
    std::array<PinnedBuffer, kMaxStepsInFlight> host_inputs;
    std::array<DeviceBuffer, kMaxStepsInFlight> inputs;
    size_t input_bytes = 0;  // The current step's block.
    StepInputs host_in, in;  // Its parts, staged and on the device.
    DeviceBuffer h, x, proj, q, k, v, lr, ttt_out, y_gemm, conv_in;
    DeviceBuffer ffn, ffn_act, final_rows, final_in, logits;
    DeviceBuffer row_squares;  // cu::FeedForwardEntry's.
    PinnedBuffer host_logits;
    struct {
      int64_t rows = 0, segments = 0, logit_rows = 0;
    } room;  // What the buffers have room for.
  } scratch_;
  // StageDecodeOrder's, kept to spare allocations.
  std::vector<int32_t> decode_candidates_;  // The segments of at most one token.
  std::vector<DecodeWork> decode_work_;     // Theirs.
  std::vector<int32_t> decode_order_;       // Indices into decode_candidates_.
  // Captured decode steps by (batch-size bucket, whether they sample, output set), and mixed
  // steps by (bucket, output set).
  std::map<std::tuple<int64_t, bool, int>, std::unique_ptr<DecodeGraph>> graphs_;
  std::map<std::pair<MixedBucket, int>, std::unique_ptr<DecodeGraph>> mixed_graphs_;
  // The scanned segments' buckets: powers of two up to kMixedGraphMaxScanned, and the count
  // whose scan grid fills the SMs (cu::TttScan takes its wide form up to it).
  std::vector<int64_t> mixed_scanned_ladder_;
  int64_t mixed_decode_rows_ = 0, mixed_prompt_rows_ = 0;  // Set by PrepareForSteps.
  // cu::SequenceStep's layer table (on the device; its first layer on the host too) and
  // grid-barrier counters; whether the model fits it.
  DeviceBuffer sequence_step_layers_, sequence_step_counters_;
  cu::SequenceStepLayer sequence_step_layer_{};
  bool sequence_step_ = false;
  bool tensor_core_products_ = false;  // The GPU and the model take our tensor-core products.
  std::string single_sequence_decode_;  // Which path, and why.
  std::string preparation_;             // What PrepareForSteps did, and what it cost.

  // The tokens a step chooses, ids then log-probs (n of each, n the rows it samples), so that one
  // copy brings both: on the device, where the next step may take the ids, and in pinned memory.
  // On the device each output set has chosen_stride_ of chosen_'s elements, and a staged token
  // names the set and the row it takes (StagedToken): a decode graph then reads whichever set
  // the step before it wrote. Grown with the scratch, keeping what they hold.
  DeviceBuffer chosen_;
  int32_t chosen_stride_ = 0;
  std::array<PinnedBuffer, kMaxStepsInFlight> host_chosen_;
  // By output set: a step's first operation on stream_ and its last on download_stream_ (timed),
  // its inputs' upload, and its last kernel.
  std::array<cudaEvent_t, kMaxStepsInFlight> step_start_{}, step_done_{}, uploaded_{}, finished_{};
  int step_set_ = 0;  // The output set of the step being queued.
  std::optional<absl::Duration> collected_device_time_;
  std::optional<bool> collected_replayed_graph_;
  // Each slot's row in the newest step in flight that chooses tokens (-1: none), and the slots
  // that have one; that step's output set.
  std::vector<int32_t> chosen_row_;
  int chosen_set_ = 0;
  std::vector<SequenceSlot> chosen_slots_;
  // Steps queued on the device whose results have not been collected yet, oldest first.
  struct PendingStep {
    bool has_output = false;   // Whether Forward wants logits (LogitsFor::kNone does not).
    int64_t output_rows = 0;   // Rows of logits, or of sampled tokens.
    int64_t sampled_rows = 0;  // Where the log-probs start in its output set.
    int output_set = 0;        // Its pinned output set and completion event.
    bool replays_graph = false;
  };
  std::deque<PendingStep> pending_;
};

absl::Status CudaEngine::Initialize() {
  const ModelConfig& c = model_->config;
  if (c.vocab_size > cu::kMaxSamplerVocabulary) {
    return absl::InvalidArgumentError(absl::StrCat("vocab_size: ", c.vocab_size,
                                                   " tokens exceed the GPU sampler's ",
                                                   cu::kMaxSamplerVocabulary));
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("no CUDA device is available");
  }
  if (options_.device < 0 || options_.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: ", options_.device, " is not one of the ", count, " CUDA devices"));
  }
  TTT_CUDA(cudaSetDevice(options_.device));
  TTT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  TTT_ASSIGN_OR_RETURN(gemm_,
                       CudaGemm::Create(options_.precision == WeightPrecision::kBFloat16, stream_));
  TTT_RETURN_IF_ERROR(UploadWeights());
  tensor_core_products_ = options_.precision == WeightPrecision::kBFloat16 &&
                          c.hidden_size <= kTensorCoreProductsMaxWidth &&
                          cu::TensorCoreProductsAvailable(c.hidden_size, c.intermediate_size);

  w1_split_ =
      options_.precision == WeightPrecision::kBFloat16 && c.ttt_layer_type == TttLayerType::kLinear;
  std::vector<float> fresh = FreshState(c, model_->weights, layout_);
  if (w1_split_) SplitW1(layout_, fresh);
  TTT_RETURN_IF_ERROR(fresh_state_.Reserve(layout_.total_bytes()));
  TTT_RETURN_IF_ERROR(CopyToDevice(fresh_state_.get(), fresh.data(), layout_.total_bytes()));

  // The state pool.
  size_t free_bytes = 0, total_bytes = 0;
  TTT_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t per_slot = layout_.total_bytes();
  size_t pool_bytes = options_.state_pool_bytes;
  if (options_.max_sequences > 0) {
    pool_bytes = per_slot * options_.max_sequences;
  } else if (pool_bytes == 0) {
    pool_bytes = static_cast<size_t>(free_bytes * options_.state_pool_fraction);
  }
  capacity_ = static_cast<int64_t>(pool_bytes / per_slot);
  if (capacity_ < 1 || pool_bytes > free_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the state pool needs ", pool_bytes, " bytes (", per_slot, " per sequence, at least one), ",
        "but the GPU has ", free_bytes, " bytes free after the weights"));
  }
  TTT_RETURN_IF_ERROR(pool_.Reserve(static_cast<size_t>(capacity_) * per_slot));
  lengths_.assign(capacity_, -1);
  for (int64_t s = capacity_ - 1; s >= 0; --s) free_slots_.push_back(static_cast<SequenceSlot>(s));

  chosen_row_.assign(capacity_, -1);
  for (int set = 0; set < kMaxStepsInFlight; ++set) {
    TTT_CUDA(cudaEventCreate(&step_start_[set]));
    TTT_CUDA(cudaEventCreate(&step_done_[set]));
    TTT_CUDA(cudaEventCreateWithFlags(&uploaded_[set], cudaEventDisableTiming));
    TTT_CUDA(cudaEventCreateWithFlags(&finished_[set], cudaEventDisableTiming));
  }
  TTT_CUDA(cudaStreamCreateWithFlags(&upload_stream_, cudaStreamNonBlocking));
  TTT_CUDA(cudaStreamCreateWithFlags(&download_stream_, cudaStreamNonBlocking));
  TTT_CUDA(cudaStreamCreateWithFlags(&scan_stream_, cudaStreamNonBlocking));
  TTT_CUDA(cudaEventCreateWithFlags(&projected_, cudaEventDisableTiming));
  TTT_CUDA(cudaEventCreateWithFlags(&scanned_, cudaEventDisableTiming));
  if (options_.single_sequence_kernel != CudaEngineOptions::SingleSequenceKernel::kOff) {
    TTT_RETURN_IF_ERROR(PrepareSequenceStep());
  }
  TTT_RETURN_IF_ERROR(ChooseSingleSequencePath());
  if (options_.prefill_tokens_per_step > 0) {
    const int64_t decode_rows = std::min<int64_t>(std::bit_ceil(static_cast<size_t>(capacity_)),
                                                  CudaEngineOptions::kPreparedDecodeRows);
    TTT_RETURN_IF_ERROR(
        PrepareForSteps(options_.prefill_tokens_per_step + decode_rows, decode_rows));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::CopyToDevice(void* device, const void* host, size_t bytes) {
  TTT_CUDA(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
  TTT_CUDA(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::StatusOr<const float*> CudaEngine::UploadFloats(std::span<const float> values) {
  DeviceBuffer& buffer = weight_buffers_.emplace_back();
  TTT_RETURN_IF_ERROR(buffer.Reserve(values.size_bytes()));
  TTT_RETURN_IF_ERROR(CopyToDevice(buffer.get(), values.data(), values.size_bytes()));
  return buffer.get<const float>();
}

absl::StatusOr<const void*> CudaEngine::UploadGemmWeight(std::span<const float> values) {
  if (options_.precision == WeightPrecision::kFloat32) return UploadFloats(values);
  DeviceBuffer staging;
  TTT_RETURN_IF_ERROR(staging.Reserve(values.size_bytes()));
  TTT_RETURN_IF_ERROR(CopyToDevice(staging.get(), values.data(), values.size_bytes()));
  DeviceBuffer& buffer = weight_buffers_.emplace_back();
  TTT_RETURN_IF_ERROR(buffer.Reserve(values.size() * 2));
  TTT_CUDA(cu::ConvertToBFloat16(staging.get<float>(), values.size(), buffer.get<__nv_bfloat16>(),
                                 stream_));
  TTT_CUDA(cudaStreamSynchronize(stream_));
  return buffer.get();
}

absl::Status CudaEngine::UploadWeights() {
  const ModelConfig& c = model_->config;
  const ModelWeights& weights = model_->weights;
  const int64_t D = c.hidden_size;
  TTT_ASSIGN_OR_RETURN(embedding_, UploadGemmWeight(weights.Get("model.embed_tokens.weight")));
  lm_head_ = embedding_;
  if (!c.tie_word_embeddings) {
    TTT_ASSIGN_OR_RETURN(lm_head_, UploadGemmWeight(weights.Get("lm_head.weight")));
  }
  TTT_ASSIGN_OR_RETURN(final_norm_, UploadFloats(weights.Get("model.norm.weight")));

  // The fused input projection's column blocks, in the order they are stacked: the TTT step's
  // inputs, then the gate (which SequenceStep multiplies apart from them), each block starting on
  // a 16-byte boundary of the output row.
  int column = 0;
  auto block = [&column](int64_t width) {
    const int start = column;
    column += static_cast<int>((width + 3) / 4 * 4);
    return start;
  };
  columns_.q = block(D);
  columns_.k = c.share_qk ? -1 : block(D);
  columns_.v = block(D);
  columns_.lr = block(c.num_attention_heads);
  columns_.g = c.use_gate ? block(D) : -1;
  // Rounded up to a multiple of 64 (zero rows in the weight): cuBLAS picks much slower kernels
  // for an odd output width such as 3·768 + 12.
  constexpr int kWidthMultiple = 64;
  columns_.ld = (column + kWidthMultiple - 1) / kWidthMultiple * kWidthMultiple;

  // RoPE's (cos, sin) by position in the mini-batch, as the CPU engine computes them.
  const int64_t f = c.head_dim(), K = c.mini_batch_size;
  std::vector<float> rope(K * f), cos(f / 2), sin(f / 2);
  for (int64_t p = 0; p < K; ++p) {
    kernels::cpu::RopeCosSin(p, f, c.rope_theta, cos.data(), sin.data());
    for (int64_t i = 0; i < f / 2; ++i) {
      rope[(p * f / 2 + i) * 2] = cos[i];
      rope[(p * f / 2 + i) * 2 + 1] = sin[i];
    }
  }
  TTT_ASSIGN_OR_RETURN(const float* rope_table, UploadFloats(rope));
  rope_ = reinterpret_cast<const float2*>(rope_table);

  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    auto layer = [&](std::string_view suffix) { return weights.Get(LayerTensorName(i, suffix)); };
    auto ttt = [&](std::string_view suffix) {
      return weights.Get(LayerTensorName(i, absl::StrCat(kTttBlock, AbslView(suffix))));
    };
    LayerWeights& w = layers_.emplace_back();
    if (c.pre_conv) {
      TTT_ASSIGN_OR_RETURN(w.conv_norm, UploadFloats(layer("conv.norm.weight")));
      TTT_ASSIGN_OR_RETURN(w.conv_w, UploadFloats(layer("conv.conv.weight")));
      TTT_ASSIGN_OR_RETURN(w.conv_b, UploadFloats(layer("conv.conv.bias")));
    }
    TTT_ASSIGN_OR_RETURN(w.seq_norm, UploadFloats(layer("seq_norm.weight")));
    // Each block's rows at its column, zero rows between blocks and after the last.
    std::vector<float> in_proj(columns_.ld * D, 0.0f);
    auto place = [&](std::span<const float> rows, int column) {
      std::copy(rows.begin(), rows.end(), in_proj.begin() + column * D);
    };
    place(ttt("q_proj.weight"), columns_.q);
    if (!c.share_qk) place(ttt("k_proj.weight"), columns_.k);
    place(ttt("v_proj.weight"), columns_.v);
    place(ttt("learnable_ttt_lr_weight"), columns_.lr);
    if (c.use_gate) place(ttt("g_proj.weight"), columns_.g);
    TTT_ASSIGN_OR_RETURN(w.in_proj, UploadGemmWeight(in_proj));
    if (c.share_qk) {
      TTT_ASSIGN_OR_RETURN(w.conv_q_w, UploadFloats(ttt("conv_q.weight")));
      TTT_ASSIGN_OR_RETURN(w.conv_q_b, UploadFloats(ttt("conv_q.bias")));
      TTT_ASSIGN_OR_RETURN(w.conv_k_w, UploadFloats(ttt("conv_k.weight")));
      TTT_ASSIGN_OR_RETURN(w.conv_k_b, UploadFloats(ttt("conv_k.bias")));
    }
    TTT_ASSIGN_OR_RETURN(w.o_proj, UploadGemmWeight(ttt("o_proj.weight")));
    TTT_ASSIGN_OR_RETURN(w.lr_b, UploadFloats(ttt("learnable_ttt_lr_bias")));
    TTT_ASSIGN_OR_RETURN(w.ttt_norm_w, UploadFloats(ttt("ttt_norm_weight")));
    TTT_ASSIGN_OR_RETURN(w.ttt_norm_b, UploadFloats(ttt("ttt_norm_bias")));
    TTT_ASSIGN_OR_RETURN(w.post_norm_w, UploadFloats(ttt("post_norm.weight")));
    TTT_ASSIGN_OR_RETURN(w.post_norm_b, UploadFloats(ttt("post_norm.bias")));
    TTT_ASSIGN_OR_RETURN(w.ffn_norm, UploadFloats(layer("ffn_norm.weight")));
    TTT_ASSIGN_OR_RETURN(w.gate_up, UploadGemmWeight(InterleavedRows(layer("mlp.gate_proj.weight"),
                                                                     layer("mlp.up_proj.weight"),
                                                                     D)));
    TTT_ASSIGN_OR_RETURN(w.down_proj, UploadGemmWeight(layer("mlp.down_proj.weight")));
    TTT_ASSIGN_OR_RETURN(w.tau, UploadFloats(WindowStepScales(c, model_->weights, i)));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::CheckSlot(SequenceSlot slot, std::string_view field) const {
  if (slot < 0 || slot >= capacity_ || lengths_[slot] < 0) {
    return absl::NotFoundError(absl::StrCat(AbslView(field), ": no sequence in slot ", slot));
  }
  return absl::OkStatus();
}

absl::StatusOr<SequenceSlot> CudaEngine::TakeSlot() {
  if (free_slots_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("all ", capacity_, " state slots on the GPU are in use"));
  }
  const SequenceSlot slot = free_slots_.back();
  free_slots_.pop_back();
  lengths_[slot] = 0;
  return slot;
}

absl::StatusOr<SequenceSlot> CudaEngine::CreateSequence() {
  TTT_ASSIGN_OR_RETURN(SequenceSlot slot, TakeSlot());
  unfilled_.push_back(slot);
  return slot;
}

absl::Status CudaEngine::FillFreshStates() {
  for (size_t first = 0; first < unfilled_.size(); first += cu::SlotList::kMax) {
    cu::SlotList list;
    list.count = static_cast<int>(std::min<size_t>(cu::SlotList::kMax, unfilled_.size() - first));
    std::copy_n(unfilled_.begin() + first, list.count, list.slots);
    TTT_CUDA(cu::CopyToSlots(fresh_state_.get<float>(), layout_.total_floats(), list,
                             pool_.get<float>(), stream_));
  }
  unfilled_.clear();
  return absl::OkStatus();
}

absl::Status CudaEngine::ReleaseSequence(SequenceSlot slot) {
  TTT_RETURN_IF_ERROR(CheckSlot(slot, "slot"));
  // Left in the list, a later fill would overwrite whatever next takes the slot.
  std::erase(unfilled_, slot);
  lengths_[slot] = -1;
  free_slots_.push_back(slot);
  return absl::OkStatus();
}

absl::StatusOr<SequenceSlot> CudaEngine::ForkSequence(SequenceSlot source) {
  TTT_RETURN_IF_ERROR(CheckSlot(source, "source"));
  TTT_RETURN_IF_ERROR(FillFreshStates());  // The source may be one.
  TTT_ASSIGN_OR_RETURN(SequenceSlot slot, TakeSlot());
  TTT_CUDA(cudaMemcpyAsync(slot_state(slot), slot_state(source), layout_.total_bytes(),
                           cudaMemcpyDeviceToDevice, stream_));
  lengths_[slot] = lengths_[source];
  return slot;
}

absl::StatusOr<int64_t> CudaEngine::SequenceLength(SequenceSlot slot) const {
  TTT_RETURN_IF_ERROR(CheckSlot(slot, "slot"));
  return lengths_[slot];
}

absl::StatusOr<std::string> CudaEngine::SaveSequence(SequenceSlot slot) const {
  TTT_RETURN_IF_ERROR(CheckSlot(slot, "slot"));
  std::vector<float> state(layout_.total_floats());
  const bool unfilled = std::find(unfilled_.begin(), unfilled_.end(), slot) != unfilled_.end();
  const void* source = unfilled ? fresh_state_.get() : slot_state(slot);
  TTT_CUDA(cudaMemcpyAsync(state.data(), source, layout_.total_bytes(), cudaMemcpyDeviceToHost,
                           stream_));
  TTT_CUDA(cudaStreamSynchronize(stream_));
  if (w1_split_) JoinW1(layout_, state);
  OrderConvHistories(layout_, lengths_[slot], state);
  return EncodeState({model_->weights.fingerprint(), model_->name}, lengths_[slot], state);
}

absl::StatusOr<SequenceSlot> CudaEngine::RestoreSequence(std::string_view bytes) {
  TTT_ASSIGN_OR_RETURN(
      DecodedState decoded,
      DecodeState(bytes, {model_->weights.fingerprint(), model_->name}, layout_.total_floats()));
  if (w1_split_) SplitW1(layout_, decoded.state);
  RingConvHistories(layout_, decoded.length, decoded.state);
  TTT_ASSIGN_OR_RETURN(SequenceSlot slot, TakeSlot());
  const absl::Status copied =
      CopyToDevice(slot_state(slot), decoded.state.data(), layout_.total_bytes());
  if (!copied.ok()) {
    ReleaseSequence(slot).IgnoreError();
    return copied;
  }
  lengths_[slot] = decoded.length;
  return slot;
}

absl::Status CudaEngine::Validate(std::span<const SequenceChunk> batch, LogitsFor which) const {
  auto is_live = [this](SequenceSlot slot) {
    return slot >= 0 && slot < capacity_ && lengths_[slot] >= 0;
  };
  auto chosen_in_flight = [this](SequenceSlot slot) { return chosen_row_[slot] >= 0; };
  return ValidateBatch(batch, which, model_->config.vocab_size, is_live, chosen_in_flight);
}

void CudaEngine::SetChosenRows(std::span<const SequenceChunk> batch) {
  for (SequenceSlot slot : chosen_slots_) chosen_row_[slot] = -1;
  chosen_slots_.clear();
  chosen_set_ = step_set_;
  for (size_t b = 0; b < batch.size(); ++b) {
    chosen_row_[batch[b].slot] = static_cast<int32_t>(b);
    chosen_slots_.push_back(batch[b].slot);
  }
}

absl::Status CudaEngine::EnsureScratch(int64_t rows, int64_t segments, int64_t logit_rows) {
  const ModelConfig& c = model_->config;
  // Powers of two, so that steps of slowly varying sizes (prefill chunks next to decode rows) do
  // not grow the buffers, and retire the decode graphs, again and again.
  auto capacity = [](int64_t n) {
    return std::bit_ceil(static_cast<size_t>(std::max<int64_t>(n, 1)));
  };
  const size_t R = capacity(rows), S = capacity(segments), L = capacity(logit_rows);
  Scratch& s = scratch_;
  if (rows <= s.room.rows && segments <= s.room.segments && logit_rows <= s.room.logit_rows) {
    return absl::OkStatus();
  }
  // The buffers are about to move: the steps in flight must be done with them (the newest's
  // end on download_stream_ follows every copy and kernel of those before it).
  if (!pending_.empty()) TTT_CUDA(cudaEventSynchronize(step_done_[pending_.back().output_set]));
  const size_t D = c.hidden_size, I = c.intermediate_size;
  const size_t nh = c.num_attention_heads, g = gemm_element_bytes(), f4 = sizeof(float);
  bool grew = false;
  auto reserve = [&](auto& buffer, size_t bytes) -> absl::Status {
    if (bytes <= buffer.bytes()) return absl::OkStatus();
    grew = true;
    TTT_RETURN_IF_ERROR(buffer.Reserve(bytes));
    // Rows past a step's own are read by its GEMMs (see Gemm): never uninitialised memory.
    if constexpr (std::is_same_v<std::decay_t<decltype(buffer)>, DeviceBuffer>) {
      TTT_CUDA(cudaMemsetAsync(buffer.get(), 0, buffer.bytes(), stream_));
    }
    return absl::OkStatus();
  };
  // Each part of the layout grows with its count, so a block of the largest step's bytes holds
  // every step within that room.
  const size_t input_bytes = StepInputLayout(R, S, L).bytes;
  for (int set = 0; set < kMaxStepsInFlight; ++set) {
    TTT_RETURN_IF_ERROR(reserve(s.inputs[set], input_bytes));
    TTT_RETURN_IF_ERROR(reserve(s.host_inputs[set], input_bytes));
  }
  for (DeviceBuffer* b : {&s.h, &s.q, &s.k, &s.v, &s.ttt_out, &s.conv_in}) {
    TTT_RETURN_IF_ERROR(reserve(*b, R * D * f4));
  }
  for (DeviceBuffer* b : {&s.x, &s.y_gemm}) TTT_RETURN_IF_ERROR(reserve(*b, R * D * g));
  TTT_RETURN_IF_ERROR(reserve(s.proj, R * columns_.ld * f4));
  TTT_RETURN_IF_ERROR(reserve(s.lr, R * nh * f4));
  TTT_RETURN_IF_ERROR(reserve(s.ffn, R * 2 * I * f4));
  TTT_RETURN_IF_ERROR(reserve(s.ffn_act, R * I * g));
  if (tensor_core_products_) {
    TTT_RETURN_IF_ERROR(reserve(s.row_squares, R * cu::FeedForwardEntry::SquareTiles(D) * f4));
  }
  TTT_RETURN_IF_ERROR(reserve(s.final_rows, L * D * f4));
  TTT_RETURN_IF_ERROR(reserve(s.final_in, L * D * g));
  TTT_RETURN_IF_ERROR(reserve(s.logits, L * c.vocab_size * f4));
  TTT_RETURN_IF_ERROR(reserve(s.host_logits, L * c.vocab_size * f4));
  // The chosen tokens keep what they hold: the next step may take them, Complete may collect them.
  // A step samples one row a segment: its ids and log-probs, 4 bytes each.
  static_assert(sizeof(int32_t) == 4 && sizeof(float) == 4);
  const int32_t stride = static_cast<int32_t>(2 * S);
  if (stride > chosen_stride_) {
    grew = true;
    DeviceBuffer wider;
    TTT_RETURN_IF_ERROR(wider.Reserve(kMaxStepsInFlight * stride * sizeof(int32_t)));
    for (int set = 0; set < kMaxStepsInFlight && chosen_stride_ > 0; ++set) {
      TTT_CUDA(cudaMemcpyAsync(wider.get<int32_t>() + set * stride, chosen_ids(set),
                               chosen_stride_ * sizeof(int32_t), cudaMemcpyDeviceToDevice,
                               stream_));
    }
    TTT_CUDA(cudaStreamSynchronize(stream_));  // Before the old buffer goes.
    chosen_ = std::move(wider);
    chosen_stride_ = stride;
    for (PinnedBuffer& set : host_chosen_) {
      TTT_RETURN_IF_ERROR(set.GrowKeeping(stride * sizeof(int32_t), stream_));
    }
  }
  s.room = {.rows = static_cast<int64_t>(R),
            .segments = static_cast<int64_t>(S),
            .logit_rows = static_cast<int64_t>(L)};
  if (grew) {
    graphs_.clear();
    mixed_graphs_.clear();
  }
  return absl::OkStatus();
}

void CudaEngine::LayOutInputs(int64_t rows, int64_t segments, int64_t logit_rows) {
  Scratch& s = scratch_;
  const StepInputLayout layout(rows, segments, logit_rows);
  s.input_bytes = layout.bytes;
  s.host_in = StepInputs(s.host_inputs[step_set_].get(), layout);
  s.in = StepInputs(s.inputs[step_set_].get(), layout);
}

absl::Status CudaEngine::UploadInputs() {
  Scratch& s = scratch_;
  // The set's device block is free: the step that last used it has been collected.
  TTT_CUDA(cudaMemcpyAsync(s.inputs[step_set_].get(), s.host_inputs[step_set_].get(), s.input_bytes,
                           cudaMemcpyHostToDevice, upload_stream_));
  TTT_CUDA(cudaEventRecord(uploaded_[step_set_], upload_stream_));
  TTT_CUDA(cudaStreamWaitEvent(stream_, uploaded_[step_set_]));
  return absl::OkStatus();
}

void CudaEngine::StageSampling(int64_t b, const SamplingParams& params, uint64_t step) {
  scratch_.host_in.sampling[b] = {.temperature = params.temperature,
                                  .top_k = params.top_k,
                                  .top_p = params.top_p,
                                  .min_p = params.min_p,
                                  .seed = params.seed,
                                  .step = step};
}

void CudaEngine::CollectOutputs(const PendingStep& step, std::vector<float>* logits,
                                std::vector<SampledToken>* tokens) const {
  if (tokens != nullptr) {
    const int32_t* ids = host_chosen_[step.output_set].get<int32_t>();
    const float* logprobs = host_chosen_[step.output_set].get<float>() + step.sampled_rows;
    tokens->resize(step.output_rows);
    for (int64_t r = 0; r < step.output_rows; ++r) (*tokens)[r] = {ids[r], logprobs[r]};
  } else {
    const float* host = scratch_.host_logits.get<float>();
    logits->assign(host, host + step.output_rows * model_->config.vocab_size);
  }
}

int64_t CudaEngine::GemmRows(int64_t rows) {
  // Each new shape costs a heuristic query and perhaps loading a kernel, milliseconds in all,
  // and prefill steps come in every size: rows are rounded up to a few shapes. The buffers have
  // room (EnsureScratch sizes them to powers of two); the extra rows are scratch.
  constexpr int64_t kRowMultiple = 256;
  return rows < kRowMultiple ? std::bit_ceil(static_cast<uint64_t>(rows))
                             : (rows + kRowMultiple - 1) / kRowMultiple * kRowMultiple;
}

absl::Status CudaEngine::Gemm(const void* x, int64_t rows, int64_t in, const void* w, int64_t out,
                              void* y, bool accumulate, cu::ElementType y_type) {
  if (rows == 0) return absl::OkStatus();
  return gemm_->Run({.rows = GemmRows(rows),
                     .in = in,
                     .out = out,
                     .accumulate = accumulate,
                     .bfloat16_y = y_type == cu::ElementType::kBFloat16},
                    x, w, y);
}

absl::Status CudaEngine::Product(const cu::ProductInput& input, int64_t rows, int64_t in,
                                 const void* w, int64_t out, cu::ProductOutput output, void* y,
                                 void* staging) {
  if (rows == 0) return absl::OkStatus();
  if (cu::SkinnyGemmFits(GemmRows(rows), input, in, gemm_type(), w)) {
    TTT_CUDA(cu::SkinnyGemm(GemmRows(rows), input, w, in, out, gemm_type(), output, y, stream_));
    return absl::OkStatus();
  }
  TTT_CUDA(cu::MakeProductInput(input, rows, in, staging, gemm_type(), stream_));
  if (output != cu::ProductOutput::kSwiGlu) {
    return Gemm(staging, rows, in, w, out, static_cast<float*>(y),
                output == cu::ProductOutput::kAccumulate);
  }
  void* gate_up = scratch_.ffn.get();
  const cu::ElementType sums = GateUpSums(rows, staging, in, w, out);
  TTT_RETURN_IF_ERROR(Gemm(staging, rows, in, w, out, gate_up, /*accumulate=*/false, sums));
  TTT_CUDA(cu::SwiGlu(gate_up, sums, rows, out / 2, y, gemm_type(), stream_));
  return absl::OkStatus();
}

absl::Status CudaEngine::Forward(std::span<const SequenceChunk> batch, LogitsFor which,
                                 std::vector<float>* logits) {
  if (!pending_.empty()) return StepInFlightError();
  TTT_RETURN_IF_ERROR(Validate(batch, which));
  TTT_RETURN_IF_ERROR(Enqueue(batch, which, {}, /*sample=*/false));
  return Complete(logits, nullptr);
}

absl::Status CudaEngine::ForwardAndSample(std::span<const SequenceChunk> batch,
                                          std::span<const SamplingParams> sampling,
                                          std::vector<SampledToken>* tokens) {
  // Finish would hand over the oldest step's tokens, not this one's.
  if (!pending_.empty()) return StepInFlightError();
  TTT_RETURN_IF_ERROR(StartForwardAndSample(batch, sampling));
  return FinishForwardAndSample(tokens);
}

absl::Status CudaEngine::StartForwardAndSample(std::span<const SequenceChunk> batch,
                                               std::span<const SamplingParams> sampling) {
  if (pending_.size() >= kMaxStepsInFlight) return StepInFlightError();
  TTT_RETURN_IF_ERROR(Validate(batch, LogitsFor::kLastToken));
  TTT_RETURN_IF_ERROR(ValidateBatchSampling(batch, sampling));
  return Enqueue(batch, LogitsFor::kLastToken, sampling, /*sample=*/true);
}

absl::Status CudaEngine::FinishForwardAndSample(std::vector<SampledToken>* tokens) {
  if (pending_.empty()) return NoStepInFlightError();
  return Complete(nullptr, tokens);
}

absl::Status CudaEngine::Enqueue(std::span<const SequenceChunk> batch, LogitsFor which,
                                 std::span<const SamplingParams> sampling, bool sample) {
  // The set's staging block is rewritten below: its last upload must have left it (that of a
  // step collected has; that of a step that failed part-way may not have).
  TTT_CUDA(cudaEventSynchronize(uploaded_[step_set_]));
  TTT_CUDA(cudaEventRecord(step_start_[step_set_], stream_));
  TTT_RETURN_IF_ERROR(FillFreshStates());
  const bool one_token_each =
      !batch.empty() && std::all_of(batch.begin(), batch.end(),
                                    [](const SequenceChunk& chunk) { return chunk.length() == 1; });
  if (one_token_each && which != LogitsFor::kNone) {
    return EnqueueDecodeStep(batch, sampling, sample);
  }

  int64_t rows = 0, one_row_segments = 0;
  for (const SequenceChunk& chunk : batch) {
    rows += chunk.length();
    one_row_segments += chunk.length() == 1;
  }
  const int64_t segments = batch.size();
  if (sample && which == LogitsFor::kLastToken) {  // No chunk is empty (Validate).
    const std::optional<MixedBucket> bucket =
        MixedBucketFor(rows, one_row_segments, segments - one_row_segments);
    if (bucket && mixed_graphs_.empty() && mixed_decode_rows_ > 0) {
      // Buffers grown past the room prepared dropped them (EnsureScratch): captured again, all
      // at once, as the decode graphs are one by one.
      TTT_RETURN_IF_ERROR(CaptureMixedGraphs());
    }
    if (bucket) {
      if (const auto found = mixed_graphs_.find({*bucket, step_set_});
          found != mixed_graphs_.end()) {
        return EnqueueMixedStep(batch, sampling, *bucket, *found->second->exec());
      }
    }
  }
  const int64_t logit_rows =
      which == LogitsFor::kEveryToken ? rows : (which == LogitsFor::kLastToken ? segments : 0);
  const bool has_output = which != LogitsFor::kNone;
  if (rows == 0) return EndStep(has_output, 0, /*sample=*/false, 0);
  TTT_RETURN_IF_ERROR(EnsureScratch(rows, segments, logit_rows));
  LayOutInputs(rows, segments, logit_rows);
  const StepInputs& staged = scratch_.host_in;
  int32_t row = 0;
  for (int64_t b = 0; b < segments; ++b) {
    const SequenceChunk& chunk = batch[b];
    const int32_t first = row;
    row = StageChunk(chunk, b, row);
    if (which == LogitsFor::kEveryToken) {
      for (int32_t r = first; r < row; ++r) staged.out_rows[r] = r;
    }
    if (which == LogitsFor::kLastToken) staged.out_rows[b] = row - 1;
    if (sample) StageSampling(b, sampling[b], lengths_[chunk.slot] + chunk.length());
  }
  const int64_t decode_segments = StageDecodeOrder(segments);
  TTT_RETURN_IF_ERROR(UploadInputs());
  TTT_RETURN_IF_ERROR(
      EnqueueForward(rows, segments, decode_segments, logit_rows, /*gather=*/true, sample));
  for (const SequenceChunk& chunk : batch) lengths_[chunk.slot] += chunk.length();
  SetChosenRows(sample ? batch : std::span<const SequenceChunk>());
  return EndStep(has_output, logit_rows, sample, logit_rows);
}

absl::Status CudaEngine::EnqueueDecodeStep(std::span<const SequenceChunk> batch,
                                           std::span<const SamplingParams> sampling, bool sample) {
  const int64_t n = batch.size();
  // Buckets are powers of two; the rows past the batch are idle segments (count 0): they name a
  // live slot but read none of its state and change none.
  int64_t bucket = 1;
  while (bucket < n) bucket *= 2;
  TTT_RETURN_IF_ERROR(EnsureScratch(bucket, bucket, bucket));
  LayOutDecodeInputs(bucket);
  const StepInputs& staged = scratch_.host_in;
  for (int64_t b = 0; b < bucket; ++b) {
    const bool real = b < n;
    const SequenceSlot slot = real ? batch[b].slot : batch[0].slot;
    staged.segments[b] = {.row = static_cast<int32_t>(b),
                          .count = real ? 1 : 0,
                          .slot = slot,
                          .start = real ? lengths_[slot] : 0};
    staged.tokens[b] = real ? StagedToken(batch[b], 0) : 0;
    staged.row_segment[b] = static_cast<int32_t>(b);
    if (sample) StageSampling(b, real ? sampling[b] : SamplingParams{}, lengths_[slot] + 1);
  }
  StageDecodeOrder(bucket);
  TTT_RETURN_IF_ERROR(UploadInputs());

  TTT_ASSIGN_OR_RETURN(const cudaGraphExec_t graph, DecodeGraphFor(bucket, sample));
  TTT_CUDA(cudaGraphLaunch(graph, stream_));
  for (const SequenceChunk& chunk : batch) lengths_[chunk.slot] += 1;
  SetChosenRows(sample ? batch : std::span<const SequenceChunk>());
  return EndStep(/*has_output=*/true, n, sample, /*sampled_rows=*/bucket, /*replays_graph=*/true);
}

int64_t CudaEngine::StageDecodeOrder(int64_t segments, int64_t scanned_padding) {
  Scratch& s = scratch_;
  cu::Segment* staged = s.host_in.segments;
  const int64_t K = model_->config.mini_batch_size;
  auto scanned = [&](int64_t b) { return staged[b].count > 1 || b >= scanned_padding; };
  decode_candidates_.clear();
  decode_work_.clear();
  for (int64_t b = 0; b < segments; ++b) {
    if (scanned(b)) continue;
    decode_candidates_.push_back(static_cast<int32_t>(b));
    decode_work_.push_back(staged[b].count == 0           ? DecodeWork::kIdle
                           : staged[b].start % K == K - 1 ? DecodeWork::kCommit
                                                          : DecodeWork::kToken);
  }
  const int64_t decode_segments = decode_candidates_.size();
  decode_order_.resize(decode_segments);
  cu::TttProjectionInputs inputs = TttInputs(0);
  inputs.proj = s.proj.get<float>();
  const cu::TttScanParams params = TttParams(0);
  PlanDecodeOrder(
      decode_work_, params.nh,
      cu::TttDecodeWarps(params, inputs, TttOffsets(), static_cast<int>(decode_segments),
                         /*beside_scan=*/decode_segments < segments),
      decode_order_);
  cu::Segment* ordered = staged + segments;
  for (int64_t i = 0; i < decode_segments; ++i) {
    *ordered++ = staged[decode_candidates_[decode_order_[i]]];
  }
  for (int64_t b = 0; b < segments; ++b) {
    if (scanned(b)) *ordered++ = staged[b];
  }
  return decode_segments;
}

absl::StatusOr<std::unique_ptr<DecodeGraph>> CudaEngine::CaptureForward(
    int64_t rows, int64_t num_segments, int64_t decode_segments, int64_t logit_rows, bool gather,
    bool sample) {
  auto captured = std::make_unique<DecodeGraph>();
  TTT_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  const absl::Status enqueued =
      EnqueueForward(rows, num_segments, decode_segments, logit_rows, gather, sample);
  const cudaError_t ended = cudaStreamEndCapture(stream_, captured->graph());
  TTT_RETURN_IF_ERROR(enqueued);
  TTT_CUDA(ended);
  TTT_CUDA(cudaGraphInstantiate(captured->exec(), *captured->graph(), 0));
  return captured;
}

absl::StatusOr<cudaGraphExec_t> CudaEngine::DecodeGraphFor(int64_t bucket, bool sample) {
  std::unique_ptr<DecodeGraph>& graph = graphs_[{bucket, sample, step_set_}];
  if (graph == nullptr) {
    // A mixed step that failed part-way leaves the scan stream unjoined; joined inside the
    // capture, its wait would reach outside the graph.
    TTT_RETURN_IF_ERROR(JoinScanStream());
    LayOutDecodeInputs(bucket);
    TTT_ASSIGN_OR_RETURN(graph, CaptureForward(bucket, bucket, /*decode_segments=*/bucket, bucket,
                                               /*gather=*/false, sample));
  }
  return *graph->exec();
}

std::optional<CudaEngine::MixedBucket> CudaEngine::MixedBucketFor(
    int64_t rows, int64_t decode_segments, int64_t scanned_segments) const {
  if (decode_segments == 0 || scanned_segments == 0 || rows > kMixedGraphMaxRows) {
    return std::nullopt;
  }
  const auto scanned = std::ranges::lower_bound(mixed_scanned_ladder_, scanned_segments);
  if (scanned == mixed_scanned_ladder_.end()) return std::nullopt;
  return MixedBucket{.rows = GemmRows(rows),
                     .segments = GemmRows(decode_segments + *scanned),
                     .scanned_segments = *scanned};
}

absl::Status CudaEngine::EnqueueMixedStep(std::span<const SequenceChunk> batch,
                                          std::span<const SamplingParams> sampling,
                                          const MixedBucket& bucket, cudaGraphExec_t graph) {
  // The graph was captured with the buffers as they are, so they have the bucket's room
  // (growing them drops every mixed graph).
  const int64_t n = batch.size();
  const int64_t segments = bucket.segments;
  LayOutInputs(bucket.rows, segments, segments);
  const StepInputs& staged = scratch_.host_in;
  int32_t row = 0;
  int64_t one_row_segments = 0, last_prompt = 0;
  for (int64_t b = 0; b < n; ++b) {
    const SequenceChunk& chunk = batch[b];
    row = StageChunk(chunk, b, row);
    one_row_segments += chunk.length() == 1;
    if (chunk.length() > 1) last_prompt = b;
    staged.out_rows[b] = row - 1;
    StageSampling(b, sampling[b], lengths_[chunk.slot] + chunk.length());
  }
  // The padding: idle decode segments up to the bucket's, then empty scanned ones. Empty
  // segments name a live slot (one the step takes), whose state none of them reads or writes.
  const SequenceSlot any_slot = batch[0].slot;
  const int64_t scanned_padding = n + bucket.decode_segments() - one_row_segments;
  for (int64_t b = n; b < segments; ++b) {
    staged.segments[b] = {.row = row, .count = 0, .slot = any_slot, .start = 0};
    staged.out_rows[b] = 0;
    StageSampling(b, SamplingParams{}, 0);
  }
  for (int64_t r = row; r < bucket.rows; ++r) {
    staged.tokens[r] = 0;
    staged.row_segment[r] = static_cast<int32_t>(last_prompt);
  }
  const int64_t decode_segments = StageDecodeOrder(segments, scanned_padding);
  if (decode_segments != bucket.decode_segments()) {
    return absl::InternalError(absl::StrCat("mixed step staged ", decode_segments,
                                            " decode segments for a bucket of ",
                                            bucket.decode_segments()));
  }
  TTT_RETURN_IF_ERROR(UploadInputs());
  TTT_CUDA(cudaGraphLaunch(graph, stream_));
  for (const SequenceChunk& chunk : batch) lengths_[chunk.slot] += chunk.length();
  SetChosenRows(batch);
  return EndStep(/*has_output=*/true, n, /*sample=*/true, /*sampled_rows=*/segments,
                 /*replays_graph=*/true);
}

absl::Status CudaEngine::CaptureMixedGraphs() {
  const int64_t decode_rows = mixed_decode_rows_, prompt_rows = mixed_prompt_rows_;
  int sms = 0;
  TTT_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, options_.device));
  const int64_t filling_sms = sms / model_->config.num_attention_heads;
  mixed_scanned_ladder_.clear();
  for (int64_t scanned = 1; scanned <= kMixedGraphMaxScanned; scanned *= 2) {
    if (filling_sms > scanned / 2 && filling_sms < scanned) {
      mixed_scanned_ladder_.push_back(filling_sms);
    }
    mixed_scanned_ladder_.push_back(scanned);
  }
  TTT_RETURN_IF_ERROR(JoinScanStream());  // As DecodeGraphFor.
  absl::Cleanup restore_step_set = [this, step_set = step_set_] { step_set_ = step_set; };
  // A step of d decode segments and up to `scanned` scanned ones falls in the bucket of
  // GemmRows(d + scanned) segments: d past the smaller such count before it. Each bucket's fewest
  // rows: its fewest decode segments, and its fewest prompts of two tokens (a prompt of one is a
  // decode segment); its most: its most decode segments and the budget's prompt rows.
  int64_t smaller_segments = 0;
  for (int64_t segments = 1; smaller_segments - mixed_scanned_ladder_.back() < decode_rows;
       smaller_segments = segments, segments = GemmRows(segments + 1)) {
    int64_t fewest_scanned = 1;
    for (const int64_t scanned : mixed_scanned_ladder_) {
      if (scanned >= segments) break;
      const int64_t fewest_decode = std::max<int64_t>(1, smaller_segments + 1 - scanned);
      const int64_t most_decode = std::min(segments - scanned, decode_rows);
      const int64_t fewest_rows = fewest_decode + 2 * fewest_scanned;
      const int64_t most_rows = std::min(most_decode + prompt_rows, kMixedGraphMaxRows);
      const bool reachable = fewest_decode <= most_decode && fewest_rows <= most_rows &&
                             fewest_decode + fewest_scanned <= capacity_;
      for (int64_t rows = GemmRows(fewest_rows); reachable && rows <= GemmRows(most_rows);
           rows = GemmRows(rows + 1)) {
        const MixedBucket bucket{.rows = rows, .segments = segments, .scanned_segments = scanned};
        for (int set = 0; set < kMaxStepsInFlight; ++set) {
          step_set_ = set;
          LayOutInputs(rows, segments, segments);
          TTT_ASSIGN_OR_RETURN(std::unique_ptr<DecodeGraph> graph,
                               CaptureForward(rows, segments, bucket.decode_segments(), segments,
                                              /*gather=*/true, /*sample=*/true));
          mixed_graphs_[std::pair(bucket, set)] = std::move(graph);
        }
      }
      fewest_scanned = scanned + 1;
    }
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::PrepareForSteps(int64_t max_rows, int64_t decode_rows) {
  const ModelConfig& c = model_->config;
  const int64_t D = c.hidden_size, I = c.intermediate_size;
  const absl::Time started = absl::Now();
  size_t free_before = 0, free_after = 0, total = 0;
  TTT_CUDA(cudaMemGetInfo(&free_before, &total));
  // Mixed steps sample a row for each segment of their bucket, which rounds up their decode
  // segments and scanned ones (MixedBucketFor).
  const int64_t segments = GemmRows(decode_rows + kMixedGraphMaxScanned);
  TTT_RETURN_IF_ERROR(EnsureScratch(max_rows, segments, segments));
  // Every GEMM shape of such steps, once, on whatever the buffers hold.
  const LayerWeights& w = layers_.front();
  Scratch& s = scratch_;
  for (int64_t rows = 1; rows <= max_rows; rows = GemmRows(rows) + 1) {
    TTT_RETURN_IF_ERROR(
        Gemm(s.x.get(), rows, D, w.in_proj, columns_.ld, s.proj.get<float>(), false));
    TTT_RETURN_IF_ERROR(Gemm(s.y_gemm.get(), rows, D, w.o_proj, D, s.h.get<float>(), true));
    TTT_RETURN_IF_ERROR(Gemm(s.x.get(), rows, D, w.gate_up, 2 * I, s.ffn.get(), false,
                             GateUpSums(rows, s.x.get(), D, w.gate_up, 2 * I)));
    TTT_RETURN_IF_ERROR(Gemm(s.ffn_act.get(), rows, I, w.down_proj, D, s.h.get<float>(), true));
    if (rows <= segments) {
      TTT_RETURN_IF_ERROR(
          Gemm(s.final_in.get(), rows, D, lm_head_, c.vocab_size, s.logits.get<float>(), false));
    }
  }
  const int step_set = step_set_;
  for (int64_t bucket = 1; bucket <= decode_rows; bucket *= 2) {
    for (step_set_ = 0; step_set_ < kMaxStepsInFlight; ++step_set_) {
      TTT_RETURN_IF_ERROR(DecodeGraphFor(bucket, /*sample=*/true).status());
    }
  }
  step_set_ = step_set;
  mixed_decode_rows_ = decode_rows;
  mixed_prompt_rows_ = max_rows - decode_rows;
  size_t free_before_mixed = 0;
  TTT_CUDA(cudaMemGetInfo(&free_before_mixed, &total));
  const absl::Time mixed_started = absl::Now();
  TTT_RETURN_IF_ERROR(CaptureMixedGraphs());
  TTT_CUDA(cudaStreamSynchronize(stream_));
  const absl::Time ended = absl::Now();
  TTT_CUDA(cudaMemGetInfo(&free_after, &total));
  auto mib = [](size_t before, size_t after) {
    return (static_cast<double>(before) - static_cast<double>(after)) / (1 << 20);
  };
  preparation_ = absl::StrFormat(
      "for steps of up to %d rows and %d decoding sequences in %.2f s and %.0f MiB of device "
      "memory: buffers, products, %d decode graphs, and %d graphs of steps that mix prompts "
      "with decode rows (%.2f s, %.0f MiB)",
      max_rows, decode_rows, absl::ToDoubleSeconds(ended - started),
      mib(free_before, free_after), graphs_.size(), mixed_graphs_.size(),
      absl::ToDoubleSeconds(ended - mixed_started), mib(free_before_mixed, free_after));
  return absl::OkStatus();
}

absl::Status CudaEngine::EndStep(bool has_output, int64_t output_rows, bool sample,
                                 int64_t sampled_rows, bool replays_graph) {
  const int set = step_set_;
  step_set_ = (step_set_ + 1) % kMaxStepsInFlight;
  TTT_CUDA(cudaEventRecord(finished_[set], stream_));
  TTT_CUDA(cudaStreamWaitEvent(download_stream_, finished_[set]));
  if (sample && output_rows > 0) {
    // The batch's ids, the idle rows' after them, then the batch's log-probs.
    TTT_CUDA(cudaMemcpyAsync(host_chosen_[set].get(), chosen_ids(set),
                             (sampled_rows + output_rows) * sizeof(int32_t), cudaMemcpyDeviceToHost,
                             download_stream_));
  } else if (has_output && output_rows > 0) {
    TTT_CUDA(cudaMemcpyAsync(scratch_.host_logits.get(), scratch_.logits.get(),
                             output_rows * model_->config.vocab_size * sizeof(float),
                             cudaMemcpyDeviceToHost, download_stream_));
  }
  TTT_CUDA(cudaEventRecord(step_done_[set], download_stream_));
  pending_.push_back({.has_output = has_output,
                      .output_rows = output_rows,
                      .sampled_rows = sampled_rows,
                      .output_set = set,
                      .replays_graph = replays_graph});
  return absl::OkStatus();
}

absl::Status CudaEngine::Complete(std::vector<float>* logits, std::vector<SampledToken>* tokens) {
  const PendingStep step = pending_.front();
  pending_.pop_front();
  // Nothing newer chooses tokens once the newest step is collected.
  if (pending_.empty()) SetChosenRows({});
  TTT_CUDA(cudaEventSynchronize(step_done_[step.output_set]));
  float milliseconds = 0;
  TTT_CUDA(cudaEventElapsedTime(&milliseconds, step_start_[step.output_set],
                                step_done_[step.output_set]));
  collected_device_time_ = absl::Milliseconds(milliseconds);
  collected_replayed_graph_ = step.replays_graph;
  if (step.has_output) CollectOutputs(step, logits, tokens);
  return absl::OkStatus();
}

absl::Status CudaEngine::EnqueueForward(int64_t rows, int64_t num_segments, int64_t decode_segments,
                                        int64_t logit_rows, bool gather, bool sample) {
  const ModelConfig& c = model_->config;
  const int64_t D = c.hidden_size, V = c.vocab_size;
  Scratch& s = scratch_;
  TTT_CUDA(cu::EmbeddingGather(s.in.tokens, rows, chosen_.get<int32_t>(), embedding_, gemm_type(),
                               D, s.h.get<float>(), stream_));
  const bool one_token_each = OneTokenEach(rows, num_segments, decode_segments);
  if (rows == 1 && one_token_each && sequence_step_) {
    TTT_CUDA(cu::SequenceStep(SequenceStepArgs(), sequence_step_layer_, gemm_type(), stream_));
  } else {
    for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
      TTT_RETURN_IF_ERROR(ForwardLayer(layer, rows, num_segments, decode_segments));
    }
    TTT_RETURN_IF_ERROR(JoinScanStream());
  }
  if (logit_rows == 0) return absl::OkStatus();
  const float* final_rows = s.h.get<float>();
  if (gather) {
    TTT_CUDA(cu::GatherRows(s.h.get<float>(), s.in.out_rows, logit_rows, D,
                            s.final_rows.get<float>(), stream_));
    final_rows = s.final_rows.get<float>();
  }
  const cu::ProductInput final_norm{.kind = cu::ProductInput::Kind::kRmsNorm,
                                    .source = final_rows,
                                    .weight = final_norm_,
                                    .eps = static_cast<float>(c.rms_norm_eps)};
  TTT_RETURN_IF_ERROR(Product(final_norm, logit_rows, D, lm_head_, V, cu::ProductOutput::kStore,
                              s.logits.get(), s.final_in.get()));
  if (sample) {
    int32_t* ids = chosen_ids(step_set_);
    TTT_CUDA(cu::SampleTokens(s.logits.get<float>(), logit_rows, V, s.in.sampling, ids,
                              reinterpret_cast<float*>(ids + logit_rows), stream_));
  }
  return absl::OkStatus();
}

cu::TttProjectionInputs CudaEngine::TttInputs(int64_t layer) const {
  const ModelConfig& c = model_->config;
  const LayerWeights& w = layers_[layer];
  return {.proj = nullptr,
          .columns = columns_,
          .rope = rope_,
          .share_qk = c.share_qk,
          .conv = {.q_weight = w.conv_q_w,
                   .q_bias = w.conv_q_b,
                   .k_weight = w.conv_k_w,
                   .k_bias = w.conv_k_b,
                   .ck = static_cast<int>(c.conv_kernel),
                   .history_offset = layout_.conv_qk},
          .lr_bias = w.lr_b,
          .base_lr = static_cast<float>(c.ttt_base_lr)};
}

cu::TttScanParams CudaEngine::TttParams(int64_t layer) const {
  const ModelConfig& c = model_->config;
  const LayerWeights& w = layers_[layer];
  return {.nh = static_cast<int>(c.num_attention_heads),
          .f = static_cast<int>(c.head_dim()),
          .f1 = static_cast<int>(c.inner_width()),
          .K = static_cast<int>(c.mini_batch_size),
          .mlp = c.ttt_layer_type == TttLayerType::kMlp,
          .tau = w.tau,
          .ln_weight = w.ttt_norm_w,
          .ln_bias = w.ttt_norm_b,
          .ln_eps = kLayerNormEps};
}

cu::TttStateOffsets CudaEngine::TttOffsets() const {
  return {layout_.W1,         layout_.b1,         layout_.W2,         layout_.b2,
          layout_.pending_k,  layout_.pending_g1, layout_.pending_lr, layout_.pending_x2,
          layout_.pending_g2, w1_split_};
}

absl::Status CudaEngine::PrepareSequenceStep() {
  const ModelConfig& c = model_->config;
  std::vector<cu::SequenceStepLayer> table;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerWeights& w = layers_[i];
    table.push_back({.in_proj = w.in_proj,
                     .o_proj = w.o_proj,
                     .gate_up = w.gate_up,
                     .down = w.down_proj,
                     .conv_norm = w.conv_norm,
                     .conv_w = w.conv_w,
                     .conv_b = w.conv_b,
                     .seq_norm = w.seq_norm,
                     .post_norm_w = w.post_norm_w,
                     .post_norm_b = w.post_norm_b,
                     .ffn_norm = w.ffn_norm,
                     .ttt_inputs = TttInputs(i),
                     .ttt = TttParams(i),
                     .state_offset = layout_.layer_offset(i)});
  }
  // Every layer is laid out alike: the first tells whether the kernel covers the model.
  if (table.empty() || !cu::SetUpSequenceStep(SequenceStepArgs(), table.front(), gemm_type())) {
    if (options_.single_sequence_kernel == CudaEngineOptions::SingleSequenceKernel::kRequired) {
      return absl::FailedPreconditionError(
          "single_sequence_kernel: required, but the single-sequence kernel does not cover this "
          "model on this device");
    }
    return absl::OkStatus();
  }
  TTT_RETURN_IF_ERROR(sequence_step_layers_.Reserve(table.size() * sizeof(table[0])));
  TTT_RETURN_IF_ERROR(
      CopyToDevice(sequence_step_layers_.get(), table.data(), table.size() * sizeof(table[0])));
  constexpr size_t kCounterBytes = cu::kSequenceStepCounters * sizeof(unsigned);
  TTT_RETURN_IF_ERROR(sequence_step_counters_.Reserve(kCounterBytes));
  TTT_CUDA(cudaMemsetAsync(sequence_step_counters_.get(), 0, kCounterBytes, stream_));
  sequence_step_layer_ = table.front();
  sequence_step_ = true;
  return absl::OkStatus();
}

absl::Status CudaEngine::ChooseSingleSequencePath() {
  using Choice = CudaEngineOptions::SingleSequenceKernel;
  if (options_.single_sequence_kernel == Choice::kOff) {
    single_sequence_decode_ = "kernels per stage";
    return absl::OkStatus();
  }
  if (!sequence_step_) {
    single_sequence_decode_ = "kernels per stage (the one kernel does not cover this model)";
    return absl::OkStatus();
  }
  if (options_.single_sequence_kernel != Choice::kWhereFaster) {
    single_sequence_decode_ = "one kernel";
    return absl::OkStatus();
  }
  TTT_ASSIGN_OR_RETURN(const SequenceSlot slot, CreateSequence());
  absl::StatusOr<absl::Duration> one_kernel = TimeSingleSequenceStep(slot);
  sequence_step_ = false;
  absl::StatusOr<absl::Duration> per_stage = TimeSingleSequenceStep(slot);
  TTT_RETURN_IF_ERROR(ReleaseSequence(slot));
  TTT_RETURN_IF_ERROR(one_kernel.status());
  TTT_RETURN_IF_ERROR(per_stage.status());
  sequence_step_ = *one_kernel < *per_stage;
  // The batch-1 graph holds the path timed last, the kernels per stage: kept if they won.
  if (sequence_step_) ForgetSamplingGraphs(1);
  single_sequence_decode_ = absl::StrFormat(
      "%s (timed at start: one kernel %.3f ms a step, kernels per stage %.3f ms)",
      sequence_step_ ? "one kernel" : "kernels per stage", absl::ToDoubleMilliseconds(*one_kernel),
      absl::ToDoubleMilliseconds(*per_stage));
  return absl::OkStatus();
}

absl::StatusOr<absl::Duration> CudaEngine::TimeSingleSequenceStep(SequenceSlot slot) {
  // A few steps first: the first captures the graph, and the clocks settle.
  constexpr int kWarmUp = 3, kTimed = 15;
  ForgetSamplingGraphs(1);
  const int32_t token = 0;
  const SequenceChunk chunk{.slot = slot, .tokens = {&token, 1}};
  const SamplingParams greedy;
  std::vector<SampledToken> tokens;
  std::vector<absl::Duration> times;
  for (int step = 0; step < kWarmUp + kTimed; ++step) {
    TTT_RETURN_IF_ERROR(ForwardAndSample({&chunk, 1}, {&greedy, 1}, &tokens));
    if (step >= kWarmUp) times.push_back(*collected_device_time_);
  }
  return Median(std::move(times));
}

cu::SequenceStepArgs CudaEngine::SequenceStepArgs() const {
  const ModelConfig& c = model_->config;
  const Scratch& s = scratch_;
  return {.layers = sequence_step_layers_.get<const cu::SequenceStepLayer>(),
          .num_layers = static_cast<int>(c.num_hidden_layers),
          .D = static_cast<int>(c.hidden_size),
          .I = static_cast<int>(c.intermediate_size),
          .f = static_cast<int>(c.head_dim()),
          .rms_eps = static_cast<float>(c.rms_norm_eps),
          .ln_eps = kLayerNormEps,
          .conv_history_offset = layout_.conv_pre,
          .offsets = TttOffsets(),
          .segment = s.in.segments,
          .states = pool_.get<float>(),
          .slot_floats = layout_.total_floats(),
          .h = s.h.get<float>(),
          .proj = s.proj.get<float>(),
          .ttt_out = s.ttt_out.get<float>(),
          .act = s.ffn_act.get(),
          .counters = sequence_step_counters_.get<unsigned>()};
}

absl::Status CudaEngine::JoinScanStream() {
  if (scan_stream_joined_) return absl::OkStatus();
  scan_stream_joined_ = true;  // Even if the calls fail: a later step does not retry them.
  TTT_CUDA(cudaEventRecord(scanned_, scan_stream_));
  TTT_CUDA(cudaStreamWaitEvent(stream_, scanned_));
  return absl::OkStatus();
}

absl::Status CudaEngine::ForwardLayer(int64_t layer, int64_t rows, int64_t num_segments,
                                      int64_t decode_segments) {
  const bool one_token_each = OneTokenEach(rows, num_segments, decode_segments);
  const ModelConfig& c = model_->config;
  const LayerWeights& w = layers_[layer];
  const int D = c.hidden_size, I = c.intermediate_size, nh = c.num_attention_heads;
  const int f = c.head_dim(), ck = c.conv_kernel;
  const float rms_eps = static_cast<float>(c.rms_norm_eps);
  Scratch& s = scratch_;
  const cu::Segment* segments = s.in.segments;
  const int32_t* row_segment = s.in.row_segment;
  const cu::StateAddress state{pool_.get<float>(), layout_.total_floats(),
                               layout_.layer_offset(layer)};
  float* h = s.h.get<float>();

  // The step's segments again, in the order the TTT kernels take them (StageDecodeOrder): the
  // decode segments first, then the scanned ones.
  const cu::Segment* ordered = segments + num_segments;

  // The TTT layer's inputs (spec §3.2–3.4): one GEMM for every projection of x (normed), then
  // the convs, RoPE and the step sizes.
  if (c.pre_conv && one_token_each) {
    TTT_CUDA(cu::PreConvDecode(h, rows, /*segment_rows=*/false, D, w.conv_norm, rms_eps, w.conv_w,
                               w.conv_b, ck, segments, state, layout_.conv_pre, w.seq_norm,
                               s.x.get(), gemm_type(), stream_));
  } else if (c.pre_conv) {
    // The prompts' rows through the general form, the decode rows through the decode form: a
    // step with one prompt joining then pays for that prompt's rows, not for all of them.
    float* normed = s.conv_in.get<float>();
    TTT_CUDA(
        cu::RmsNorm(h, rows, D, w.conv_norm, rms_eps, normed, cu::ElementType::kFloat32, stream_));
    TTT_CUDA(cu::PreConvRows(normed, rows, D, w.conv_w, w.conv_b, ck, segments, row_segment, state,
                             layout_.conv_pre, h, rms_eps, w.seq_norm, s.x.get(), gemm_type(),
                             /*skip_one_row_segments=*/true, stream_));
    TTT_CUDA(cu::PreConvDecode(h, decode_segments, /*segment_rows=*/true, D, w.conv_norm, rms_eps,
                               w.conv_w, w.conv_b, ck, ordered, state, layout_.conv_pre, w.seq_norm,
                               s.x.get(), gemm_type(), stream_));
    TTT_CUDA(cu::AdvanceConvHistory(normed, D, num_segments - decode_segments, D, ck,
                                    ordered + decode_segments, state, layout_.conv_pre, stream_));
  } else {
    TTT_CUDA(cu::RmsNorm(h, rows, D, w.seq_norm, rms_eps, s.x.get(), gemm_type(), stream_));
  }
  float* proj = s.proj.get<float>();
  TTT_RETURN_IF_ERROR(JoinScanStream());  // The previous layer's history advance reads proj.
  if (TensorCoreProducts(rows)) {
    TTT_CUDA(cu::TensorCoreProduct(s.x.get(), static_cast<int>(rows), D, w.in_proj,
                                   static_cast<int>(columns_.ld), proj, columns_.ld, stream_));
  } else {
    TTT_RETURN_IF_ERROR(Gemm(s.x.get(), rows, D, w.in_proj, columns_.ld, proj, false));
  }
  cu::TttProjectionInputs inputs = TttInputs(layer);
  inputs.proj = proj;
  const cu::TttScanParams params = TttParams(layer);
  const cu::TttStateOffsets offsets = TttOffsets();
  float* ttt_out = s.ttt_out.get<float>();
  const bool decode_kernel =
      decode_segments > 0 && cu::TttDecodeFits(params, inputs, state, offsets);
  if (one_token_each && decode_kernel) {
    TTT_CUDA(cu::TttDecode(params, inputs, ordered, num_segments, state, offsets, ttt_out,
                           /*beside_scan=*/false, stream_));
  } else {
    // The scan's segments, and the stream it runs on: with the decode kernel, the segments
    // after the decode ones, beside it (scan_stream_); the two touch disjoint rows and states.
    const cu::Segment* scanned = segments;
    int64_t num_scanned = num_segments;
    cudaStream_t scan_stream = stream_;
    if (decode_kernel) {
      TTT_CUDA(cudaEventRecord(projected_, stream_));
      TTT_CUDA(cudaStreamWaitEvent(scan_stream_, projected_));
      scan_stream_joined_ = false;
      TTT_CUDA(cu::TttDecode(params, inputs, ordered, decode_segments, state, offsets, ttt_out,
                             /*beside_scan=*/decode_segments < num_segments, stream_));
      scanned = ordered + decode_segments;
      num_scanned = num_segments - decode_segments;
      scan_stream = scan_stream_;
    }
    float *q = s.q.get<float>(), *k = s.k.get<float>(), *v = s.v.get<float>();
    float* lr = s.lr.get<float>();
    // The scanned rows' inputs (all rows where the decode kernel takes none).
    TTT_CUDA(cu::PrepareTttInputs(inputs, rows, nh, f, c.mini_batch_size, segments, row_segment,
                                  state, /*rewrite_history=*/one_token_each,
                                  /*skip_one_row_segments=*/decode_kernel, q, k, v, lr,
                                  scan_stream));
    TTT_CUDA(cu::TttScan(params, scanned, num_scanned, q, k, v, lr, state, offsets, ttt_out,
                         scan_stream));
    TTT_RETURN_IF_ERROR(JoinScanStream());
    // After the scan, which does not read the history, and outside the join: neither the scan
    // nor the layer's output waits for it.
    if (c.share_qk && !one_token_each) {
      TTT_CUDA(cu::AdvanceConvHistory(proj + columns_.q, columns_.ld, num_scanned, D, ck, scanned,
                                      state, layout_.conv_qk, scan_stream));
      if (scan_stream == scan_stream_) scan_stream_joined_ = false;
    }
  }

  // Layer output (spec §3.8): its norm and gate, then o_proj, added into h.
  const cu::ProductInput post_norm{.kind = cu::ProductInput::Kind::kLayerNormGate,
                                   .source = ttt_out,
                                   .weight = w.post_norm_w,
                                   .bias = w.post_norm_b,
                                   .eps = kLayerNormEps,
                                   .gate = c.use_gate ? proj + columns_.g : nullptr,
                                   .gate_ld = columns_.ld};
  if (TensorCoreProducts(rows)) {
    // o_proj, then the SwiGLU feed-forward's norm and gate_up, in two kernels.
    TTT_CUDA(cu::MakeProductInput(post_norm, rows, D, s.y_gemm.get(), gemm_type(), stream_));
    const cu::FeedForwardEntry entry{.D = D,
                                     .I = I,
                                     .eps = rms_eps,
                                     .o_proj = w.o_proj,
                                     .gate_up = w.gate_up,
                                     .ffn_norm_weight = w.ffn_norm,
                                     .post_norm_rows = s.y_gemm.get(),
                                     .h = h,
                                     .normed = s.x.get(),
                                     .row_squares = s.row_squares.get<float>(),
                                     .row_stride = static_cast<int>(s.room.rows),
                                     .activation = s.ffn_act.get()};
    TTT_CUDA(entry.Run(static_cast<int>(rows), stream_));
  } else {
    TTT_RETURN_IF_ERROR(Product(post_norm, rows, D, w.o_proj, D, cu::ProductOutput::kAccumulate, h,
                                s.y_gemm.get()));
    // SwiGLU feed-forward.
    const cu::ProductInput ffn_norm{.kind = cu::ProductInput::Kind::kRmsNorm,
                                    .source = h,
                                    .weight = w.ffn_norm,
                                    .eps = rms_eps};
    TTT_RETURN_IF_ERROR(Product(ffn_norm, rows, D, w.gate_up, 2 * I, cu::ProductOutput::kSwiGlu,
                                s.ffn_act.get(), s.x.get()));
  }
  TTT_RETURN_IF_ERROR(Gemm(s.ffn_act.get(), rows, I, w.down_proj, D, h, /*accumulate=*/true));
  return absl::OkStatus();
}

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Engine>> CreateCudaEngine(std::shared_ptr<const Model> model,
                                                         const CudaEngineOptions& options) {
  auto engine = std::make_unique<CudaEngine>(std::move(model), options);
  TTT_RETURN_IF_ERROR(engine->Initialize());
  return engine;
}

}  // namespace ttt
