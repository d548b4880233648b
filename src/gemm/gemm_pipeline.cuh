// The grouped GEMM engine's CTA, shared by the stand-alone grouped GEMM kernel and the fused MoE
// kernel's compute CTAs. Sections in fixed order: configuration and shared-memory layout, the tile
// source contract, producer role, consumer role (mainloop, epilogue), the CTA entry.
//
// One CTA per SM, 384 threads:
//   warpgroup 0: producer. The tile fetcher takes tiles from a TileSource (which also waits, bounded,
//                for the tile's inputs to be ready) and publishes each to the others; the loader
//                streams each tile's A/B K-slices with TMA into a kStages-deep mbarrier ring (two
//                threads).
//   warpgroups 1-2: consumers. Each owns 64 of the tile's 128 rows: wgmma from shared memory, fp32
//                accumulators in registers, then the epilogue (SwiGLU, row scale) writes bf16 into a
//                swizzled staging box that a TMA store copies out while the next tile's mainloop runs.
// Two stage formats: bf16 tiles of 128 x 256 with 64-wide K slices (m64n256k16), and E4M3 tiles of
// 128 x 128 with 128-wide K slices (m64n128k32), each slice one block of the operands' scales, applied
// in fp32 between slices (a second accumulator set: 64 + 64 registers, where 128 x 256 would need 256).
// With E4M3, warp 1 of warpgroup 0 copies each slice's scales into the stage beside its operands.
// A tile belongs to one of (at most) two GEMMs, each with its own operands; the fused kernel interleaves
// GEMM1 and GEMM2 tiles in one queue.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <type_traits>

#include "common/bounded_wait.cuh"
#include "common/timeline.cuh"
#include "gemm/grouped_gemm.h"
#include "ptx/ptx.cuh"

namespace pounce::gemm::pipeline {

// ---- configuration and shared memory ---------------------------------------------------------------

constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
constexpr int kRowsPerConsumer = kBlockM / kConsumerWarpgroups;  // 64: one wgmma M
static_assert(kStoreBoxRows == kRowsPerConsumer, "a store box is one consumer's rows high");
constexpr int kTileSlots = 2;  // a tile fetcher of its own may publish two tiles past the one the consumers run
constexpr int kTileFetcherThread = 64;  // of the producer warpgroup: warp 0 loads, warp 1 loads scales (E4M3)
constexpr int kDoneLagSlices = 4;       // a tile's completion counter is released this many K slices into the next
// setmaxnreg, producer warpgroup and consumers: 128 x 56 + 256 x 224 = 64512 of the SM's 65536 registers
// (BF16 kinds), or 128 x 40 + 256 x 232 = 64512 (E4M3 kinds). The forward E4M3 consumers hold 192
// accumulator registers and ran ~1 % faster with the 8 more (fewer values recomputed per K slice); the
// k-grouped E4M3 kind runs with the same split. The fused E4M3 forward's producer, with a queue to decode
// and counters to wait for, spilled at 40: its tile source asks for the BF16 split (kRegisters).
struct RegisterSplit {
  uint32_t producer, consumer;
};
inline constexpr RegisterSplit kBf16Registers{56, 224}, kFp8Registers{40, 232};

// Hardware named barriers; 0 is __syncthreads. One per consumer warpgroup for its epilogue, (E4M3) one
// per consumer warpgroup for its turn to issue wgmmas, and one for both consumers at the end of an
// elementwise item.
enum NamedBarrier : uint32_t { kEpilogueBarrierBase = 1, kIssueTurnBarrierBase = 3, kConsumersBarrier = 5 };

// ---- tile kinds and stage formats --------------------------------------------------------------------
//
// What a kernel's tiles can be, fixed at compile time: each kernel carries only its own mainloop and
// epilogues (with every variant in one kernel, ptxas spilled ~2 KB of accumulators per thread).
enum class TileKind {
  kForward,        // A and B K-major; bf16 out, kStore or kSwiGLU                  (m-grouped)
  kForwardFp8,     // kForward with E4M3 A and B and their block scales (GemmOperands::a_scale, b_scale)
  kDataGrad,       // A K-major, B MN-major (weights used transposed); bf16 kStore   (m-grouped)
  kWeightGrad,     // A and B MN-major (row buffers used transposed); 3-D C, kStoreF32, kAddF32 or bf16 kStore
                   // (k-grouped; a tile may have no K slices)
  kWeightGradFp8,  // kWeightGrad with E4M3 A and B quantized along the rows and stored transposed (K-major),
                   // each row of both with its own scale per 128 of K: B's scales vary along the tile's columns
  kBackward,       // kDataGrad tiles and, from TileInfo::gemm kWeightGradTile on, kWeightGrad tiles: the fused
                   // backward with its weight gradients in one kernel
};
constexpr bool is_fp8(TileKind kind) { return kind == TileKind::kForwardFp8 || kind == TileKind::kWeightGradFp8; }

// A stage holds one K slice of a tile's A rows and B columns; a slice row is one 128-byte swizzle row.
struct Bf16Stages {
  using Element = __nv_bfloat16;
  static constexpr int kTileN = kBlockN, kSliceK = kBlockK, kStages = 4;
  static constexpr int kStoreSlots = 2;  // per consumer: fill one store box while the previous one is stored
  static constexpr bool kScales = false;
  static constexpr bool kColumnScales = false;
};
// One slice is one 128-wide block of the activation (1 x 128) and weight (128 x 128) scales, which the
// stage holds too.
struct Fp8Stages {
  using Element = uint8_t;
  static constexpr int kTileN = 128, kSliceK = 128, kStages = 5;
  static constexpr int kStoreSlots = 2;
  static constexpr bool kScales = true;
  static constexpr bool kColumnScales = false;
};
// The weight gradients in E4M3: both operands are row buffers quantized along their rows (the GEMM's K),
// so every B row (an output column) has its own scale per slice, which the stage holds beside A's.
struct Fp8ColumnScaleStages : Fp8Stages {
  static constexpr bool kColumnScales = true;
};
template <TileKind kKind>
using StagesOf =
    std::conditional_t<kKind == TileKind::kForwardFp8, Fp8Stages,
                       std::conditional_t<kKind == TileKind::kWeightGradFp8, Fp8ColumnScaleStages, Bf16Stages>>;

// Where a tile's operands start. A K-major operand's slice kb is the box at (col + kb * kSliceK, row); an
// MN-major operand's is the boxes at (col + 64 j, row + kb * kSliceK), one per 64 elements of M or N.
struct OperandOrigin {
  int32_t row, col;
};

// TileInfo::gemm of an item that is not a GEMM tile: the tile source's own elementwise work, fed through
// the stages like a GEMM tile (k_blocks of them), each filled by the tile source's own loads.
inline constexpr int32_t kElementwiseTile = 2;
// kBackward: TileInfo::gemm of its weight-gradient tiles (kWeightGradTile and the next), k-grouped.
inline constexpr int32_t kWeightGradTile = 3;
// A tile of a weight gradient (k-grouped: 3-D C), and one whose bf16 A is read MN-major (E4M3 weight
// gradients read theirs stored transposed).
__device__ __forceinline__ bool is_weight_grad_tile(TileKind kind, int32_t gemm) {
  return kind == TileKind::kWeightGrad || kind == TileKind::kWeightGradFp8 ||
         (kind == TileKind::kBackward && gemm >= kWeightGradTile);
}
__device__ __forceinline__ bool reads_a_mn_major(TileKind kind, int32_t gemm) {
  return kind != TileKind::kWeightGradFp8 && is_weight_grad_tile(kind, gemm);
}

struct TileInfo {
  int32_t gemm;  // which GemmOperands, or kElementwiseTile
  OperandOrigin a, b;
  int32_t c_row;     // first C row (of the expert's matrix when C is 3-D)
  int32_t c_expert;  // 3-D C only
  int32_t n_block;   // of the stage format's kTileN columns
  int32_t m_block;   // index of the tile's completion counter (GemmOperands::done)
  int32_t k_blocks;  // K slices; 0 gives C = 0 (kAddF32: C unchanged)
  int32_t valid;     // 0: no more tiles (queue drained, or the producer gave up): consumers exit
  int32_t keep_row;  // kSwiGLU with GemmOperands::keep: first row of the kept gate/up rows
  int32_t rows;      // rows of the tile that hold routes; a consumer whose rows all lie past them skips its
                     // MMAs and its stores (padding rows: no work done for them)
};

// Where B column c's scale sits in a stage's b_scale (column scales). A wgmma fragment gives lane l the
// columns 8 j + 2 (l % 4) + {0, 1}, j = 0..15: 16-byte group 4 i + l % 4 holds that lane's columns of
// chunks j = 2 i and 2 i + 1, so a thread reads its 32 scales as eight 16-byte loads, and the four
// lanes l % 4 of one load read 64 consecutive bytes (ordered by l % 4 first, they lay 128 bytes apart,
// on the same banks: four-way conflicts).
__device__ constexpr int column_scale_slot(int c) { return c / 16 * 16 + c % 8 / 2 * 4 + c / 8 % 2 * 2 + c % 2; }

// Every TMA tile starts on a 1024-byte boundary: the 128-byte swizzle pattern repeats every 8 rows
// of 128 bytes and is computed from absolute shared-memory address bits.
template <class Stages>
struct SharedStorage {
  using Element = typename Stages::Element;
  static constexpr int kStages = Stages::kStages, kStoreSlots = Stages::kStoreSlots;
  static constexpr bool kColumnScales = Stages::kColumnScales;
  static constexpr int kTileN = Stages::kTileN, kSliceK = Stages::kSliceK;
  static constexpr uint32_t kStageBytes = (kBlockM + Stages::kTileN) * Stages::kSliceK * sizeof(Element);
  static_assert(Stages::kSliceK * sizeof(Element) == 128, "one K slice row must be one 128-byte swizzle row");

  alignas(1024) Element a[kStages][kBlockM * Stages::kSliceK];
  alignas(1024) Element b[kStages][Stages::kTileN * Stages::kSliceK];
  alignas(1024) __nv_bfloat16 c[kConsumerWarpgroups][kStoreSlots][kStoreBoxRows * kStoreBoxCols];
  // Scales of each stage's slice (E4M3 only): the tile's A rows' and its B block's (or B columns'). B
  // columns are stored in fragment order (column_scale_slot): a thread reads its 32 columns' scales as
  // eight 16-byte loads.
  alignas(16) float a_scale[Stages::kScales ? kStages : 1][kBlockM];
  alignas(16) float b_scale[Stages::kScales ? kStages : 1][Stages::kColumnScales ? Stages::kTileN : 1];
  uint64_t full[kStages];   // TMA bytes landed          (1 producer arrival + transaction bytes; with
                            // scales, + one arrival per scale-loader lane once its copies landed)
  uint64_t empty[kStages];  // consumers done reading    (one arrival per consumer thread: lane 0 arrives for
                            // its warp (free_stage) unless the warp's lanes read the stage themselves)
  uint64_t tile_full[kTileSlots];
  uint64_t tile_empty[kTileSlots];  // one arrival per consumer warp and the loader (and the scale loader)
  uint64_t claim;                   // claims_late: the loader's go for the next tile's claim, once per tile
  TileInfo tiles[kTileSlots];
};
// Dynamic shared memory of a kernel whose tiles are of kind kKind: + slack to align the dynamic base.
template <TileKind kKind>
constexpr size_t kSharedBytesOf = sizeof(SharedStorage<StagesOf<kKind>>) + 1024;
constexpr size_t kSharedBytes = kSharedBytesOf<TileKind::kForward>;
static_assert(kSharedBytes <= 232448 && kSharedBytesOf<TileKind::kForwardFp8> <= 232448 &&
                  kSharedBytesOf<TileKind::kWeightGradFp8> <= 232448,
              "shared memory exceeds the sm_90 per-block limit");

constexpr uint32_t kConsumerWarps = kConsumerWarpgroups * 4;

template <class Stages>
__device__ __forceinline__ SharedStorage<Stages>& shared_storage(uint8_t* smem_raw) {
  return *reinterpret_cast<SharedStorage<Stages>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
}

// ---- tile source contract ---------------------------------------------------------------------------

// The tile fetcher asks its TileSource for tiles; TileSource::kKind is one of the kinds above.
//   bool next(TileInfo& tile)  takes the next tile and waits (bounded) until its A rows are ready, then
//                              fences them for TMA; false when there are no more tiles or a wait gave
//                              up. Called by the fetcher thread (not the loader, which fences again).
//   const GemmOperands& operands(int gemm) const
//   const TimelineSink& timeline() const      where the CTA's spans go (common/timeline.cuh)
//   static constexpr RegisterSplit kRegisters   optional: the producer / consumer registers (default: the
//                              stage format's, kBf16Registers or kFp8Registers)
//   static constexpr int kClaimLeadSlices   optional (default 0: as soon as a slot is free): the fetcher
//                              claims the next tile only once the loader has this many K slices of the
//                              current one left to load (claims_late)
// and, when its queue holds kElementwiseTile items (stage A and B are raw bytes to them; E4M3 stages are
// the same size as BF16 ones, and their scale loader only arrives for the item's slices),
//   void load_elementwise(const TileInfo& tile, int slice, void* a, void* b, uint64_t* full) const
//                              run by the loader thread: fills stage A and B of the item's slice
//                              (asynchronous copies counted on `full`, expect-tx included)
//   void run_elementwise(const TileInfo& tile, int slice, const void* a, const void* b, int consumer,
//                        int thread) const
//                              run by every consumer thread (thread 0..127 of warpgroup `consumer`) on a
//                              landed slice; each thread frees the stage when it returns
//   void finish_elementwise(const TileInfo& tile, int consumer, int thread) const
//                              run by every consumer thread once both warpgroups ran every slice (their
//                              shared- and global-memory writes are visible to each other)
struct GemmOperands {
  // bf16. K-major A: [rows, k], box kBlockK x kBlockM; K-major B: [experts * n, k], box kBlockK x kBlockN.
  // MN-major: [k rows, m or n], box 64 x kBlockK.
  const CUtensorMap* a;
  const CUtensorMap* b;
  // bf16 [rows, out cols], box kStoreBoxCols x kStoreBoxRows; k-grouped: [experts, m, n] bf16 or fp32,
  // box 128 bytes x kStoreBoxRows x 1.
  const CUtensorMap* c;
  Epilogue epilogue;
  const float* row_scale;  // optional, indexed by C row
  // Optional per-m-block completion counters: each consumer adds 1 once its half of a tile is in global
  // memory (so a finished m-block has kConsumerWarpgroups * n-blocks arrivals). Without them stores
  // stay asynchronous.
  uint32_t* done;
  // kSwiGLU only, optional: bf16 [rows, n] (store box) that also receives the tile before SwiGLU, at
  // TileInfo::keep_row: the gate/up rows a training forward keeps for the backward.
  const CUtensorMap* keep;
  // E4M3 kinds only: fp32 power-of-two scales of A, [k / 128, a_scale_stride] (1 x 128 blocks of each row,
  // K block-major: one slice's scales of all rows lie together), and of B, [experts * n / 128, k / 128]
  // (128 x 128 blocks); kWeightGradFp8: see below.
  const float* a_scale;
  const float* b_scale;
  // kWeightGradFp8: the scale arrays are [rows / 128, m] and [rows / 128, n] (K block-major too), these
  // being m and n; a tile's slices start at its expert's first row.
  int32_t a_scale_stride, b_scale_stride;
};

// Waits inside the CTA must outlast the producer's readiness wait, which they may sit behind.
__device__ __forceinline__ uint64_t pipeline_timeout_ns(uint64_t ready_timeout_ns) {
  return 2 * ready_timeout_ns + 1'000'000'000ull;
}

// ---- producer ---------------------------------------------------------------------------------------

// K slice kb (kSliceK wide) of an operand tile with kRows rows of M or N: one box when K-major, a
// 64 x kSliceK box per 64 elements of M or N when MN-major (TMA boxes are at most 128 bytes wide with
// the 128-byte swizzle; MN-major operands are bf16 only).
template <int kRows, bool kMNMajor, int kSliceK, class Element>
__device__ __forceinline__ void load_slice(Element* dst, const CUtensorMap* map, const OperandOrigin& at, int kb,
                                           uint64_t* full) {
  if constexpr (kMNMajor) {
#pragma unroll
    for (int atom = 0; atom < kRows / 64; ++atom)
      ptx::tma_load_2d(dst + atom * 64 * kSliceK, map, full, at.col + atom * 64, at.row + kb * kSliceK);
  } else {
    ptx::tma_load_2d(dst, map, full, at.col + kb * kSliceK, at.row);
  }
}

// The producer warpgroup's two roles around the tile slots:
//   the tile fetcher takes tiles from the source in order, its waits for their inputs included, and
//   publishes each into a slot;
//   the loader issues each tile's loads stage by stage.
// Apart (two threads), the fetcher's round trips for a tile (the ticket, its decode, the readiness
// counter) run while the loader still streams the tiles before it: in one thread they sat between a
// tile's last load and the next one's first, an idle gap for the tensor cores on every tile of a few K
// slices.
// A fetcher ahead of the loader claims a tile (its ticket) as soon as a slot is free, a whole tile before
// the loader needs it. Where tiles wait for one another's outputs, a tile claimed that early can sit in
// one CTA's slot while others idle; a source with kClaimLeadSlices claims only when the loader is that
// many slices from the end of the current tile: early enough for the claim's round trips and the wait
// for the tile's inputs to pass under the loads in flight, late enough to take the tile that is next.
template <class Tiles>
constexpr int claim_lead_slices() {
  if constexpr (requires { Tiles::kClaimLeadSlices; })
    return Tiles::kClaimLeadSlices;
  else
    return 0;
}
template <class Tiles>
constexpr bool claims_late() {
  return claim_lead_slices<Tiles>() > 0;
}

// Takes the next tile from the source and publishes it into slot `slot`.
template <class Tiles, class Storage>
__device__ TileInfo fetch_tile(Storage& s, Tiles& tiles, uint32_t& slot, uint32_t& slot_phase,
                               const WaitSite& pipe_site) {
  TileInfo info{};
  const timeline::Stamp asked = timeline::now();
  info.valid = tiles.next(info) ? 1 : 0;
  if (info.valid) timeline::record(tiles.timeline(), TimelineSpan::kTileWait, asked, info.gemm, info.m_block);
  mbarrier_wait_bounded(&s.tile_empty[slot], slot_phase ^ 1, pipe_site, WaitTarget::kTileInfoFree, slot);
  s.tiles[slot] = info;
  ptx::mbarrier_arrive(&s.tile_full[slot]);  // release: the readers' wait makes `info` visible
  if (++slot == kTileSlots) slot = 0, slot_phase ^= 1;
  return info;
}

// Issues the loads of one tile's K slices (or an elementwise item's slices) into the stage ring.
// claims_late: arrives on the claim barrier when claim_lead_slices() slices of the tile are left to load
// (at once for a shorter tile), once per tile.
template <class Tiles, class Storage>
__device__ void load_tile(Storage& s, const Tiles& tiles, const TileInfo& info, uint32_t& stage, uint32_t& phase,
                          const WaitSite& pipe_site) {
  using Stages = StagesOf<Tiles::kKind>;
  constexpr int kStages = Storage::kStages;
  const int claim_at = claims_late<Tiles>() ? max(0, info.k_blocks - claim_lead_slices<Tiles>()) : -1;
  const auto maybe_claim = [&](int slice) {
    if (slice == claim_at) ptx::mbarrier_arrive(&s.claim);
  };
  if (info.k_blocks == 0) maybe_claim(0);
  if constexpr (requires { tiles.load_elementwise(info, 0, s.a[0], s.b[0], &s.full[0]); }) {
    if (info.gemm == kElementwiseTile) {
      for (int slice = 0; slice < info.k_blocks; ++slice) {
        maybe_claim(slice);
        mbarrier_wait_bounded(&s.empty[stage], phase ^ 1, pipe_site, WaitTarget::kStageEmpty, stage);
        tiles.load_elementwise(info, slice, s.a[stage], s.b[stage], &s.full[stage]);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      return;
    }
  }
  const GemmOperands& op = tiles.operands(info.gemm);
  const bool trans_a = reads_a_mn_major(Tiles::kKind, info.gemm);
  for (int kb = 0; kb < info.k_blocks; ++kb) {
    maybe_claim(kb);
    mbarrier_wait_bounded(&s.empty[stage], phase ^ 1, pipe_site, WaitTarget::kStageEmpty, stage);
    ptx::mbarrier_arrive_expect_tx(&s.full[stage], Storage::kStageBytes);
    if (trans_a)
      load_slice<kBlockM, true, Stages::kSliceK>(s.a[stage], op.a, info.a, kb, &s.full[stage]);
    else
      load_slice<kBlockM, false, Stages::kSliceK>(s.a[stage], op.a, info.a, kb, &s.full[stage]);
    // B rows past the last expert are out of bounds and zero-filled; rows past this expert's N belong
    // to the next expert and only feed output columns the clipped store never writes.
    constexpr bool kTransB = Tiles::kKind == TileKind::kDataGrad || Tiles::kKind == TileKind::kWeightGrad ||
                             Tiles::kKind == TileKind::kBackward;
    load_slice<Stages::kTileN, kTransB, Stages::kSliceK>(s.b[stage], op.b, info.b, kb, &s.full[stage]);
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
}

// The fetcher thread. claims_late: each tile after the first waits for the loader's go,
// given while it loads the tile before (so at most one go is pending: phases alternate).
template <class Tiles, class Storage>
__device__ void run_tile_fetcher(Storage& s, Tiles& tiles, const WaitSite& pipe_site) {
  uint32_t slot = 0, slot_phase = 0, claim_phase = 0;
  while (fetch_tile(s, tiles, slot, slot_phase, pipe_site).valid) {
    if constexpr (claims_late<Tiles>()) {
      mbarrier_wait_bounded(&s.claim, claim_phase, pipe_site, WaitTarget::kTileClaim, 0);
      claim_phase ^= 1;
    }
  }
}

// The loader thread, a reader of the slots like the consumers.
template <class Tiles, class Storage>
__device__ void run_loader(Storage& s, const Tiles& tiles, const WaitSite& pipe_site) {
  uint32_t stage = 0, phase = 0, slot = 0, slot_phase = 0;
  for (;;) {
    mbarrier_wait_bounded(&s.tile_full[slot], slot_phase, pipe_site, WaitTarget::kTileInfo, slot);
    const TileInfo info = s.tiles[slot];
    ptx::mbarrier_arrive(&s.tile_empty[slot]);
    if (++slot == kTileSlots) slot = 0, slot_phase ^= 1;
    if (!info.valid) return;
    // NOTES: the fetcher acquired the tile's inputs (other CTAs' writes, through the generic proxy) and
    // this thread acquired the fetcher's slot; the loads below read through the async proxy.
    ptx::fence_proxy_async_global();
    load_tile(s, tiles, info, stage, phase, pipe_site);
  }
}

// A consumer warp (or the scale loader) takes the next tile the fetcher published, and frees its slot.
// NOTES: lane 0 alone reads the slot and hands it to the warp by shuffles, so its own arrival orders every
// read of the slot before the producer refills it. Read by every lane, only a __syncwarp (nothing at all
// in converged code) stood between the other lanes' loads and lane 0's arrival: racecheck reported the
// producer's next write racing with them.
template <class Storage>
__device__ __forceinline__ TileInfo take_tile(Storage& s, uint32_t& slot, uint32_t& slot_phase,
                                              const WaitSite& pipe_site) {
  static_assert(sizeof(TileInfo) % sizeof(int32_t) == 0, "TileInfo travels as 32-bit words");
  constexpr int kWords = sizeof(TileInfo) / sizeof(int32_t);
  const bool leader = threadIdx.x % 32 == 0;
  mbarrier_wait_bounded(&s.tile_full[slot], slot_phase, pipe_site, WaitTarget::kTileInfo, slot);
  TileInfo tile;
  const int32_t* from = reinterpret_cast<const int32_t*>(&s.tiles[slot]);
  int32_t* to = reinterpret_cast<int32_t*>(&tile);
#pragma unroll
  for (int i = 0; i < kWords; ++i) to[i] = __shfl_sync(0xFFFFFFFFu, leader ? from[i] : 0, 0);
  if (leader) ptx::mbarrier_arrive(&s.tile_empty[slot]);
  if (++slot == kTileSlots) slot = 0, slot_phase ^= 1;
  return tile;
}

// E4M3 tiles: one warp copies each K slice's scales (the tile's 128 A-row scales, and its B block's or its
// 128 B columns') into the stage, asynchronously, and each lane arrives on the stage's full barrier once
// its copies landed. Both kinds read A's scales K block-major: a slice's 128 row scales are one 16-byte
// piece per lane (gathered from a row-major array, 128 strided 4-byte loads cost 3-8 % of the FP8 GEMM).
// NOTES: the consumers then read their scales from shared memory beside the operands. Loaded by the
// consumers from global memory instead, one slice ahead, each slice's MMAs sat behind the loads' latency
// (the register that carried the next slice's scale had to be ready before the wgmma wait).
template <class Tiles, class Storage>
__device__ void run_scale_loader(Storage& s, const Tiles& tiles, const WaitSite& pipe_site) {
  static_assert(kBlockM == 32 * 4, "a slice's A scales are one 16-byte piece per lane");
  const int lane = threadIdx.x % 32;
  uint32_t stage = 0, phase = 0, slot = 0, slot_phase = 0;
  for (;;) {
    const TileInfo tile = take_tile(s, slot, slot_phase, pipe_site);
    if (!tile.valid) return;
    if (tile.gemm == kElementwiseTile) {  // no scales: each lane's arrival completes the stage's count
      for (int kb = 0; kb < tile.k_blocks; ++kb) {
        mbarrier_wait_bounded(&s.empty[stage], phase ^ 1, pipe_site, WaitTarget::kStageEmpty, stage);
        ptx::mbarrier_arrive(&s.full[stage]);
        if (++stage == Storage::kStages) stage = 0, phase ^= 1;
      }
      continue;
    }
    const GemmOperands& op = tiles.operands(tile.gemm);
    // A [k / 128, a_scale_stride]: a slice is one row, 16 bytes per lane; the k-grouped tile's K starts at
    // its expert's first row (the operands' column). Row scales: B [experts * n / 128, k / 128], a slice one
    // column. Column scales (k-grouped): B [rows / 128, n], a slice one row (in 8-byte pairs, to their
    // slots in fragment order).
    const float* a_scale = op.a_scale + int64_t(tile.a.col / 128) * op.a_scale_stride + tile.a.row + 4 * lane;
    const float* b_scale = Storage::kColumnScales
                               ? op.b_scale + int64_t(tile.a.col / 128) * op.b_scale_stride + tile.b.row + 4 * lane
                               : op.b_scale + int64_t(tile.b.row / Fp8Stages::kTileN) * tile.k_blocks;
    for (int kb = 0; kb < tile.k_blocks; ++kb) {
      mbarrier_wait_bounded(&s.empty[stage], phase ^ 1, pipe_site, WaitTarget::kStageEmpty, stage);
      ptx::cp_async<16>(&s.a_scale[stage][4 * lane], a_scale + int64_t(kb) * op.a_scale_stride);
      if constexpr (Storage::kColumnScales) {
        ptx::cp_async<8>(&s.b_scale[stage][column_scale_slot(4 * lane)], b_scale + int64_t(kb) * op.b_scale_stride);
        ptx::cp_async<8>(&s.b_scale[stage][column_scale_slot(4 * lane + 2)],
                         b_scale + int64_t(kb) * op.b_scale_stride + 2);
      } else if (lane == 0) {
        ptx::cp_async<4>(&s.b_scale[stage], b_scale + kb);
      }
      ptx::cp_async_mbarrier_arrive(&s.full[stage]);
      if (++stage == Storage::kStages) stage = 0, phase ^= 1;
    }
  }
}

// ---- consumer ---------------------------------------------------------------------------------------

// NOTES: silu(g) = g * sigmoid(g) with sigmoid(g) = 0.5 + 0.5 * tanh(g / 2): four instructions, one of
// them MUFU. The epilogue stalls the tensor cores while it runs, and the exp-and-divide form cost ~7%
// of GEMM1's time (measured: docs/grouped_gemm.md).
__device__ __forceinline__ float silu(float g) { return g * fmaf(0.5f, ptx::tanh_approx(0.5f * g), 0.5f); }

__device__ __forceinline__ void st_shared_bf16x2(uint32_t addr, float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  ptx::st_shared_b32(addr, *reinterpret_cast<const uint32_t*>(&v));
}

__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float lo, float hi) {
  ptx::st_shared_b32(addr, __float_as_uint(lo));
  ptx::st_shared_b32(addr + 4, __float_as_uint(hi));
}

// Where store_tile writes a tile: the C map (or the keep map), its first row and column, its expert
// (3-D C only), and an optional per-row scale.
struct StoreTarget {
  const CUtensorMap* map;
  const float* row_scale;
  int32_t row, col, expert;
};

// Accumulator fragment of wgmma m64nN (N / 2 floats per thread): warp w of the warpgroup holds rows 16w + lane/4 and
// that + 8; for 8-column chunk j it holds columns 8j + 2*(lane%4) + {0,1} in acc[4j + {0,1}] (first row) and acc[4j +
// {2,3}] (second row). With gate/up interleaved in groups of 8, chunk 2i is gate and chunk 2i + 1 the matching up:
// SwiGLU needs no data exchange between threads. Outputs leave in boxes one swizzle row (128 bytes) wide: 64 bf16 or 32
// fp32 columns. A k-grouped tile (kKGrouped) writes its expert's matrix of a 3-D C; `empty` (no K slices) stores zeros.
// Boxes take the store slots in turn, from `slot` on (the consumer's running count: a tile may store an
// odd number of boxes, and the slot its last box used must not be refilled before that store has read it).
template <Epilogue kEpilogue, bool kKGrouped = false, int kAcc, class Storage>
__device__ void store_tile(const float (&acc)[kAcc], Storage& s, const StoreTarget& to, bool empty, uint32_t& slot,
                           int consumer, int thread) {
  const bool zeros = kKGrouped && empty;
  const auto value = [&](int i) { return zeros ? 0.0f : acc[i]; };
  constexpr bool kF32 = kEpilogue == Epilogue::kStoreF32 || kEpilogue == Epilogue::kAddF32;
  constexpr int kTileN = 2 * kAcc;
  constexpr int kOutCols = kEpilogue == Epilogue::kSwiGLU ? kTileN / 2 : kTileN;
  constexpr int kBoxCols = kF32 ? 32 : kStoreBoxCols;
  constexpr int kBoxes = kOutCols / kBoxCols;
  const int warp = thread / 32, lane = thread % 32;
  const int row = warp * 16 + lane / 4;  // within this consumer's 64 rows; the second row is row + 8
  const int32_t out_row = to.row + consumer * kRowsPerConsumer;
  float scale_lo = 1.0f, scale_hi = 1.0f;
  if (!kF32 && to.row_scale != nullptr) {
    scale_lo = to.row_scale[out_row + row];
    scale_hi = to.row_scale[out_row + row + 8];
  }
  const uint32_t barrier = kEpilogueBarrierBase + consumer;

#pragma unroll
  for (int box = 0; box < kBoxes; ++box) {
    constexpr int kStoreSlots = Storage::kStoreSlots;
    const uint32_t store_slot = (slot + box) % kStoreSlots;
    const uint32_t base = ptx::smem_addr(s.c[consumer][store_slot]);
    // The store issued from this slot kStoreSlots boxes ago (maybe in the previous tile) must have read it.
    if (thread == 0) ptx::bulk_wait_group_read<kStoreSlots - 1>();
    ptx::named_barrier_sync(barrier, 128);
    if constexpr (kF32) {
      // 8-column chunks of the box: chunk c is 16-byte units 2c and 2c + 1. A 64-bit store is served a
      // half-warp (4 rows) at a time; in step c, lanes of odd rows store chunk c ^ 2 instead, so the
      // half-warp's 4 rows hit 4 different unit pairs (unit pair = chunk ^ (row % 8) / 2) and all 32
      // banks once. Storing chunk c on every row took two passes per half-warp (rows r and r ^ 1 share a
      // unit pair; measured: twice the ideal shared-store wavefronts).
      const bool odd_row = row % 2 == 1;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int chunk = box * 4 + c, swapped = box * 4 + (c ^ 2);
        const int unit = 2 * (odd_row ? c ^ 2 : c) + (lane % 4) / 2;
        const uint32_t offset = uint32_t((unit ^ (row % 8)) * 16 + (lane % 2) * 8);  // 128-byte swizzle
        const auto pick = [&](int i) { return odd_row ? value(4 * swapped + i) : value(4 * chunk + i); };
        st_shared_f32x2(base + row * 128 + offset, pick(0), pick(1));
        st_shared_f32x2(base + (row + 8) * 128 + offset, pick(2), pick(3));
      }
    } else {
#pragma unroll
      for (int unit = 0; unit < 8; ++unit) {  // 16-byte unit of the 128-byte box row = 8 output columns
        float v[4];
        if constexpr (kEpilogue == Epilogue::kSwiGLU) {
          constexpr int kChunksPerBox = 16;  // 8 gate + 8 up chunks make one box of outputs
          const int gate = box * kChunksPerBox + 2 * unit;
#pragma unroll
          for (int q = 0; q < 4; ++q) v[q] = silu(value(4 * gate + q)) * value(4 * (gate + 1) + q);
        } else {
          const int chunk = box * 8 + unit;
#pragma unroll
          for (int q = 0; q < 4; ++q) v[q] = value(4 * chunk + q);
        }
        // 128-byte swizzle, as the TMA store expects: unit u of row r sits at unit u ^ (r % 8). A warp's
        // 8 rows x 4 lanes then hit 32 different banks.
        const uint32_t offset = uint32_t(((unit ^ (row % 8)) * 16) + (lane % 4) * 4);
        st_shared_bf16x2(base + row * 128 + offset, v[0] * scale_lo, v[1] * scale_lo);
        st_shared_bf16x2(base + (row + 8) * 128 + offset, v[2] * scale_hi, v[3] * scale_hi);
      }
    }
    ptx::fence_proxy_async_shared();  // st.shared (generic proxy) before the TMA store reads (async proxy)
    ptx::named_barrier_sync(barrier, 128);
    if (thread == 0) {
      const int32_t col = to.col + box * kBoxCols;
      if constexpr (!kKGrouped)
        ptx::tma_store_2d(to.map, s.c[consumer][store_slot], col, out_row);
      else if constexpr (kEpilogue == Epilogue::kAddF32)
        ptx::tma_reduce_add_3d(to.map, s.c[consumer][store_slot], col, out_row, to.expert);
      else
        ptx::tma_store_3d(to.map, s.c[consumer][store_slot], col, out_row, to.expert);
      ptx::bulk_commit_group();
    }
  }
  slot = (slot + kBoxes) % Storage::kStoreSlots;
}

// Releases a finished tile's completion counter (consumer thread 0) once its stores have landed.
// NOTES: the tile's readers (other CTAs' TMA loads, copy engines) acquire the counter. The stores must
// have completed, not just read shared memory, and the async-proxy writes must be ordered before the
// generic-proxy release. Waiting right after the epilogue would idle the warpgroup for the stores'
// flight (~1.5 us a tile, measured) on every tile, so run_consumer calls this kDoneLagSlices K slices
// into the next tile, or before it waits for a tile that may not come until this release (the producer
// may be waiting for it).
__device__ __forceinline__ void release_done(uint32_t*& counter) {
  if (counter == nullptr) return;
  ptx::bulk_wait_group<0>();
  ptx::fence_proxy_async_global();
  ptx::red_release_gpu_add(counter, 1);
  counter = nullptr;
}

// A stage's empty barrier counts consumer threads. A warp whose reads of the stage are its wgmmas (waited
// for) frees it by one arrival of 32 from lane 0; an elementwise slice, read by every thread with generic
// loads, by one arrival from each thread. NOTES: racecheck orders a stage's reads before the producer's
// refill only for the thread that arrives: with lane 0 arriving for its warp's generic reads (after a
// warpgroup barrier), it reported the refill racing with them.
__device__ __forceinline__ void free_stage(uint64_t* empty) { ptx::mbarrier_arrive(empty, 32); }

// A consumer whose rows are all padding (`skip` below): waits for each stage and releases it at once.
template <class Storage>
__device__ __forceinline__ void drain_stages(Storage& s, int k_blocks, uint32_t& stage, uint32_t& phase,
                                             uint32_t*& pending_done, const WaitSite& pipe_site, int thread) {
  for (int kb = 0; kb < k_blocks; ++kb) {
    mbarrier_wait_bounded(&s.full[stage], phase, pipe_site, WaitTarget::kStageFull, stage);
    if (thread % 32 == 0) free_stage(&s.empty[stage]);
    if (kb == kDoneLagSlices && thread == 0) release_done(pending_done);
    if (++stage == Storage::kStages) stage = 0, phase ^= 1;
  }
}

// One bf16 tile's mainloop: one wgmma group per K slice; keep one group in flight and release a stage as
// soon as the group reading it has completed. K-major slices step K by 32 bytes per wgmma, MN-major ones
// by 16 rows of 128 bytes; each consumer reads its 64 rows of A (8 KB into the stage either way).
// `skip`: this consumer's rows are all padding.
// kBackward's consumers pass `a_mn_major` per tile (kTransA = true, kRuntimeA): one loop whose slice
// issues either layout's wgmmas. NOTES: two loops, one per layout, made ptxas serialize every wgmma of the
// kernel (C7514); and each branch fences, commits and waits for its own group: with the commit after the
// branches ptxas issued a dummy wgmma at the merge (C7519), and every slice then waited for the one
// before it (7-14 % more cycles a tile, measured).
template <bool kTransA, bool kTransB, bool kRuntimeA = false>
__device__ __forceinline__ void run_mainloop(SharedStorage<Bf16Stages>& s, float (&acc)[128], int k_blocks, bool skip,
                                             uint32_t& stage, uint32_t& phase, uint32_t*& pending_done,
                                             const WaitSite& pipe_site, int consumer, int thread,
                                             bool a_mn_major = kTransA) {
  constexpr uint32_t kStepB = kTransB ? 16 * 128 : 32;
  const int lane = thread % 32;
  if (skip) return drain_stages(s, k_blocks, stage, phase, pending_done, pipe_site, thread);
  // The slice's four wgmmas with A K-major (stepping K by 32 bytes) or MN-major (by 16 rows of 128 bytes).
  const auto issue = [&]<bool kMNMajorA>(uint32_t a_base, uint32_t b_base, int kb) {
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      const uint64_t a = kMNMajorA ? ptx::wgmma_desc_mn_major_sw128(a_base + kk * 16 * 128, 64 * 128)
                                   : ptx::wgmma_desc_k_major_sw128(a_base + kk * 32);
      const uint64_t b = kTransB ? ptx::wgmma_desc_mn_major_sw128(b_base + kk * kStepB, 64 * 128)
                                 : ptx::wgmma_desc_k_major_sw128(b_base + kk * kStepB);
      ptx::wgmma_m64n256k16_bf16<kMNMajorA, kTransB>(acc, a, b, kb > 0 || kk > 0);
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<1>();
  };
  uint32_t previous_stage = 0;
  for (int kb = 0; kb < k_blocks; ++kb) {
    mbarrier_wait_bounded(&s.full[stage], phase, pipe_site, WaitTarget::kStageFull, stage);
    const uint32_t a_base = ptx::smem_addr(s.a[stage]) + consumer * kRowsPerConsumer * 128;
    const uint32_t b_base = ptx::smem_addr(s.b[stage]);
    ptx::fence_registers(acc);
    if constexpr (kRuntimeA) {
      if (a_mn_major)
        issue.template operator()<true>(a_base, b_base, kb);
      else
        issue.template operator()<false>(a_base, b_base, kb);
    } else {
      issue.template operator()<kTransA>(a_base, b_base, kb);
    }
    ptx::fence_registers(acc);
    if (kb > 0 && lane == 0) free_stage(&s.empty[previous_stage]);
    if (kb == kDoneLagSlices && thread == 0) release_done(pending_done);
    previous_stage = stage;
    if (++stage == Bf16Stages::kStages) stage = 0, phase ^= 1;
  }
  ptx::wgmma_wait_group<0>();
  ptx::fence_registers(acc);
  if (k_blocks > 0 && lane == 0) free_stage(&s.empty[previous_stage]);
}

// E4M3 consumers take turns issuing their slices' wgmmas: consumer c issues its next slice once the
// other has issued its previous one, so the tensor cores run the two consumers' slices alternately and
// one consumer scales its finished slice while the other's run. (Left alone, the two consumers fell into
// step, both waiting for the same stage, both scaling at once while the tensor cores idled.) `taken`
// counts this consumer's issues; consumer 0's very first one waits for nobody. Both consumers issue the
// same slices (every tile's), so the turns pair up.
struct IssueTurns {
  uint32_t taken = 0;
  __device__ void wait(int consumer) {
    if (consumer == 1 || taken > 0) ptx::named_barrier_sync(kIssueTurnBarrierBase + consumer, 2 * 128);
    ++taken;
  }
  __device__ void pass(int consumer) { ptx::named_barrier_arrive(kIssueTurnBarrierBase + (1 - consumer), 2 * 128); }
  // Consumer 0 takes the last turn consumer 1 passed it, so no arrival is left on the barrier.
  __device__ void finish(int consumer) {
    if (consumer == 0 && taken > 0) ptx::named_barrier_sync(kIssueTurnBarrierBase, 2 * 128);
  }
};

// An E4M3 consumer whose rows are all padding: releases each stage unread, still taking its turns.
template <class Storage>
__device__ __forceinline__ void skip_fp8_stages(Storage& s, int k_blocks, uint32_t& stage, uint32_t& phase,
                                                uint32_t*& pending_done, IssueTurns& turns, const WaitSite& pipe_site,
                                                int consumer, int thread) {
  for (int kb = 0; kb < k_blocks; ++kb) {
    mbarrier_wait_bounded(&s.full[stage], phase, pipe_site, WaitTarget::kStageFull, stage);
    turns.wait(consumer);
    turns.pass(consumer);
    if (thread % 32 == 0) free_stage(&s.empty[stage]);
    if (kb == kDoneLagSlices && thread == 0) release_done(pending_done);
    if (++stage == Storage::kStages) stage = 0, phase ^= 1;
  }
}

// For stage `stage`, whose data the caller has waited for (full): takes this consumer's turn, issues the
// slice's wgmmas into `part` (one commit group: the caller waits for it) and passes the turn. `a_low`,
// `b_low`: the descriptors' low words at stage 0 (the stages lie kStageUnits apart).
template <class Storage>
__device__ __forceinline__ void issue_fp8_slice(Storage& s, float (&part)[64], uint32_t a_low, uint32_t b_low,
                                                uint32_t stage, IssueTurns& turns, int consumer) {
  constexpr uint32_t kStageUnits = sizeof(s.a[0]) / 16;
  static_assert(sizeof(s.a[0]) == sizeof(s.b[0]), "A and B stages advance together");
  turns.wait(consumer);
  const uint32_t stage_units = stage * kStageUnits;
  ptx::fence_registers(part);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Storage::kSliceK / 32; ++kk)  // 32 bytes (2 units) of K per wgmma
    ptx::wgmma_m64n128k32_e4m3(part, a_low + stage_units + 2 * kk, b_low + stage_units + 2 * kk, kk > 0);
  ptx::wgmma_commit_group();
  turns.pass(consumer);
}

// Tiles of at least this many K slices run the two-accumulator mainloop (run_fp8_mainloop); measured on
// one H200 it was 2-9 % faster from 16 slices up (K >= 2048) and 9 % slower at 6.
inline constexpr int kFp8PipelinedSlices = 12;

// A slice's two scales for this thread's rows (row and row + 8): A row scale x B block scale, powers of
// two, so the products are exact.
struct SliceScales {
  float lo, hi;
};

// One E4M3 tile's mainloop. A K slice is one scale block of both operands: its four m64n128k32 wgmmas
// sum into a partial accumulator, which is then added to `acc` times (A row scale x B block scale) in
// fp32. Promoting every 128 of K keeps the error independent of K: the tensor cores' FP8 sums carry fewer
// bits than fp32. From kFp8PipelinedSlices slices on, two partial accumulators alternate (64 + 2 x 64
// registers: the consumers' setmaxnreg budget, which ptxas honours since no wait traps). `skip`: this
// consumer's rows are all padding: it releases each stage unread, still taking its turns.
// NOTES: the consumers are bound by their own instruction issue here (64 FMAs a slice, two warps of each
// scheduler), so the loop keeps per-slice bookkeeping to 32-bit adds, and reads a slice's scales before
// issuing its wgmmas so that the loads' latency passes under the issue.
__device__ __forceinline__ void run_fp8_mainloop(SharedStorage<Fp8Stages>& s, float (&acc)[64], int k_blocks, bool skip,
                                                 uint32_t& stage, uint32_t& phase, uint32_t*& pending_done,
                                                 IssueTurns& turns, const WaitSite& pipe_site, int consumer,
                                                 int thread) {
  const int lane = thread % 32;
  // This thread's rows of the fragment: row and row + 8 (see store_tile).
  const int row = consumer * kRowsPerConsumer + (thread / 32) * 16 + lane / 4;
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
  if (skip) return skip_fp8_stages(s, k_blocks, stage, phase, pending_done, turns, pipe_site, consumer, thread);
  // Stage 0's descriptor low words and scale addresses, computed once.
  const uint32_t a_low = ptx::wgmma_desc_low_k_major_sw128(ptx::smem_addr(s.a[0]) + consumer * kRowsPerConsumer * 128);
  const uint32_t b_low = ptx::wgmma_desc_low_k_major_sw128(ptx::smem_addr(s.b[0]));
  const uint32_t a_scale = ptx::smem_addr(&s.a_scale[0][row]), b_scale = ptx::smem_addr(&s.b_scale[0]);
  // Once the stage is full. Each thread's own arrival on the stage's empty barrier (a release, after its
  // wgmma wait) orders these reads before the refill.
  const auto read_scales = [&](uint32_t at) {
    const float slice_b_scale = ptx::ld_shared_f32(b_scale + at * sizeof(float));
    const uint32_t a_at = a_scale + at * sizeof(s.a_scale[0]);
    return SliceScales{ptx::ld_shared_f32(a_at) * slice_b_scale,
                       ptx::ld_shared_f32(a_at + 8 * sizeof(float)) * slice_b_scale};
  };
  const auto promote = [&](const float(&part)[64], SliceScales scales) {
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = fmaf(part[i], i % 4 < 2 ? scales.lo : scales.hi, acc[i]);
  };
  if (k_blocks < kFp8PipelinedSlices) {
    // Short K: one partial accumulator, each slice's wgmmas waited for before scaling it.
    float part[64];
    for (int kb = 0; kb < k_blocks; ++kb) {
      mbarrier_wait_bounded(&s.full[stage], phase, pipe_site, WaitTarget::kStageFull, stage);
      const SliceScales scales = read_scales(stage);
      issue_fp8_slice(s, part, a_low, b_low, stage, turns, consumer);
      ptx::wgmma_wait_group<0>();
      ptx::fence_registers(part);
      ptx::mbarrier_arrive(&s.empty[stage]);  // every thread read the stage's scales
      if (kb == kDoneLagSlices && thread == 0) release_done(pending_done);
      promote(part, scales);
      if (++stage == Fp8Stages::kStages) stage = 0, phase ^= 1;
    }
    return;
  }
  // Slices alternate between two partial accumulators: a consumer issues slice k + 1 (in its turn) before
  // it scales slice k, so its own wgmmas stay queued while it scales.
  struct Issued {
    uint32_t stage;
    SliceScales scales;
  };
  const auto issue = [&](float(&part)[64]) {
    mbarrier_wait_bounded(&s.full[stage], phase, pipe_site, WaitTarget::kStageFull, stage);
    const Issued issued{stage, read_scales(stage)};
    issue_fp8_slice(s, part, a_low, b_low, stage, turns, consumer);
    if (++stage == Fp8Stages::kStages) stage = 0, phase ^= 1;
    return issued;
  };
  // After the wait that completed the slice in `part` (slice kb of the tile).
  const auto finish = [&](float(&part)[64], const Issued& slice, int kb) {
    ptx::fence_registers(part);
    ptx::mbarrier_arrive(&s.empty[slice.stage]);  // every thread read the stage's scales
    if (kb == kDoneLagSlices && thread == 0) release_done(pending_done);
    promote(part, slice.scales);
  };
  float even[64], odd[64];
  Issued even_slice = issue(even), odd_slice{};
  int kb = 0;
  for (; kb + 2 < k_blocks; kb += 2) {
    odd_slice = issue(odd);
    ptx::wgmma_wait_group<1>();
    finish(even, even_slice, kb);
    even_slice = issue(even);
    ptx::wgmma_wait_group<1>();
    finish(odd, odd_slice, kb + 1);
  }
  if (kb + 1 < k_blocks) {  // an even number of slices: the last two
    odd_slice = issue(odd);
    ptx::wgmma_wait_group<1>();
    finish(even, even_slice, kb);
    ptx::wgmma_wait_group<0>();
    finish(odd, odd_slice, kb + 1);
  } else {
    ptx::wgmma_wait_group<0>();
    finish(even, even_slice, kb);
  }
}

// One k-grouped E4M3 tile (kWeightGradFp8): per K slice, four m64n128k32 wgmmas into one partial
// accumulator, waited for, then promoted into `acc` with the A row's and each B column's scale (powers of
// two: exact products). The thread's scales (2 rows, 32 columns) are read as soon as the stage is full,
// before its turn to issue (measured 6 % faster than after the issue). `skip`: this consumer's rows are
// all padding.
__device__ __forceinline__ void run_fp8_column_scale_mainloop(SharedStorage<Fp8ColumnScaleStages>& s, float (&acc)[64],
                                                              int k_blocks, bool skip, uint32_t& stage, uint32_t& phase,
                                                              uint32_t*& pending_done, IssueTurns& turns,
                                                              const WaitSite& pipe_site, int consumer, int thread) {
  const int lane = thread % 32;
  const int row = consumer * kRowsPerConsumer + (thread / 32) * 16 + lane / 4;  // and row + 8 (store_tile)
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
  if (skip) return skip_fp8_stages(s, k_blocks, stage, phase, pending_done, turns, pipe_site, consumer, thread);
  const uint32_t a_low = ptx::wgmma_desc_low_k_major_sw128(ptx::smem_addr(s.a[0]) + consumer * kRowsPerConsumer * 128);
  const uint32_t b_low = ptx::wgmma_desc_low_k_major_sw128(ptx::smem_addr(s.b[0]));
  // This thread's 32 columns' scales: 16-byte groups lane % 4 + 4 i (column_scale_slot); chunk j of the
  // fragment holds columns 8 j + 2 (lane % 4) + {0, 1} (store_tile).
  const uint32_t a_scale = ptx::smem_addr(&s.a_scale[0][row]),
                 b_scale = ptx::smem_addr(&s.b_scale[0][column_scale_slot(2 * (lane % 4))]);
  float part[64];
  for (int kb = 0; kb < k_blocks; ++kb) {
    mbarrier_wait_bounded(&s.full[stage], phase, pipe_site, WaitTarget::kStageFull, stage);
    const uint32_t a_at = a_scale + stage * sizeof(s.a_scale[0]), b_at = b_scale + stage * sizeof(s.b_scale[0]);
    const float a_lo = ptx::ld_shared_f32(a_at), a_hi = ptx::ld_shared_f32(a_at + 8 * sizeof(float));
    float4 b[8];  // columns of chunks 2 i and 2 i + 1
#pragma unroll
    for (int i = 0; i < 8; ++i) b[i] = ptx::ld_shared_v4_f32(b_at + 4 * i * sizeof(float4));
    issue_fp8_slice(s, part, a_low, b_low, stage, turns, consumer);
    ptx::wgmma_wait_group<0>();
    ptx::fence_registers(part);
    ptx::mbarrier_arrive(&s.empty[stage]);  // every thread read the stage's scales
    if (kb == kDoneLagSlices && thread == 0) release_done(pending_done);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float columns[4] = {b[i].x, b[i].y, b[i].z, b[i].w};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float* const out = acc + 8 * i + 4 * half;
        const float* const in = part + 8 * i + 4 * half;
        out[0] = fmaf(in[0], a_lo * columns[2 * half], out[0]);
        out[1] = fmaf(in[1], a_lo * columns[2 * half + 1], out[1]);
        out[2] = fmaf(in[2], a_hi * columns[2 * half], out[2]);
        out[3] = fmaf(in[3], a_hi * columns[2 * half + 1], out[3]);
      }
    }
    if (++stage == Fp8ColumnScaleStages::kStages) stage = 0, phase ^= 1;
  }
}

template <TileKind kKind, class Tiles, class Storage>
__device__ void run_consumer(Storage& s, const Tiles& tiles, const WaitSite& pipe_site, int consumer) {
  constexpr int kTileN = StagesOf<kKind>::kTileN;
  const int thread = threadIdx.x % 128;
  float acc[kTileN / 2];
  uint32_t stage = 0, phase = 0, slot = 0, slot_phase = 0, store_slot = 0;
  IssueTurns turns;                  // E4M3 only
  uint32_t* pending_done = nullptr;  // thread 0: the last tile's counter, its stores still in flight
  for (;;) {
    if (thread == 0 && pending_done != nullptr && !ptx::mbarrier_test_wait(&s.tile_full[slot], slot_phase))
      release_done(pending_done);
    const TileInfo tile = take_tile(s, slot, slot_phase, pipe_site);
    if (!tile.valid) break;
    if constexpr (requires { tiles.finish_elementwise(tile, consumer, thread); }) {
      if (tile.gemm == kElementwiseTile) {
        // Its inputs may include the previous tile's stores: no lag for that tile's release.
        if (thread == 0) release_done(pending_done);
        const timeline::Stamp started = timeline::now();
        for (int slice = 0; slice < tile.k_blocks; ++slice) {
          mbarrier_wait_bounded(&s.full[stage], phase, pipe_site, WaitTarget::kStageFull, stage);
          tiles.run_elementwise(tile, slice, s.a[stage], s.b[stage], consumer, thread);
          // Every thread read the stage: each frees it for itself (free_stage).
          ptx::mbarrier_arrive(&s.empty[stage]);
          if (++stage == Storage::kStages) stage = 0, phase ^= 1;
        }
        ptx::named_barrier_sync(kConsumersBarrier, kConsumerThreads);
        tiles.finish_elementwise(tile, consumer, thread);
        if (thread == 0)
          timeline::record(tiles.timeline(), TimelineSpan::kElementwise, started, tile.gemm, tile.m_block,
                           tile.n_block);
        continue;
      }
    }
    const GemmOperands& op = tiles.operands(tile.gemm);

    constexpr bool kForward = kKind == TileKind::kForward || kKind == TileKind::kForwardFp8;
    const bool padding = tile.rows <= consumer * kRowsPerConsumer;  // this consumer's 64 rows hold no route
    const bool weight_grad = is_weight_grad_tile(kKind, tile.gemm);
    const timeline::Stamp started = timeline::now();
    if constexpr (kKind == TileKind::kForwardFp8) {
      run_fp8_mainloop(s, acc, tile.k_blocks, padding, stage, phase, pending_done, turns, pipe_site, consumer, thread);
    } else if constexpr (kKind == TileKind::kWeightGradFp8) {
      run_fp8_column_scale_mainloop(s, acc, tile.k_blocks, padding, stage, phase, pending_done, turns, pipe_site,
                                    consumer, thread);
    } else if constexpr (kKind == TileKind::kBackward) {
      run_mainloop<true, true, true>(s, acc, tile.k_blocks, padding, stage, phase, pending_done, pipe_site, consumer,
                                     thread, weight_grad);
    } else {
      constexpr bool kTransA = kKind == TileKind::kWeightGrad, kTransB = kKind != TileKind::kForward;
      run_mainloop<kTransA, kTransB>(s, acc, tile.k_blocks, padding, stage, phase, pending_done, pipe_site, consumer,
                                     thread);
    }
    if (thread == 0) release_done(pending_done);  // a tile of at most kDoneLagSlices K slices
    const timeline::Stamp multiplied = timeline::now();
    if (thread == 0)
      timeline::record(tiles.timeline(), TimelineSpan::kMainloop, started, tile.gemm, tile.m_block, tile.n_block);

    const bool swiglu = kForward && op.epilogue == Epilogue::kSwiGLU;
    const StoreTarget to{op.c, op.row_scale, tile.c_row, tile.n_block * (swiglu ? kTileN / 2 : kTileN), tile.c_expert};
    if constexpr (kForward) {
      // Padding rows are left unwritten: nothing reads them (GroupedGemmArgs::expert_rows).
      if (!padding && swiglu) {
        store_tile<Epilogue::kSwiGLU>(acc, s, to, false, store_slot, consumer, thread);
        if (op.keep != nullptr)
          store_tile<Epilogue::kStore>(acc, s, {op.keep, nullptr, tile.keep_row, tile.n_block * kTileN, 0}, false,
                                       store_slot, consumer, thread);
      } else if (!padding) {
        store_tile<Epilogue::kStore>(acc, s, to, false, store_slot, consumer, thread);
      }
    } else if (!weight_grad) {  // data gradients
      if (!padding) store_tile<Epilogue::kStore>(acc, s, to, false, store_slot, consumer, thread);
    } else {
      // An expert without rows stores zeros; its accumulators hold stale values. Selecting in the store
      // rather than clearing them first keeps ptxas from spilling (measured: ~3 KB).
      const bool empty = tile.k_blocks == 0;
      if (op.epilogue == Epilogue::kAddF32)
        store_tile<Epilogue::kAddF32, true>(acc, s, to, empty, store_slot, consumer, thread);
      else if (op.epilogue == Epilogue::kStoreF32)
        store_tile<Epilogue::kStoreF32, true>(acc, s, to, empty, store_slot, consumer, thread);
      else
        store_tile<Epilogue::kStore, true>(acc, s, to, empty, store_slot, consumer, thread);
    }
    if (thread == 0) {
      timeline::record(tiles.timeline(), TimelineSpan::kEpilogue, multiplied, tile.gemm, tile.m_block, tile.n_block);
      if (op.done != nullptr) pending_done = op.done + tile.m_block;
    }
  }
  if constexpr (is_fp8(kKind)) turns.finish(consumer);
  if (thread == 0) {
    release_done(pending_done);
    ptx::bulk_wait_group<0>();  // stores must finish reading shared memory before exit (without counters
                                // release_done waited for nothing)
  }
}

// ---- the CTA ----------------------------------------------------------------------------------------

template <class Tiles>
constexpr RegisterSplit register_split() {
  if constexpr (requires { Tiles::kRegisters; })
    return Tiles::kRegisters;
  else
    return StagesOf<Tiles::kKind>::kScales ? kFp8Registers : kBf16Registers;
}

// Runs the GEMM role of one CTA (all kThreads threads) until the tile source runs dry, then the consumer
// threads (256) call then_consumers(). That follow-up work runs inside the consumers' branch, so ptxas
// compiles it with their registers; code after this call is also reached by the producer warpgroup and
// gets only the producer's.
template <class Tiles, class ThenConsumers>
__device__ void run_gemm_cta(uint8_t* smem_raw, Tiles& tiles, const WaitSite& pipe_site,
                             ThenConsumers&& then_consumers) {
  using Stages = StagesOf<Tiles::kKind>;
  auto& s = shared_storage<Stages>(smem_raw);
  constexpr uint32_t kScaleLoaderLanes = Stages::kScales ? 32 : 0;
  if (threadIdx.x == 0) {
    for (int i = 0; i < s.kStages; ++i) {
      ptx::mbarrier_init(&s.full[i], 1 + kScaleLoaderLanes);
      ptx::mbarrier_init(&s.empty[i], kConsumerThreads);
    }
    for (int i = 0; i < kTileSlots; ++i) {
      ptx::mbarrier_init(&s.tile_full[i], 1);
      ptx::mbarrier_init(&s.tile_empty[i], kConsumerWarps + 1 + (Stages::kScales ? 1 : 0));
    }
    ptx::mbarrier_init(&s.claim, 1);
    ptx::fence_mbarrier_init();
  }
  __syncthreads();

  constexpr RegisterSplit kSplit = register_split<Tiles>();
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kSplit.producer>();
    if (threadIdx.x == 0) {
      for (int g = 0; g < 2; ++g) {
        ptx::prefetch_tensormap(tiles.operands(g).a);
        ptx::prefetch_tensormap(tiles.operands(g).b);
      }
      run_loader(s, tiles, pipe_site);
    } else if (threadIdx.x == kTileFetcherThread) {
      run_tile_fetcher(s, tiles, pipe_site);
    } else if constexpr (Stages::kScales) {
      if (threadIdx.x / 32 == 1) run_scale_loader(s, tiles, pipe_site);
    }
  } else {
    ptx::setmaxnreg_inc<kSplit.consumer>();
    run_consumer<Tiles::kKind>(s, tiles, pipe_site, warpgroup - 1);
    then_consumers();
  }
}

}  // namespace pounce::gemm::pipeline
