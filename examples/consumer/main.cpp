// One forward of a small MoE layer on one GPU (one rank holding all 8 experts).
#include <cuda_runtime.h>
#include <pounce/pounce.h>

#include <cmath>
#include <cstdio>
#include <vector>

void check(cudaError_t status) {
  if (status != cudaSuccess) throw pounce::Error(cudaGetErrorString(status));
}

template <typename T>
T* to_device(const std::vector<T>& host) {  // freed at exit: a real program owns its tensors
  T* device = nullptr;
  check(cudaMalloc(&device, host.size() * sizeof(T)));
  check(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

std::vector<__nv_bfloat16> values(size_t n, float scale) {
  std::vector<__nv_bfloat16> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = __float2bfloat16(scale * std::sin(0.37f * float(i)));
  return v;
}

int main() {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("no CUDA GPU here: the example links and loads pounce; run it on a Hopper GPU\n");
    return 0;
  }
  const int E = 8, k = 2;
  const int64_t T = 1000, H = 1024, I = 512;
  try {
    const pounce::EpConfig config{
        .ranks = 1, .experts = E, .topk = k, .hidden = H, .intermediate = I, .max_tokens_per_rank = T};
    pounce::FusedMoe layer(config);  // on the current GPU; throws pounce::Error naming what it cannot do

    // This rank's experts: w13 [E, 2I, H] (gate and up rows interleaved in groups of 8), w2 [E, H, I].
    layer.set_weights({to_device(values(E * 2 * I * H, 0.03f)), to_device(values(E * H * I, 0.03f))});

    std::vector<int32_t> ids(T * k);
    std::vector<float> weights(T * k, 0.5f);
    for (int64_t t = 0; t < T; ++t) ids[t * k] = t % E, ids[t * k + 1] = (t + 3) % E;  // distinct per token
    __nv_bfloat16* y = to_device(std::vector<__nv_bfloat16>(T * H));
    layer.forward({to_device(values(T * H, 1.0f)), to_device(ids), to_device(weights), T, y}, nullptr);

    const cudaError_t synced = cudaDeviceSynchronize();
    layer.check_device_errors();  // bad routing, or a wait that gave up, as a named pounce::Error
    check(synced);
    std::vector<__nv_bfloat16> out(T * H);
    check(cudaMemcpy(out.data(), y, out.size() * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
    std::printf("y[0][0..3] = %f %f %f\n", __bfloat162float(out[0]), __bfloat162float(out[1]),
                __bfloat162float(out[2]));
  } catch (const pounce::Error& e) {
    std::fprintf(stderr, "pounce: %s\n", e.what());
    return 1;
  }
  return 0;
}
