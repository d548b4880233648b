"""pounce: a fused Mixture-of-Experts layer for NVIDIA Hopper GPUs, for PyTorch.

    moe = pounce.MoE(hidden, intermediate, experts, topk, group).cuda()
    topk_ids, topk_weights = pounce.route(router_logits, topk)
    y = moe(x, topk_ids, topk_weights)

The forward is pounce's fused kernel (libpounce.so, through its C ABI), and so is the backward (on one
GPU, and across GPUs from the rows its forward kept; otherwise PyTorch's). See MoE, moe, route and
tokens_per_expert; to_mxfp8 and from_mxfp8 convert MXFP8 at the layer's boundary.
"""

import os

# pounce never uses NVLink multicast (it can take shared machines down): off for NCCL, PyTorch symmetric
# memory and NVSHMEM, before this process creates any communicator.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

from ._layer import Layer  # noqa: E402
from ._lib import Error  # noqa: E402
from .module import MoE, interleave_w13, moe, split_w13  # noqa: E402
from .mxfp8 import from_mxfp8, to_mxfp8  # noqa: E402
from .routing import route, tokens_per_expert  # noqa: E402

__all__ = [
    "Error", "Layer", "MoE", "from_mxfp8", "interleave_w13", "moe", "route", "split_w13", "to_mxfp8",
    "tokens_per_expert",
]
