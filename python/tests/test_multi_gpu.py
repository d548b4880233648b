"""Expert parallelism over NCCL, one process per GPU (torch.multiprocessing, as torchrun would start
them): every rank's forward and gradients against the eager reference over all ranks' tokens, two
training steps with different routings and token counts, with the forward in BF16 or in E4M3
(fp8_forward: within the FP8 band), and with the weight gradients added to fp32 main grads. A group of
one rank runs on any Hopper GPU (the NCCL path with one peer); more ranks need as many GPUs."""

import os
import tempfile

import pytest
from support import gpu_skip_reason, pounce, random_routing, reference_moe, relative_error, torch

GPUS = min(torch.cuda.device_count(), 4) if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(gpu_skip_reason() is not None, reason=gpu_skip_reason() or "")

T, H, I, E, K = 200, 256, 128, 8, 2


def rank_inputs(rank, step):
    g = torch.Generator().manual_seed(100 + rank + 1000 * step)
    tokens = T + 3 * rank - 7 * step  # ranks and steps with different token counts
    x = torch.randn(tokens, H, generator=g).bfloat16()
    ids, weights = random_routing(tokens, E, K, generator=g)
    return x, ids, weights, torch.randn(tokens, H, generator=g).bfloat16()


def run_rank(rank, ranks, store, options, main_grad):
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=ranks)
    try:
        g = torch.Generator().manual_seed(0)
        w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16()
        w2 = (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()
        mine = slice(rank * E // ranks, (rank + 1) * E // ranks)
        moe = pounce.MoE(H, I, E, K, torch.distributed.group.WORLD, max_tokens=T + 3 * ranks, device="cuda",
                         options=options, main_grad=main_grad)
        tolerance = 0.1 if options.get("fp8_forward") else 1e-2  # E4M3 keeps 3 fraction bits
        gate, up = pounce.split_w13(w13[mine])
        moe.load_experts(gate, up, w2[mine])

        for step in range(2):
            moe.zero_grad(set_to_none=True)
            for w in (moe.w13, moe.w2):
                if getattr(w, "main_grad", None) is not None:
                    w.main_grad.zero_()
            x, ids, weights, dy = (t.cuda() for t in rank_inputs(rank, step))
            x.requires_grad_(), weights.requires_grad_()
            y = moe(x, ids, weights)
            y.backward(dy)
            moe.check_device_errors()

            # The reference: every rank's tokens through every expert, on this GPU.
            ref = [t.float().cuda().requires_grad_() for t in (w13, w2)]
            for r in range(ranks):
                rx, rids, rweights, rdy = (t.cuda() for t in rank_inputs(r, step))
                leaves = [rx.float().requires_grad_(), rweights.float().requires_grad_()]
                want = reference_moe(leaves[0], rids, leaves[1], *ref)
                want.backward(rdy.float())
                if r == rank:
                    assert relative_error(y, want) < tolerance
                    assert relative_error(x.grad, leaves[0].grad) < tolerance
                    assert relative_error(weights.grad, leaves[1].grad) < tolerance
            dw13, dw2 = (w.main_grad if main_grad else w.grad for w in (moe.w13, moe.w2))
            assert not main_grad or (moe.w13.grad is None and dw13.dtype == torch.float32)
            assert relative_error(dw13, ref[0].grad[mine]) < tolerance
            assert relative_error(dw2, ref[1].grad[mine]) < tolerance
        moe.close()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    "options, main_grad",
    [({}, False), ({"fp8_forward": 1}, False), ({}, True)],
    ids=["bf16", "fp8_forward", "bf16_main_grad"],
)
@pytest.mark.parametrize("ranks", sorted({1, 2, max(GPUS, 1)}))
def test_nccl_ranks_match_the_reference(ranks, options, main_grad):
    if ranks > GPUS:
        pytest.skip(f"needs {ranks} GPUs, this machine has {GPUS}")
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        torch.multiprocessing.spawn(run_rank, args=(ranks, store, options, main_grad), nprocs=ranks)
