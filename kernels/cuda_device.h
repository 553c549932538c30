// CUDA device discovery and a minimal end-to-end check of the CUDA toolchain and driver.
#pragma once

#include <string>

namespace ttt::kernels::cuda {

// Number of usable CUDA devices; 0 when there is no driver or no GPU.
int DeviceCount();

// y[i] = a · x[i] + y[i] on device 0 over n host floats, copied there and back. Returns "" on
// success, else the CUDA error.
std::string Saxpy(float a, const float* x, float* y, int n);

// Device-to-device copy bandwidth in bytes per second (bytes read plus bytes written), the median
// of several copies of `bytes`; 0 with *error set on failure.
double MeasureCopyBandwidth(size_t bytes, std::string* error);

}  // namespace ttt::kernels::cuda
