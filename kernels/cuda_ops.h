// The TTT model's operations on CUDA devices: launchers for the kernels under kernels/cuda/.
//
// Conventions (as kernels/cpu_ops.h): activations are row-major float32 [rows, width]; a batch
// stacks the tokens of several sequences ("segments") as consecutive rows; every launcher is
// asynchronous on `stream` and returns the launch error (cudaSuccess when queued). The inputs of
// the dense layers' products are bf16 or float32, as the weights; products of more rows than
// SkinnyGemm takes run on cuBLAS (server/engine/cuda_gemm.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ttt::kernels::cuda {

// One sequence's tokens within a batch.
struct Segment {
  int32_t row;    // First row in the stacked activations.
  int32_t count;  // Tokens.
  int32_t slot;   // State slot.
  int32_t pad = 0;
  int64_t start;  // Absolute position of the first token in its sequence.
};

// Where a sequence's state lives: slot s, layer l starts at states + s·slot_floats + layer_offset.
struct StateAddress {
  float* states;
  size_t slot_floats;
  size_t layer_offset;
};

// Offsets in floats of a layer's TTT state parts (see server/engine/state_layout.h).
// w1_split: TTT-Linear's W1 is held in halves (state_layout.h, SplitW1), which the decode step
// reads the upper of: half of θ0's bytes, as bf16. Every kernel that reads or writes W1 takes it
// as the offsets say.
struct TttStateOffsets {
  size_t W1, b1, W2, b2, k, g1, lr, x2, g2;
  bool w1_split = false;
};

enum class ElementType { kFloat32, kBFloat16 };

// table [V, D] (float or bf16, as `type`) → h [rows, D]; tokens are already validated. A token
// -(r + 1) stands for chosen[r], a token the previous step chose on the device.
cudaError_t EmbeddingGather(const int32_t* tokens, int rows, const int32_t* chosen,
                            const void* table, ElementType type, int D, float* h,
                            cudaStream_t stream);

// Row-wise RMSNorm of x [rows, D] into y (float or bf16, as `out_type`).
cudaError_t RmsNorm(const float* x, int rows, int D, const float* weight, float eps, void* y,
                    ElementType out_type, cudaStream_t stream);

// The pre-conv sub-block's conv and the RMSNorm after it, over segments of any length:
// h += CausalConv(x), x being RMSNorm(h) with the pre-conv's weight, the conv depthwise over each
// segment's rows continuing its sequence's history (history_offset within the layer's state,
// [ck−1, D]; AdvanceConvHistory advances it after); then y = RMSNorm(h) with `next_norm_weight`
// and `eps`, as RmsNorm writes it. `row_segment` maps row → segment index. With
// `skip_one_row_segments` the rows of one-row segments are left to PreConvDecode.
cudaError_t PreConvRows(const float* x, int rows, int D, const float* conv_weight,
                        const float* conv_bias, int ck, const Segment* segments,
                        const int32_t* row_segment, StateAddress state, size_t history_offset,
                        float* h, float eps, const float* next_norm_weight, void* y,
                        ElementType y_type, bool skip_one_row_segments, cudaStream_t stream);

// Appends each segment's rows of x (row stride ld) to its history, after every conv reading that
// history has run.
cudaError_t AdvanceConvHistory(const float* x, int64_t ld, int num_segments, int D, int ck,
                               const Segment* segments, StateAddress state, size_t history_offset,
                               cudaStream_t stream);

// Decode form of the pre-conv sub-block and the RMSNorm after it, for segments of at most one
// row each: h += CausalConv(RMSNorm(h)), the history rewritten in place, then y = RMSNorm(h)
// with `next_norm_weight` and the same eps, as RmsNorm writes it. Row b is segment b (a decode
// step; a segment with no row is padding, whose row is computed and whose state is not
// changed), or, with `segment_rows`, each segment's own row (the decode rows of a step that
// mixes prompts in; a segment with no row is skipped).
cudaError_t PreConvDecode(float* h, int num_segments, bool segment_rows, int D,
                          const float* norm_weight, float eps, const float* conv_weight,
                          const float* conv_bias, int ck, const Segment* segments,
                          StateAddress state, size_t history_offset,
                          const float* next_norm_weight, void* y, ElementType y_type,
                          cudaStream_t stream);
// Where the TTT layer's inputs sit in a row of the fused input projection
// [rows, ld] = x · [W_q; W_k; W_v; w_lr; W_g]ᵀ. The gate's block, if any, comes last, after
// every column the TTT step reads (cu::SequenceStep multiplies it apart).
struct ProjectionColumns {
  int64_t ld;
  int q, k, v, g, lr;  // k < 0: share_qk (q and k are two convs of block q); g < 0: no gate.
};

struct QkConv {  // share_qk: the two causal convs over the shared stream and its history.
  const float *q_weight, *q_bias, *k_weight, *k_bias;
  int ck;
  size_t history_offset;
};

// What the TTT layer's inputs are made from: the fused projection and the parameters of the
// convs, RoPE and step sizes.
struct TttProjectionInputs {
  const float* proj;  // [rows, columns.ld]
  ProjectionColumns columns;
  const float2* rope;  // [K, f/2] of (cos, sin), by position in the window.
  bool share_qk;       // q and k are `conv`'s two convs of the q block.
  QkConv conv;
  const float* lr_bias;  // [nh]
  float base_lr;
};

// Writes the TTT scan's inputs (spec §3.2–3.4): q and k (through the convs when share_qk, then
// RoPE at (start + i) mod K), v, and lr [rows, nh] = base_lr · sigmoid(x·w_lr + bias) / f.
// rewrite_history (only for batches of at most one row per segment): the q/k conv history is
// advanced in place; otherwise the caller advances it afterwards. skip_one_row_segments: the
// rows of one-row segments are left out (a step whose single tokens take TttDecode).
cudaError_t PrepareTttInputs(const TttProjectionInputs& inputs, int rows, int nh, int f, int K,
                             const Segment* segments, const int32_t* row_segment,
                             StateAddress state, bool rewrite_history, bool skip_one_row_segments,
                             float* q, float* k, float* v, float* lr, cudaStream_t stream);

struct TttScanParams {
  int nh, f, f1, K;
  bool mlp;
  const float* tau;        // [K]
  const float* ln_weight;  // [nh, f]
  const float* ln_bias;    // [nh, f]
  float ln_eps;
};

// The TTT inner loop (spec §3.6, §4) for every (segment, head): gradients at θ0, dual-form
// outputs, θ0 committed after each window's last token. q, k, v, out: [rows, nh·f]; lr [rows, nh].
cudaError_t TttScan(const TttScanParams& params, const Segment* segments, int num_segments,
                    const float* q, const float* k, const float* v, const float* lr,
                    StateAddress state, TttStateOffsets offsets, float* out, cudaStream_t stream);

// The decode form of PrepareTttInputs and TttScan in one kernel, for batches of one row per
// segment: the q/k conv histories are rewritten in place. Covers TTT-Linear with f of 16, 32 or
// 64, windows (K) of up to 16 tokens and a state laid out for 16-byte copies, which
// TttDecodeFits tells; otherwise it returns cudaErrorNotSupported.
//
// A warp takes an item (a segment's head) at a time, in the order of `segments` (each names its
// row): the items of segments[s] are at positions s·nh … s·nh + nh − 1, and position p runs on
// warp p mod TttDecodeWarps(…); segments of no token are skipped. server/engine/decode_order.h
// plans that order. `beside_scan`: a TttScan of the same step runs beside it (another stream),
// so the kernel leaves each SM room for a scan block.
bool TttDecodeFits(const TttScanParams& params, const TttProjectionInputs& inputs,
                   StateAddress state, TttStateOffsets offsets);
cudaError_t TttDecode(const TttScanParams& params, const TttProjectionInputs& inputs,
                      const Segment* segments, int num_segments, StateAddress state,
                      TttStateOffsets offsets, float* out, bool beside_scan, cudaStream_t stream);
// The warps TttDecode runs a step of `num_segments` segments on (as many as fit on the current
// device, fewer beside a scan, at most one an item), or 0 if the device cannot say.
int TttDecodeWarps(const TttScanParams& params, const TttProjectionInputs& inputs,
                   TttStateOffsets offsets, int num_segments, bool beside_scan);

// The TTT layer's output before o_proj (spec §3.8): y = LayerNorm(x) over each row [rows, D],
// times gelu(gate) when gate != nullptr (row stride gate_ld), written as `out_type`. The gate
// (the input projection's) must come from a kernel at least two launches back on the stream:
// the kernel reads it while the previous one, which writes x, is still running.
cudaError_t PostNormGate(const float* x, int rows, int D, const float* weight, const float* bias,
                         float eps, const float* gate, int64_t gate_ld, void* y,
                         ElementType out_type, cudaStream_t stream);

// out [rows, I] = silu(gate) ⊙ up from the fused projection gate_up [rows, 2I] (`in_type`),
// whose columns interleave gate and up: (g0, u0, g1, u1, …).
cudaError_t SwiGlu(const void* gate_up, ElementType in_type, int rows, int I, void* out,
                   ElementType out_type, cudaStream_t stream);

// out[i, :] = x[rows[i], :].
cudaError_t GatherRows(const float* x, const int32_t* rows, int n, int D, float* out,
                       cudaStream_t stream);

// One row's sampling parameters (see server/engine/sampler.h; penalties are not applied here).
struct SamplingRow {
  float temperature;  // 0: greedy.
  int32_t top_k;      // 0: no limit.
  float top_p;
  float min_p;
  uint64_t seed;
  uint64_t step;  // Draw counter: the sequence's length when the token is chosen.
};

// The widest row of logits SampleTokens takes: its bins' masses are exact sums in 32-bit words up
// to there (kernels/cuda/sampling.cu).
constexpr int kMaxSamplerVocabulary = (1 << 19) - 1;

// ids[r], logprobs[r]: the token chosen from logits row r [rows, V] and its raw log-softmax.
// V > kMaxSamplerVocabulary: cudaErrorInvalidValue.
cudaError_t SampleTokens(const float* logits, int rows, int V, const SamplingRow* params,
                         int32_t* ids, float* logprobs, cudaStream_t stream);

// How a dense product's input rows [rows, in] are made: given as they are, or the RMSNorm of
// float32 rows (as RmsNorm writes it), or their LayerNorm times gelu(gate) (as PostNormGate).
struct ProductInput {
  enum class Kind { kRows, kRmsNorm, kLayerNormGate };
  Kind kind = Kind::kRows;
  const void* rows = nullptr;      // kRows: [rows, in], of the product's element type.
  const float* source = nullptr;   // The norms: float32 [rows, in].
  const float* weight = nullptr;   // The norm's gain [in],
  const float* bias = nullptr;     // and LayerNorm's bias [in].
  float eps = 0;
  const float* gate = nullptr;     // kLayerNormGate: [rows, gate_ld], or nullptr for no gate.
  int64_t gate_ld = 0;
};

// Writes a norm's input rows into x [rows, in] (of `type`), by RmsNorm or PostNormGate.
cudaError_t MakeProductInput(const ProductInput& input, int rows, int in, void* x,
                             ElementType type, cudaStream_t stream);

// What a product writes: y [rows, out] = p or y += p (float32), for p = x · wᵀ; or, with w's rows
// interleaving the feed-forward's gate and up rows (g0, u0, g1, u1, …), the SwiGLU
// silu(p[2j]) · p[2j + 1] into y [rows, out / 2] of the product's element type.
enum class ProductOutput { kStore, kAccumulate, kSwiGlu };

// The dense products of a few rows (1, 2 or 4 ≤ kMaxSkinnyGemmRows: decode at small batch, where
// a product is bound by reading w): p = x · wᵀ for w row-major [out, in] of `type` (bf16 or
// float32), summed in float32. For one row, the input's norm is made inside the product (and
// the SwiGLU output takes an RMSNorm's input). SkinnyGemmFits tells whether it applies (in whole
// 16-byte vectors, operands 16-byte aligned, a norm's row within 48 KB); otherwise SkinnyGemm
// returns cudaErrorNotSupported.
inline constexpr int kMaxSkinnyGemmRows = 4;
bool SkinnyGemmFits(int rows, const ProductInput& input, int in, ElementType type,
                    const void* w);
cudaError_t SkinnyGemm(int rows, const ProductInput& input, const void* w, int in, int out,
                       ElementType type, ProductOutput output, void* y, cudaStream_t stream);

// A decode step's dense products on Hopper's tensor cores (kernels/cuda/tensor_core_products.cu),
// for bf16 weights, on a GPU that runs sm_90a code, which TensorCoreProductsAvailable tells (it
// also readies the kernels: call it once first). Their tiles are sized for decode steps of up to
// 256 rows, each product leaving some SMs to the kernel after it, and each kernel fetches its
// first slices of weights before the kernel it follows has ended.
//
// y [rows, out] (rows ld floats apart) = x · wᵀ for x bf16 [rows, in] and w bf16 [out, in], in
// float32 (the TTT layer's fused input projection). Takes in and out multiples of 8, ld ≥ out and
// even.
cudaError_t TensorCoreProduct(const void* x, int rows, int in, const void* w, int out, float* y,
                              int64_t ld, cudaStream_t stream);

// The feed-forward's entry, in two kernels where the general path takes four (o_proj, RmsNorm,
// gate_up, SwiGlu). From the layer's output rows (bf16 [rows, D], as PostNormGate writes them):
//   o_proj:  h += post_norm_rows · o_projᵀ; normed = h ⊙ ffn_norm_weight in bf16; row_squares
//            [SquareTiles(D), row_stride] the sums of squares of each row of h by tiles of columns;
//   gate_up: activation [rows, I] = SwiGLU((normed · gate_upᵀ) / rms), rms from row_squares and
//            eps, gate_up's rows interleaving gate and up as ProductOutput::kSwiGlu reads them.
// The RMSNorm's 1/rms is a per-row scale, so it is applied to gate_up's sums rather than its
// input. Takes D and I multiples of 8.
struct FeedForwardEntry {
  int D, I;
  float eps;
  const void* o_proj;   // [D, D]
  const void* gate_up;  // [2I, D]
  const float* ffn_norm_weight;
  const void* post_norm_rows;
  float* h;
  void* normed;  // bf16 [rows, D]
  float* row_squares;
  int row_stride;  // At least the step's rows.
  void* activation;

  static int SquareTiles(int D);
  cudaError_t Run(int rows, cudaStream_t stream) const;
};
bool TensorCoreProductsAvailable(int D, int I);

// A decode step's layers for one sequence (batch 1) in one persistent kernel (see
// sequence_step.cu): from the embedded row in h to the last layer's output row in h, with the
// state advanced as ForwardLayer's kernels advance it. A layer's parts, as the engine keeps them:
struct SequenceStepLayer {
  const void *in_proj, *o_proj, *gate_up, *down;  // Product weights [out, in], of the step's type.
  const float *conv_norm, *conv_w, *conv_b;       // The pre-conv; conv_norm nullptr: none.
  const float *seq_norm, *post_norm_w, *post_norm_b, *ffn_norm;
  TttProjectionInputs ttt_inputs;  // Its proj is ignored: the step's own projection row is used.
  TttScanParams ttt;
  size_t state_offset;  // The layer's part of a sequence's state.
};

inline constexpr int kSequenceStepCounters = 3;  // The grid's meeting counters a step uses.

struct SequenceStepArgs {
  const SequenceStepLayer* layers;  // [num_layers], in device memory.
  int num_layers, D, I, f;        // f: the TTT heads' width, every layer's.
  float rms_eps, ln_eps;          // The RMSNorms' and the post-norm's.
  size_t conv_history_offset;     // The pre-conv's history within a layer's state.
  TttStateOffsets offsets;
  const Segment* segment;         // The sequence: one token at row 0 (count 0: nothing to do).
  float* states;                  // The state pool, slot_floats a slot.
  size_t slot_floats;
  float* h;                       // [D] the residual stream, in and out.
  float *proj, *ttt_out;          // Scratch: [columns.ld] and [D] float32,
  void* act;                      // and [I] of the step's type.
  unsigned* counters;             // kSequenceStepCounters, zero before the first step; left zero.
};

// Whether SequenceStep covers this model (`layer`: any layer, on the host): TTT-Linear as
// TttDecode covers it, product rows whole 16-byte vectors that fit its slots, fewer heads than
// the device has SMs (a block runs one), and a device that launches cooperatively. Also readies
// the kernel on the current device: call it before SequenceStep, and outside graph capture.
bool SetUpSequenceStep(const SequenceStepArgs& args, const SequenceStepLayer& layer,
                       ElementType type);
cudaError_t SequenceStep(const SequenceStepArgs& args, const SequenceStepLayer& layer,
                         ElementType type, cudaStream_t stream);

// float32 → bf16, elementwise (weights at load time).
cudaError_t ConvertToBFloat16(const float* x, int64_t n, __nv_bfloat16* y, cudaStream_t stream);

// Up to kMax slots of the state pool, passed by value: a launch needs no copy of them first.
struct SlotList {
  static constexpr int kMax = 64;
  int count = 0;
  int32_t slots[kMax];
};

// source [slot_floats] → every listed slot of pool (slot s at s · slot_floats): one launch fills
// the fresh states of all the sequences a step takes on.
cudaError_t CopyToSlots(const float* source, size_t slot_floats, const SlotList& slots, float* pool,
                        cudaStream_t stream);

}  // namespace ttt::kernels::cuda
