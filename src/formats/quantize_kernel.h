// Device quantizers: bf16 [rows, cols] -> E4M3 with power-of-two block scales. Bit-exact with the host
// references quantize_1x128 and quantize_mxfp8 (formats/blockwise.h): same scale rules, NaN elements
// become 0x7F, +-Inf saturate to +-448, amax ignores NaN and Inf.
//
// All pointers are device pointers to row-major arrays. x_bf16 must be 16-byte aligned and out 8-byte
// aligned (cudaMalloc'd buffers and row offsets that are multiples of 8 elements qualify). Both calls
// are asynchronous on `stream`; bad arguments throw pounce::Error before anything is launched. An empty
// matrix (rows == 0 or cols == 0) launches nothing, and its pointers may then be null.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pounce::formats {

// Where the 1 x 128 quantizers put the scale of block b (of 128 columns) of row r.
struct ScaleLayout {
  // 0: row-major [rows, cols / 128], at r * (cols / 128) + b. Otherwise K block-major
  // [cols / 128, block_major_rows], at b * block_major_rows + r (at least rows; slots of rows past `rows`
  // are left as they were): one block's scales of all rows lie together, as the FP8 grouped GEMM reads
  // its A operand's (gemm::Fp8Operands).
  int64_t block_major_rows = 0;
};

// out: [rows, cols] E4M3; scales ("ceil" rule, fp32 powers of two) laid out as `layout` says. cols % 128 == 0.
void quantize_1x128_device(const uint16_t* x_bf16, int64_t rows, int64_t cols, uint8_t* out, float* scales,
                           cudaStream_t stream, ScaleLayout layout = {});

// The same for a gather, as dispatch moves tokens into expert order: output row r quantizes row
// source_row[r] of x (device [rows]); a negative entry gives a row of zeros with scale 1 (padding rows).
void quantize_1x128_gather_device(const uint16_t* x_bf16, const int32_t* source_row, int64_t rows, int64_t cols,
                                  uint8_t* out, float* scales, cudaStream_t stream, ScaleLayout layout = {});

// The weight gradients' operands, quantized along the tokens (the k-grouped GEMM reads them K-major, K
// being the rows): out [cols, rows] E4M3 is x transposed, each of its rows quantized 1 x 128 (so 128
// consecutive rows of one column of x share a scale); scales [rows / 128, cols], K block-major as the
// k-grouped GEMM reads them (one 128-row block's scales lie together). Bit for bit quantize_1x128 of x's
// transpose, its scales transposed. rows and cols multiples of 128; x and out 16-byte aligned. With
// rows_in_use (device, one value, a multiple of 128): rows from there on are neither read nor quantized
// (their part of out and scales is left as it was).
void quantize_1x128_transposed_device(const uint16_t* x_bf16, int64_t rows, int64_t cols, uint8_t* out, float* scales,
                                      cudaStream_t stream, const int32_t* rows_in_use = nullptr);
// out: [rows, cols] E4M3; scales: [rows / 128, cols / 128] fp32 powers of two, one per 128 x 128 block
// (weights; same rule as quantize_128x128). rows and cols multiples of 128.
void quantize_128x128_device(const uint16_t* x_bf16, int64_t rows, int64_t cols, uint8_t* out, float* scales,
                             cudaStream_t stream);

// transpose_128x128 (formats/blockwise.h) on the device: `matrices` stacked [rows, cols] E4M3 matrices
// with their [rows / 128, cols / 128] block scales -> each transposed, [cols, rows], scales
// [cols / 128, rows / 128]. rows and cols multiples of 128; q and out 16-byte aligned.
void transpose_128x128_device(const uint8_t* q, const float* scales, int64_t matrices, int64_t rows, int64_t cols,
                              uint8_t* out, float* out_scales, cudaStream_t stream);
// The inverse of the two blockwise quantizers: bf16 out [rows, cols] = e4m3 q * its block's scale, rounded
// as the host's float product converted to bf16 (exact unless the product is subnormal). block_rows 1: 1 x 128
// blocks, scales laid out as `layout` says; 128: scales [rows / 128, cols / 128] (128 x 128 blocks).
void dequantize_blockwise_device(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, int block_rows,
                                 uint16_t* out_bf16, cudaStream_t stream, ScaleLayout layout = {});

// out: [rows, cols] E4M3; scales: [rows, cols / 32] E8M0 (OCP MX rule). cols % 32 == 0.
void quantize_mxfp8_device(const uint16_t* x_bf16, int64_t rows, int64_t cols, uint8_t* out, uint8_t* scales,
                           cudaStream_t stream);
// Its inverse, MXFP8 -> bf16: out = e4m3 q * 2^(scale - 127), rounded as the host's float product
// (formats::dequantize of an Mxfp8) converted to bf16. Exact for every E4M3 value under scale codes 3 to
// 246 (2^-124 to 2^119); below, the smallest values fall under bf16's subnormal step (2^-133) and round,
// above, the largest overflow to infinity. A 0xFF scale gives NaN, as the MX spec says.
// cols % 32 == 0; q 8-byte and out 16-byte aligned.
void dequantize_mxfp8_device(const uint8_t* q, const uint8_t* scales, int64_t rows, int64_t cols, uint16_t* out_bf16,
                             cudaStream_t stream);

}  // namespace pounce::formats
