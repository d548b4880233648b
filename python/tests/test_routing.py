"""pounce.route and pounce.tokens_per_expert against straightforward per-token references, and the
w13 layout helpers against reference::w13_row. CPU only."""

import math

import pytest
from support import pounce, torch


def reference_route(logits, topk, score, n_groups, topk_groups, normalize, bias, scale):
    """One token at a time, in plain Python (src/reference/router.cpp's rules)."""
    ids, weights = [], []
    for row in logits.double().tolist():
        E = len(row)
        if score == "softmax":
            top = max(row)
            exp = [math.exp(v - top) for v in row]
            scores = [v / sum(exp) for v in exp]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        choice = [s + (bias[e] if bias is not None else 0.0) for e, s in enumerate(scores)]
        candidates = list(range(E))
        if n_groups:
            size = E // n_groups
            group_score = []
            for g in range(n_groups):
                members = sorted(choice[g * size : (g + 1) * size], reverse=True)
                group_score.append(members[0] if score == "softmax" else members[0] + members[1])
            kept = sorted(range(n_groups), key=lambda g: -group_score[g])[:topk_groups]
            candidates = [g * size + j for g in kept for j in range(size)]
        chosen = sorted(candidates, key=lambda e: -choice[e])[:topk]
        w = [scores[e] for e in chosen]
        if normalize:
            w = [v / sum(w) for v in w]
        ids.append(chosen)
        weights.append([v * scale for v in w])
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(weights, dtype=torch.float32)


CASES = [
    dict(score="softmax", topk=2, experts=8),  # Mixtral
    dict(score="softmax", topk=8, experts=128, normalize=True),  # Qwen3-MoE
    dict(score="softmax", topk=6, experts=64, normalize=False),
    dict(score="sigmoid", topk=8, experts=256, n_groups=8, topk_groups=4, bias=True, scale=2.5),  # DeepSeek-V3
    dict(score="sigmoid", topk=4, experts=32, n_groups=4, topk_groups=1),
    dict(score="softmax", topk=3, experts=16, n_groups=4, topk_groups=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_route_matches_the_reference(case):
    g = torch.Generator().manual_seed(7)
    E, k = case["experts"], case["topk"]
    logits = torch.randn(64, E, generator=g) * 3
    bias = torch.randn(E, generator=g) * 0.1 if case.get("bias") else None
    args = dict(
        score=case["score"],
        n_groups=case.get("n_groups"),
        topk_groups=case.get("topk_groups"),
        normalize=case.get("normalize", True),
        scale=case.get("scale", 1.0),
    )
    ids, weights = pounce.route(logits, k, bias=bias, **args)
    want_ids, want_weights = reference_route(logits, k, bias=None if bias is None else bias.tolist(), **args)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


def test_route_weights_are_differentiable_and_zero_sums_stay_zero():
    logits = torch.randn(4, 8, requires_grad=True)
    _, weights = pounce.route(logits, 2, normalize=False)
    weights.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    # Every sigmoid score underflows to 0: weights 0, not NaN.
    _, weights = pounce.route(torch.full((2, 8), -1e4), 2, score="sigmoid")
    assert torch.equal(weights, torch.zeros(2, 2))


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(topk=9), "topk = 9 must be in [1, experts = 8]"),
        (dict(topk=2, score="relu"), "score = 'relu'"),
        (dict(topk=2, n_groups=3), "n_groups = 3 must divide experts = 8"),
        (dict(topk=2, n_groups=4, topk_groups=5), "topk_groups = 5 must be in [1, n_groups = 4]"),
        (dict(topk=5, n_groups=4, topk_groups=2), "topk = 5 exceeds the 4 experts of the 2 kept groups"),
        (dict(topk=1, n_groups=8, score="sigmoid"), "two best experts"),
    ],
)
def test_route_names_bad_arguments(kwargs, needle):
    with pytest.raises(pounce.Error, match=None) as raised:
        pounce.route(torch.randn(3, 8), **kwargs)
    assert needle in str(raised.value)


def test_tokens_per_expert_counts_routes():
    ids = torch.tensor([[0, 3], [3, 1], [0, 3]], dtype=torch.int32)
    assert pounce.tokens_per_expert(ids, 5).tolist() == [2, 1, 0, 3, 0]
    with pytest.raises(pounce.Error, match="expert id >= experts = 3"):
        pounce.tokens_per_expert(ids, 3)


def w13_row(i, is_up):  # reference::w13_row
    return (i // 8) * 16 + (8 if is_up else 0) + i % 8


def test_interleave_w13_follows_reference_w13_row():
    E, I, H = 3, 24, 5
    gate, up = torch.randn(E, I, H), torch.randn(E, I, H)
    w13 = pounce.interleave_w13(gate, up)
    assert w13.shape == (E, 2 * I, H)
    for i in range(I):
        assert torch.equal(w13[:, w13_row(i, False)], gate[:, i])
        assert torch.equal(w13[:, w13_row(i, True)], up[:, i])
    back_gate, back_up = pounce.split_w13(w13)
    assert torch.equal(back_gate, gate) and torch.equal(back_up, up)
