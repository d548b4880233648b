// Row mover of the communication CTAs: one thread streams pieces of rows global -> shared -> global with
// bulk copies (TMA without tensor maps), many pieces in flight. Sources and destinations may be on peer
// GPUs (NVLink load/store addresses) or local.
//
// Pieces go through kSlots shared-memory slots in order: piece p loads into slot p % kSlots, and is
// stored once it has landed. A slot is refilled only after the store that read it has finished reading
// (bulk_wait_group_read), keeping up to kSlots - kStoreLag - 1 loads in flight.
#pragma once

#include "common/bounded_wait.cuh"
#include "ptx/ptx.cuh"

namespace pounce::moe {

class CopyEngine {
 public:
  static constexpr int kSlots = 12;
  static constexpr uint32_t kPieceBytes = 16384;
  static constexpr int kStoreLag = 2;  // stores allowed to still read shared memory when a slot is refilled

  struct Shared {
    alignas(128) uint8_t data[kSlots][kPieceBytes];
    uint8_t* dst[kSlots];
    uint32_t bytes[kSlots];
    uint64_t landed[kSlots];
  };

  // Constructed by every thread of the CTA (a CTA-wide barrier follows before any copy); only one
  // thread then calls copy() and flush().
  __device__ CopyEngine(Shared& s, const WaitSite& site) : s_(s), site_(site) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < kSlots; ++i) ptx::mbarrier_init(&s_.landed[i], 1);
      ptx::fence_mbarrier_init();
    }
  }

  // Copies `bytes` (a multiple of 16; 16-byte aligned addresses) from src to dst.
  __device__ void copy(const void* src, void* dst, uint32_t bytes) {
    for (uint32_t done = 0; done < bytes; done += kPieceBytes) {
      const uint32_t piece = bytes - done < kPieceBytes ? bytes - done : kPieceBytes;
      load_piece(static_cast<const uint8_t*>(src) + done, static_cast<uint8_t*>(dst) + done, piece);
    }
  }

  // Every copy issued so far has landed at its destination (writes complete). Orders those async-proxy
  // writes before the caller's following generic-proxy release.
  __device__ void flush() {
    while (stored_ < issued_) store_oldest();
    ptx::bulk_wait_group<0>();
    ptx::fence_proxy_async_global();
  }

  // After the last flush(), on the copying thread: the slots' barriers end, so the CTA may give the
  // engine's shared memory another use (after a CTA barrier).
  __device__ void retire() {
    for (int i = 0; i < kSlots; ++i) ptx::mbarrier_inval(&s_.landed[i]);
  }

 private:
  __device__ void load_piece(const uint8_t* src, uint8_t* dst, uint32_t bytes) {
    const int slot = int(issued_ % kSlots);
    if (issued_ >= uint32_t(kSlots)) {
      // The slot last held piece issued_ - kSlots: it must be stored, and that store must be done reading.
      while (stored_ < issued_ - kSlots + 1 + kStoreLag) store_oldest();
      ptx::bulk_wait_group_read<kStoreLag>();
    }
    s_.dst[slot] = dst;
    s_.bytes[slot] = bytes;
    ptx::mbarrier_arrive_expect_tx(&s_.landed[slot], bytes);
    ptx::bulk_load(s_.data[slot], src, bytes, &s_.landed[slot]);
    ++issued_;
  }

  __device__ void store_oldest() {
    const int slot = int(stored_ % kSlots);
    const uint32_t parity = (stored_ / kSlots) & 1;
    mbarrier_wait_bounded(&s_.landed[slot], parity, site_, WaitTarget::kCopyLanded, slot);
    ptx::bulk_store(s_.dst[slot], s_.data[slot], s_.bytes[slot]);
    ptx::bulk_commit_group();
    ++stored_;
  }

  Shared& s_;
  WaitSite site_;
  uint32_t issued_ = 0, stored_ = 0;
};

}  // namespace pounce::moe
