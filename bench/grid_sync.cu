// What it costs the blocks of a persistent kernel to wait for each other, as the batch-1 step
// kernel (SequenceStep) does five times a layer. One block an SM, 256 threads, as that kernel runs;
// the 224 threads of warps 1–7 meet `rounds` times:
//   barrier    GridBarrier (kernels/cuda/grid_sync.cuh), the kernel's barrier: the block's
//              threads sync, one adds to a counter with release order and polls it with acquire
//              loads, and the threads sync again.
//   tagged     every block publishes a value tagged with the round (one 8-byte store, below),
//              and each block's threads wait for all blocks' words of that round, then sync: what
//              stages would do if each value that crosses blocks carried its round.
// Each runs with warp 0 idle, and with warp 0 streaming 32 KB chunks of a large buffer into shared
// memory the whole time (cp.async.bulk, 1 to 4 chunks in flight), as the step kernel's producer
// streams the weights: the waits' loads then queue behind the stream. The barrier also runs beside
// smaller chunks, one or two in flight: fewer bytes in flight queue less ahead of its loads, and
// stream less.
// Prints one JSON line per (mode, chunk size, chunks in flight): microseconds a round and the
// stream's GB/s, medians of 11 launches.
//   ttt-grid-sync [rounds]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda/ptx>
#include <vector>

#include "bench/cuda_check.h"
#include "bench/event_timer.h"
#include "kernels/cuda/grid_sync.cuh"
#include "server/util/percentile.h"

namespace {

using ttt::Median;
namespace cu = ttt::kernels::cuda;

constexpr int kThreads = 256, kWarp = 32, kMeetingThreads = kThreads - kWarp;
// The ring: up to kSlots chunks in flight, of up to kSlotBytes each.
constexpr int kSlots = 4, kSlotBytes = 32 * 1024;
constexpr size_t kStreamBytesPerBlock = 16 << 20;  // Read over and over while the rounds run.

enum class Mode { kBarrier, kTagged };

// A float and the round that wrote it, stored and loaded as one 8-byte word, so a reader that
// sees the round sees the value: the writer needs no fence and the reader no barrier. A buffer of
// them is written once a round; round r + 2 may reuse round r's words only once every reader has
// read them.
__device__ __forceinline__ void PublishTagged(uint64_t* word, float value, unsigned round) {
  const uint64_t tagged = static_cast<uint64_t>(round) << 32 | __float_as_uint(value);
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(word), "l"(tagged) : "memory");
}

// Waits for `word` to hold round `round`'s value, and returns it.
__device__ __forceinline__ float AwaitTagged(const uint64_t* word, unsigned round) {
  uint64_t tagged;
  do {
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(tagged) : "l"(word) : "memory");
  } while (static_cast<unsigned>(tagged >> 32) != round);
  return __uint_as_float(static_cast<unsigned>(tagged));
}

__device__ __forceinline__ void MeetingSync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kMeetingThreads) : "memory");
}

// Warp 0's lane 0 streams its block's part of `stream` in chunks of `chunk_bytes` through `depth`
// slots of the ring until `*done`, then waits for the copies in flight (none may land after the
// block has gone). Returns the chunks it streamed.
__device__ int Stream(const char* stream, int depth, int chunk_bytes, char* ring, uint64_t* full,
                      volatile int* done) {
  const char* part = stream + blockIdx.x * kStreamBytesPerBlock;
  const int chunks_in_part = kStreamBytesPerBlock / chunk_bytes;
  auto wait_for = [&](int chunk) { cu::WaitForPhase(&full[chunk % depth], (chunk / depth) & 1); };
  int chunk = 0;
  for (; !*done; ++chunk) {
    if (chunk >= depth) wait_for(chunk - depth);
    uint64_t* slot_full = &full[chunk % depth];
    ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                           ::cuda::ptx::space_shared, slot_full, chunk_bytes);
    const size_t offset = static_cast<size_t>(chunk % chunks_in_part) * chunk_bytes;
    ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global,
                               ring + chunk % depth * kSlotBytes, part + offset, chunk_bytes,
                               slot_full);
  }
  for (int c = max(0, chunk - depth); c < chunk; ++c) wait_for(c);
  return chunk;
}

__global__ void __launch_bounds__(kThreads, 1)
    Meet(Mode mode, int depth, int chunk_bytes, int rounds, unsigned* arrivals, uint64_t* words,
         const char* stream, unsigned long long* chunks, float* sink) {
  extern __shared__ __align__(128) char shared[];
  __shared__ uint64_t full[kSlots];
  __shared__ int done;
  if (threadIdx.x == 0) {
    done = 0;
    for (int s = 0; s < kSlots; ++s) ::cuda::ptx::mbarrier_init(&full[s], 1);
    ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
  }
  __syncthreads();
  if (threadIdx.x < kWarp) {
    if (threadIdx.x == 0 && depth > 0) {
      atomicAdd(chunks, Stream(stream, depth, chunk_bytes, shared, full, &done));
    }
    return;
  }
  const int t = threadIdx.x - kWarp;
  unsigned expected = 0;
  float sum = 0.0f;
  for (int round = 1; round <= rounds; ++round) {
    if (mode == Mode::kBarrier) {
      cu::GridBarrier(arrivals, expected, t == 0, [] { MeetingSync(); });
    } else {
      uint64_t* buffer = words + (round % 2) * gridDim.x;
      if (t == 0) PublishTagged(buffer + blockIdx.x, static_cast<float>(blockIdx.x), round);
      for (int b = t; b < gridDim.x; b += kMeetingThreads) {
        sum += AwaitTagged(buffer + b, round);
      }
      MeetingSync();
    }
  }
  if (t == 0) {
    done = 1;
    if (sum < 0.0f) *sink = sum;  // Keeps the reads; never true.
  }
}

struct Setup {
  int sms = 0, rounds = 0;
  unsigned* arrivals = nullptr;
  uint64_t* words = nullptr;
  char* stream = nullptr;
  unsigned long long* chunks = nullptr;
  float* sink = nullptr;
};

struct Run {
  float ms = 0;
  double stream_gb_per_s = 0;
};

Run Launch(Setup s, Mode mode, int depth, int chunk_bytes) {
  CHECK_CUDA(cudaMemset(s.arrivals, 0, sizeof(unsigned)));
  CHECK_CUDA(cudaMemset(s.words, 0, 2 * s.sms * sizeof(uint64_t)));
  CHECK_CUDA(cudaMemset(s.chunks, 0, sizeof(unsigned long long)));
  void* args[] = {&mode,    &depth,    &chunk_bytes, &s.rounds, &s.arrivals,
                  &s.words, &s.stream, &s.chunks,    &s.sink};
  Run run;
  run.ms = EventTimer().Ms([&] {
    CHECK_CUDA(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(Meet), s.sms, kThreads,
                                           args, kSlots * kSlotBytes));
  });
  unsigned long long chunks = 0;
  CHECK_CUDA(cudaMemcpy(&chunks, s.chunks, sizeof(chunks), cudaMemcpyDeviceToHost));
  run.stream_gb_per_s = 1e-6 * static_cast<double>(chunks) * chunk_bytes / run.ms;
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  Setup s;
  s.rounds = argc > 1 ? std::atoi(argv[1]) : 20000;
  CHECK_CUDA(cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK_CUDA(
      cudaFuncSetAttribute(Meet, cudaFuncAttributeMaxDynamicSharedMemorySize, kSlots * kSlotBytes));
  CHECK_CUDA(cudaMalloc(&s.arrivals, sizeof(unsigned)));
  CHECK_CUDA(cudaMalloc(&s.words, 2 * s.sms * sizeof(uint64_t)));
  CHECK_CUDA(cudaMalloc(&s.stream, s.sms * kStreamBytesPerBlock));
  CHECK_CUDA(cudaMalloc(&s.chunks, sizeof(unsigned long long)));
  CHECK_CUDA(cudaMalloc(&s.sink, sizeof(float)));
  CHECK_CUDA(cudaMemset(s.stream, 1, s.sms * kStreamBytesPerBlock));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  auto measure = [&](Mode mode, int depth, int chunk_bytes) {
    Launch(s, mode, depth, chunk_bytes);  // Warm-up.
    std::vector<float> ms;
    std::vector<double> gb_per_s;
    for (int i = 0; i < 11; ++i) {
      const Run run = Launch(s, mode, depth, chunk_bytes);
      ms.push_back(run.ms);
      gb_per_s.push_back(run.stream_gb_per_s);
    }
    std::printf(
        "{\"gpu\":\"%s\",\"blocks\":%d,\"mode\":\"%s\",\"chunk_bytes\":%d,"
        "\"chunks_in_flight\":%d,\"rounds\":%d,\"us_per_round\":%.4f,\"stream_gb_per_s\":%.0f}\n",
        prop.name, s.sms, mode == Mode::kBarrier ? "barrier" : "tagged", chunk_bytes, depth,
        s.rounds, 1e3 * Median(ms) / s.rounds, Median(gb_per_s));
  };
  for (const Mode mode : {Mode::kBarrier, Mode::kTagged}) {
    for (int depth = 0; depth <= kSlots; ++depth) measure(mode, depth, kSlotBytes);
  }
  for (const int chunk_bytes : {8 << 10, 16 << 10, 24 << 10}) {
    for (int depth = 1; depth <= 2; ++depth) measure(Mode::kBarrier, depth, chunk_bytes);
  }
  return 0;
}
