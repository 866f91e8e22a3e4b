"""Token logprobs computed directly from a model, the way the reference engine must match."""

from __future__ import annotations

from typing import Any


def direct_logprobs(model: Any, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Logprob of each completion token given everything before it, one forward pass per token."""
    import torch

    ids, out = list(prompt_ids), []
    with torch.inference_mode():
        for token in completion_ids:
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            out.append(float(torch.log_softmax(logits, dim=-1)[token]))
            ids.append(token)
    return out
