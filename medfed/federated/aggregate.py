"""Server-side averaging shared by every strategy that averages vectors."""

from __future__ import annotations

import torch


def weighted_average(vectors: list[torch.Tensor], weights: list[float] | torch.Tensor) -> torch.Tensor:
    """Sample-weighted mean of equally shaped vectors.

    Args:
        vectors: K tensors of shape ``(d,)``.
        weights: K non-negative weights (e.g. training-set sizes), not all zero.

    Returns:
        ``sum_k w_k v_k / sum_k w_k``, shape ``(d,)``, dtype of the vectors,
        summed in place one vector after another (no (K, d) stack: the
        replies are already K model-sized vectors in memory).
    """
    if not vectors:
        raise ValueError("weighted_average needs at least one vector")
    w = torch.as_tensor(weights, dtype=torch.float64, device="cpu").flatten()  # a few numbers, read on the host
    if w.numel() != len(vectors) or bool((w < 0).any()) or float(w.sum()) <= 0:
        raise ValueError(f"weights must be {len(vectors)} non-negative numbers with a positive sum, got {w.tolist()}")
    total = torch.zeros_like(vectors[0])
    for share, vector in zip((w / w.sum()).tolist(), vectors):
        total.add_(vector, alpha=share)
    return total
