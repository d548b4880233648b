// pounce::FusedMoe, the public face of moe::FusedLayer.
#include "pounce/fused_moe.h"

#include "moe/fused_layer.h"

namespace pounce {

FusedMoe::FusedMoe(const EpConfig& config, const FusedMoeOptions& options)
    : layer_(std::make_unique<moe::FusedLayer>(config, options)) {}

FusedMoe::FusedMoe(const EpConfig& config, ncclComm* comm, const FusedMoeOptions& options)
    : layer_(std::make_unique<moe::FusedLayer>(config, comm, options)) {}

FusedMoe::~FusedMoe() = default;
FusedMoe::FusedMoe(FusedMoe&&) noexcept = default;
FusedMoe& FusedMoe::operator=(FusedMoe&&) noexcept = default;

void FusedMoe::set_weights(std::span<const ExpertWeights> ranks) { layer_->set_weights(ranks); }
void FusedMoe::forward(std::span<const RankIO> ranks, cudaStream_t stream, bool keep_for_backward) {
  layer_->forward(ranks, stream, keep_for_backward);
}
void FusedMoe::backward(std::span<const RankIO> forward_inputs, std::span<const RankGrads> grads, WeightGradOutput mode,
                        cudaStream_t stream) {
  layer_->backward(forward_inputs, grads, mode, stream);
}
void FusedMoe::refresh_fp8_weights(cudaStream_t stream) { layer_->refresh_fp8_weights(stream); }
void FusedMoe::check_device_errors() { layer_->check_device_errors(); }

const EpConfig& FusedMoe::config() const { return layer_->config(); }
int FusedMoe::ranks_on_this_gpu() const { return layer_->ranks_on_this_gpu(); }
int FusedMoe::ctas_per_rank() const { return layer_->ctas_per_rank(); }
int FusedMoe::comm_ctas() const { return layer_->comm_ctas(); }
int FusedMoe::engine_rows() const { return layer_->engine_rows(); }
int64_t FusedMoe::minibatch_rows() const { return layer_->minibatch_rows(); }
int64_t FusedMoe::backward_minibatch_rows() const { return layer_->backward_minibatch_rows(); }
int64_t FusedMoe::ring_blocks() const { return layer_->ring_blocks(); }
bool FusedMoe::in_place() const { return layer_->in_place(); }
int64_t FusedMoe::max_m_blocks() const { return layer_->max_m_blocks(); }
int64_t FusedMoe::device_bytes() const { return layer_->device_bytes(); }
int64_t FusedMoe::shared_device_bytes() const { return layer_->shared_device_bytes(); }
const void* FusedMoe::shared_buffers_id() const { return layer_->shared_buffers_id(); }
bool FusedMoe::last_backward_replayed() const { return layer_->last_backward_replayed(); }
void FusedMoe::start_timeline(int64_t max_events) { layer_->start_timeline(max_events); }
std::string FusedMoe::stop_timeline() { return layer_->stop_timeline(); }

}  // namespace pounce
