// Every kernel configuration cuBLASLt offers for a decode step's dense products, timed: is there
// one faster than the heuristic's first, which the engine runs (server/engine/cuda_gemm.cc)?
// bench/README.md v9 timed only the heuristic's first 16 candidates. Here every algorithm id for
// bf16 inputs with float32 sums and output is configured by hand over the options it reports
// (tile, stages, split-K with each reduction scheme, cluster shape, CTA swizzling), each
// configuration cuBLASLt accepts (cublasLtMatmulAlgoCheck) is timed, and so are the heuristic's
// candidates up to 128.
//
// Each product is y [rows, out] (+)= x [rows, in] · wᵀ as the engine plans it (o_proj and down
// add into the residual stream), timed as a step runs it: L2 flushed before each run (its weights
// were last read a whole step ago). A configuration is first timed 3 times; the fastest 12 again
// 21 times, checked against the heuristic's result, with the fastest that splits K and the fastest
// of another algorithm than the heuristic's first. Prints one JSON line per product: the
// heuristic's first, the fastest found, and the runners-up, as median µs and their configuration.
//   ttt-cublaslt-search [ROWS [PRESET/PRODUCT]]     (rows 256 by default)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/cublaslt_plan.h"
#include "bench/cuda_check.h"
#include "bench/event_timer.h"
#include "bench/product_inputs.h"
#include "server/util/percentile.h"

namespace {

using ttt::Median;
using bf16 = __nv_bfloat16;

struct Product {
  const char* preset;
  const char* name;
  int in, out;
  bool accumulate;  // y += x · wᵀ, as o_proj and down add into h.
};

// One configuration of an algorithm, as cublasLtMatmulAlgoConfigSetAttribute takes it.
struct Config {
  int id = 0;
  uint32_t tile = 0, stages = 0, split_k = 1, reduction = 0, swizzle = 0;
  uint16_t cluster = 0;
};

std::string Describe(const Config& c) {
  char text[200];
  std::snprintf(text, sizeof(text),
                "{\"algo\":%d,\"tile\":%u,\"stages\":%u,\"split_k\":%u,\"reduction\":%u,"
                "\"swizzle\":%u,\"cluster\":%u}",
                c.id, c.tile, c.stages, c.split_k, c.reduction, c.swizzle, c.cluster);
  return text;
}

template <typename T>
T ConfigOf(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute) {
  T value{};
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof(value), &written);
  return value;
}

Config ConfigOf(const cublasLtMatmulAlgo_t& algo) {
  Config c;
  c.id = ConfigOf<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID);
  c.tile = ConfigOf<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID);
  c.stages = ConfigOf<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID);
  c.split_k = ConfigOf<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  c.reduction = ConfigOf<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
  c.swizzle = ConfigOf<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING);
  c.cluster = ConfigOf<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
  return c;
}

// A capability that is a list of ids (tiles, stages); {0} (undefined: cuBLASLt's choice) if none.
std::vector<uint32_t> CapIds(const cublasLtMatmulAlgo_t& algo,
                             cublasLtMatmulAlgoCapAttributes_t attribute) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attribute, nullptr, 0, &bytes) !=
          CUBLAS_STATUS_SUCCESS ||
      bytes == 0) {
    return {0};
  }
  std::vector<uint32_t> ids(bytes / sizeof(uint32_t));
  cublasLtMatmulAlgoCapGetAttribute(&algo, attribute, ids.data(), bytes, &bytes);
  return ids.empty() ? std::vector<uint32_t>{0} : ids;
}

uint32_t CapValue(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attribute) {
  uint32_t value = 0;
  size_t written = 0;
  cublasLtMatmulAlgoCapGetAttribute(&algo, attribute, &value, sizeof(value), &written);
  return value;
}

struct Timed {
  Config config;
  cublasLtMatmulAlgo_t algo;
  double us = 0;
};

}  // namespace

int main(int argc, char** argv) {
  const int rows = argc > 1 ? std::atoi(argv[1]) : 256;
  const std::string only = argc > 2 ? argv[2] : "";
  if (rows <= 0) {
    std::fprintf(stderr, "usage: ttt-cublaslt-search [ROWS [PRESET/PRODUCT]]\n");
    return 2;
  }
  // The decode products (in_proj's width padded to 64, as the engine lays it out), and the LM
  // head over the presets' 32,000 tokens, once a step.
  const Product products[] = {
      {"125m", "in_proj", 768, 2368, false},  {"125m", "o_proj", 768, 768, true},
      {"125m", "gate_up", 768, 4096, false},  {"125m", "down", 2048, 768, true},
      {"125m", "lm_head", 768, 32000, false}, {"1b", "in_proj", 2048, 6208, false},
      {"1b", "o_proj", 2048, 2048, true},     {"1b", "gate_up", 2048, 11008, false},
      {"1b", "down", 5504, 2048, true},       {"1b", "lm_head", 2048, 32000, false},
  };
  int device = 0, l2_bytes = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  const size_t flush_bytes = 2 * static_cast<size_t>(l2_bytes);
  void* flush_buffer;
  CHECK_CUDA(cudaMalloc(&flush_buffer, flush_bytes));
  const size_t workspace_bytes = size_t{32} << 20;  // As the engine's (cuda_gemm.cc).
  void* workspace;
  CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes));
  cublasLtHandle_t handle;
  CHECK_CUBLAS(cublasLtCreate(&handle));
  EventTimer timer;
  int flushes = 0;
  // The median of `runs` runs, each after L2 is flushed; a negative value if a run fails.
  auto median_us = [&](const std::function<cublasStatus_t()>& run, int runs) {
    std::vector<double> times;
    for (int i = 0; i < runs; ++i) {
      CHECK_CUDA(cudaMemsetAsync(flush_buffer, ++flushes, flush_bytes));
      cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
      const float ms = timer.Ms([&] { status = run(); });
      if (status != CUBLAS_STATUS_SUCCESS) return -1.0;
      times.push_back(1e3 * ms);
    }
    return Median(times);
  };
  // What the timing itself costs: an empty copy, timed as the products are.
  std::printf("{\"variant\":\"empty_copy\",\"us_p50\":%.2f}\n",
              median_us(
                  [&] {
                    CHECK_CUDA(cudaMemcpyAsync(workspace, workspace, 0, cudaMemcpyDeviceToDevice));
                    return CUBLAS_STATUS_SUCCESS;
                  },
                  21));

  std::mt19937 rng(7);
  for (const Product& p : products) {
    if (!only.empty() && only != std::string(p.preset) + "/" + p.name) continue;
    const ProductInputs inputs = UploadProductInputs(rows, p.in, p.out, rng);
    const bf16 *x = inputs.x, *w = inputs.w;
    const size_t y_count = static_cast<size_t>(rows) * p.out;
    float *y, *y_first;
    CHECK_CUDA(cudaMalloc(&y, y_count * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&y_first, y_count * sizeof(float)));
    CHECK_CUDA(cudaMemset(y, 0, y_count * sizeof(float)));
    const LtPlan plan = PlanLt(handle, rows, p.in, p.out, workspace_bytes);
    // The products that add run with beta = 1 into y as it stands; the check compares y = x · wᵀ
    // (beta 0) of each configuration with the heuristic's.
    const float alpha = 1.0f, beta_step = p.accumulate ? 1.0f : 0.0f, beta_zero = 0.0f;
    auto run = [&](const cublasLtMatmulAlgo_t& algo, const float* beta, float* out) {
      return cublasLtMatmul(handle, plan.desc, &alpha, w, plan.w, x, plan.x, beta, out, plan.y, out,
                            plan.y, &algo, workspace, workspace_bytes, nullptr);
    };

    // The heuristic's candidates.
    cublasLtMatmulPreference_t preference;
    CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
    const uint64_t max_workspace = workspace_bytes;
    CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference,
                                                      CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &max_workspace, sizeof(max_workspace)));
    std::vector<cublasLtMatmulHeuristicResult_t> heuristic(128);
    int found = 0;
    CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.w, plan.x, plan.y, plan.y,
                                                preference, static_cast<int>(heuristic.size()),
                                                heuristic.data(), &found));
    cublasLtMatmulPreferenceDestroy(preference);
    if (found == 0) {
      std::fprintf(stderr, "%s/%s: no heuristic candidate\n", p.preset, p.name);
      return 1;
    }
    CHECK_CUBLAS(run(heuristic[0].algo, &beta_zero, y_first));
    std::vector<Timed> candidates;
    for (int i = 0; i < found; ++i) {
      candidates.push_back({ConfigOf(heuristic[i].algo), heuristic[i].algo});
    }

    // Every algorithm, configured by hand.
    int ids[256], id_count = 0;
    CHECK_CUBLAS(cublasLtMatmulAlgoGetIds(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF,
                                          CUDA_R_16BF, CUDA_R_32F, CUDA_R_32F, 256, ids,
                                          &id_count));
    const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_AUTO, CUBLASLT_CLUSTER_SHAPE_1x1x1,
                                 CUBLASLT_CLUSTER_SHAPE_2x1x1, CUBLASLT_CLUSTER_SHAPE_1x2x1};
    const uint32_t split_counts[] = {1, 2, 3, 4, 8};
    const uint32_t reductions[] = {CUBLASLT_REDUCTION_SCHEME_INPLACE,
                                   CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                                   CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE};
    int checked = 0;
    for (int a = 0; a < id_count; ++a) {
      cublasLtMatmulAlgo_t algo;
      if (cublasLtMatmulAlgoInit(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF,
                                 CUDA_R_32F, CUDA_R_32F, ids[a], &algo) != CUBLAS_STATUS_SUCCESS) {
        continue;
      }
      const std::vector<uint32_t> tiles = CapIds(algo, CUBLASLT_ALGO_CAP_TILE_IDS);
      const std::vector<uint32_t> stages = CapIds(algo, CUBLASLT_ALGO_CAP_STAGES_IDS);
      const bool splits = CapValue(algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT) != 0;
      const uint32_t reduction_mask = CapValue(algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
      const bool swizzles = CapValue(algo, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT) != 0;
      for (const uint32_t tile : tiles) {
        for (const uint32_t stage : stages) {
          for (const uint16_t cluster : clusters) {
            for (const uint32_t split : split_counts) {
              if (split > 1 && !splits) break;
              for (const uint32_t reduction : reductions) {
                if (split == 1 && reduction != reductions[0]) break;
                if (split > 1 && (reduction_mask & reduction) == 0) continue;
                for (uint32_t swizzle = 0; swizzle <= (swizzles ? 1u : 0u); ++swizzle) {
                  Config c{ids[a], tile, stage, split, split > 1 ? reduction : 0, swizzle, cluster};
                  cublasLtMatmulAlgo_t configured = algo;
                  auto set = [&](cublasLtMatmulAlgoConfigAttributes_t attribute, const void* v,
                                 size_t bytes) {
                    return cublasLtMatmulAlgoConfigSetAttribute(&configured, attribute, v, bytes) ==
                           CUBLAS_STATUS_SUCCESS;
                  };
                  if (!set(CUBLASLT_ALGO_CONFIG_TILE_ID, &c.tile, sizeof(c.tile)) ||
                      !set(CUBLASLT_ALGO_CONFIG_STAGES_ID, &c.stages, sizeof(c.stages)) ||
                      !set(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &c.split_k, sizeof(c.split_k)) ||
                      !set(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &c.reduction,
                           sizeof(c.reduction)) ||
                      !set(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &c.swizzle, sizeof(c.swizzle)) ||
                      !set(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &c.cluster, sizeof(c.cluster))) {
                    continue;
                  }
                  cublasLtMatmulHeuristicResult_t result{};
                  if (cublasLtMatmulAlgoCheck(handle, plan.desc, plan.w, plan.x, plan.y, plan.y,
                                              &configured, &result) != CUBLAS_STATUS_SUCCESS ||
                      result.workspaceSize > workspace_bytes) {
                    continue;
                  }
                  ++checked;
                  candidates.push_back({c, configured});
                }
              }
            }
          }
        }
      }
    }

    // A first timing of every candidate, then the fastest again, checked.
    std::vector<float> host_first(y_count), host_y(y_count);
    CHECK_CUDA(
        cudaMemcpy(host_first.data(), y_first, y_count * sizeof(float), cudaMemcpyDeviceToHost));
    double largest = 0;
    for (const float v : host_first) largest = std::max(largest, std::fabs(double{v}));
    for (Timed& t : candidates) {
      t.us = median_us([&] { return run(t.algo, &beta_step, y); }, 3);
    }
    candidates.erase(std::remove_if(candidates.begin(), candidates.end(),
                                    [](const Timed& t) { return t.us < 0; }),
                     candidates.end());
    Timed first = candidates.front();  // The heuristic's first.
    std::sort(candidates.begin(), candidates.end(),
              [](const Timed& a, const Timed& b) { return a.us < b.us; });
    // The fastest with K split and the fastest of another algorithm are timed again too, so that
    // the record says what those forms reach.
    std::vector<Timed> kept(candidates.begin(),
                            candidates.begin() + std::min<size_t>(candidates.size(), 12));
    for (const auto& other :
         {std::function<bool(const Timed&)>([](const Timed& t) { return t.config.split_k > 1; }),
          std::function<bool(const Timed&)>(
              [&](const Timed& t) { return t.config.id != first.config.id; })}) {
      const auto found_other = std::find_if(candidates.begin(), candidates.end(), other);
      if (found_other != candidates.end() && std::none_of(kept.begin(), kept.end(), other)) {
        kept.push_back(*found_other);
      }
    }
    candidates = kept;
    first.us = median_us([&] { return run(first.algo, &beta_step, y); }, 21);
    std::string fastest;
    for (Timed& t : candidates) {
      t.us = median_us([&] { return run(t.algo, &beta_step, y); }, 21);
    }
    std::sort(candidates.begin(), candidates.end(),
              [](const Timed& a, const Timed& b) { return a.us < b.us; });
    for (const Timed& t : candidates) {
      CHECK_CUBLAS(run(t.algo, &beta_zero, y));
      CHECK_CUDA(cudaMemcpy(host_y.data(), y, y_count * sizeof(float), cudaMemcpyDeviceToHost));
      double diff = 0;
      for (size_t e = 0; e < y_count; ++e) {
        diff = std::max(diff, std::fabs(double{host_y[e]} - host_first[e]));
      }
      char entry[400];
      std::snprintf(entry, sizeof(entry),
                    "%s{\"us_p50\":%.2f,\"relative_diff\":%.2e,\"config\":%s}",
                    fastest.empty() ? "" : ",", t.us, diff / largest, Describe(t.config).c_str());
      fastest += entry;
    }
    const double flops = 2.0 * rows * p.in * p.out;
    std::printf(
        "{\"preset\":\"%s\",\"product\":\"%s\",\"rows\":%d,\"in\":%d,\"out\":%d,"
        "\"heuristic_candidates\":%d,\"configured_candidates\":%d,"
        "\"heuristic_first\":{\"us_p50\":%.2f,\"tflops\":%.1f,\"config\":%s},"
        "\"fastest\":[%s]}\n",
        p.preset, p.name, rows, p.in, p.out, found, checked, first.us, flops / first.us * 1e-6,
        Describe(first.config).c_str(), fastest.c_str());
    std::fflush(stdout);
    CHECK_CUDA(cudaFree(y_first));
    CHECK_CUDA(cudaFree(y));
    FreeProductInputs(inputs);
    DestroyLt(plan);
  }
  return 0;
}
