// Return-code checks for CUDA, cuBLAS and kernel launches. Every runtime call goes through one of these;
// a failure throws pounce::Error naming the call, the file:line and the library's own error string.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "common/require.h"

#define CUDA_CHECK(expr)                                                                                       \
  do {                                                                                                         \
    cudaError_t pounce_status_ = (expr);                                                                       \
    if (pounce_status_ != cudaSuccess)                                                                         \
      POUNCE_FAIL(#expr, " failed at ", __FILE__, ":", __LINE__, ": ", cudaGetErrorName(pounce_status_), " (", \
                  cudaGetErrorString(pounce_status_), ")");                                                    \
  } while (0)

// After every kernel launch: catches bad launch configurations (too much shared memory, bad grid).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#define CUBLAS_CHECK(expr)                                                                                        \
  do {                                                                                                            \
    cublasStatus_t pounce_status_ = (expr);                                                                       \
    if (pounce_status_ != CUBLAS_STATUS_SUCCESS)                                                                  \
      POUNCE_FAIL(#expr, " failed at ", __FILE__, ":", __LINE__, ": ", cublasGetStatusName(pounce_status_), " (", \
                  cublasGetStatusString(pounce_status_), ")");                                                    \
  } while (0)
