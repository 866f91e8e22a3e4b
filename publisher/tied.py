"""Tied weights travel once: what a publish reads from a model is its state dict without
the copies that loading rebuilds.

A causal LM whose output head is tied to its input embeddings (`tie_word_embeddings`)
lists one matrix under two names (`model.embed_tokens.weight` and `lm_head.weight`), two
views of one storage. Publishing both would ship the matrix twice in every keyframe and
every delta. `save_pretrained` writes one name per storage: of the names sharing a
tensor it drops those the model declares tied (`_tied_weights_keys` of each submodule,
regular expressions relative to it), and `from_pretrained` rebuilds them because the
config says `tie_word_embeddings`. The publisher keeps the same names, so the directory
a follower materializes is the one `save_pretrained` would write, and loads the same way.

A name is dropped only when it is the very same tensor as another (same device, address,
dtype, shape and strides), the model declares it tied, and the config does not say
`tie_word_embeddings=False` (the loader would then not rebuild it). A plain state dict
declares nothing, so all of its names are published.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping

import torch

ModelOrState = torch.nn.Module | Mapping[str, torch.Tensor]


def state_of(obj: ModelOrState) -> Mapping[str, torch.Tensor]:
    """The tensors a publish reads: a model's state dict without its tied copies, or the
    given state dict as it is."""
    if not isinstance(obj, torch.nn.Module):
        return obj
    state = obj.state_dict()
    copies = tied_copies(obj, state)
    return {name: t for name, t in state.items() if name not in copies} if copies else state


def tied_copies(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> set[str]:
    """The names of `state` that `save_pretrained` would leave out as tied copies."""
    if getattr(getattr(model, "config", None), "tie_word_embeddings", True) is False:
        return set()
    same: defaultdict[tuple[object, ...], list[str]] = defaultdict(list)
    for name, t in state.items():
        if t.numel():
            same[(t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())].append(name)
    groups = [names for names in same.values() if len(names) > 1]
    if not groups:
        return set()
    declared = [re.compile(p) for p in declared_ties(model)]
    copies: set[str] = set()
    for names in groups:
        tied = [n for n in sorted(names) if any(p.search(n) for p in declared)]
        copies.update(tied[: len(names) - 1])  # one name of every storage stays
    return copies


def declared_ties(model: torch.nn.Module) -> list[str]:
    """The patterns of the names each submodule declares tied, prefixed with its path
    (`_tied_weights_keys`: a list of names in transformers 4, a {copy: source} mapping in 5;
    iterating either gives the copies)."""
    patterns: list[str] = []
    for prefix, module in model.named_modules():
        for key in getattr(module, "_tied_weights_keys", None) or ():
            patterns.append(f"{prefix}.{key}" if prefix else str(key))
    return patterns
