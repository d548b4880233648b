"""Routing helpers: the router's top-k (softmax or sigmoid scores, DeepSeek-V3-style group limit) and
per-expert token counts for auxiliary losses. Plain PyTorch on the logits' device."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._lib import Error


def route(
    logits: Tensor,
    topk: int,
    *,
    score: str = "softmax",
    n_groups: Optional[int] = None,
    topk_groups: Optional[int] = None,
    normalize: bool = True,
    bias: Optional[Tensor] = None,
    scale: float = 1.0,
) -> Tuple[Tensor, Tensor]:
    """(topk_ids [T, topk] int32, topk_weights [T, topk] fp32) from router logits [T, E].

    score: "softmax" over the experts (Mixtral, Qwen3-MoE) or "sigmoid" per expert (DeepSeek-V3).
    n_groups, topk_groups: group-limited routing (DeepSeek-V3): the experts form n_groups equal groups,
    a group scores its best expert (softmax) or the sum of its two best (sigmoid), and only the
    topk_groups best groups' experts can be chosen. bias [E]: added to the scores for choosing only
    (DeepSeek-V3's correction bias); the weights use the scores without it. normalize: weights divided
    by their sum (kept as they are when the sum is 0); then multiplied by scale. Experts come in
    descending order of their (biased) score; the weights are differentiable in logits."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise Error(f"pounce.route: logits must be [tokens, experts] floats, got {tuple(logits.shape)} {logits.dtype}")
    T, E = logits.shape
    if not 1 <= topk <= E:
        raise Error(f"pounce.route: topk = {topk} must be in [1, experts = {E}]")
    if score not in ("softmax", "sigmoid"):
        raise Error(f"pounce.route: score = {score!r} must be 'softmax' or 'sigmoid'")
    scores = logits.float().softmax(-1) if score == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if n_groups is not None and n_groups > 1:
        keep = topk_groups or n_groups
        if E % n_groups != 0:
            raise Error(f"pounce.route: n_groups = {n_groups} must divide experts = {E}")
        size = E // n_groups
        if not 1 <= keep <= n_groups:
            raise Error(f"pounce.route: topk_groups = {keep} must be in [1, n_groups = {n_groups}]")
        if topk > keep * size:
            raise Error(f"pounce.route: topk = {topk} exceeds the {keep * size} experts of the {keep} kept groups")
        if score == "sigmoid" and size < 2:
            raise Error("pounce.route: sigmoid groups are scored by their two best experts; groups have one")
        groups = choice.view(T, n_groups, size)
        group_score = groups.amax(-1) if score == "softmax" else groups.topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros(T, n_groups, dtype=torch.bool, device=logits.device)
        kept.scatter_(1, group_score.topk(keep, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(size, dim=1), float("-inf"))
    ids = choice.topk(topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        total = weights.sum(-1, keepdim=True)
        weights = torch.where(total > 0, weights / total, weights)
    return ids.to(torch.int32), weights * scale


def tokens_per_expert(topk_ids: Tensor, experts: int) -> Tensor:
    """Routes per expert, [experts] int64, counted on topk_ids' device (for load-balancing losses)."""
    counts = torch.bincount(topk_ids.reshape(-1), minlength=experts)
    if counts.numel() != experts:
        raise Error(f"pounce.tokens_per_expert: topk_ids has an expert id >= experts = {experts}")
    return counts
