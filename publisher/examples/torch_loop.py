"""A plain torch training loop that publishes the policy after every optimizer step.

    python -m deltaboard.publisher.examples.torch_loop --board http://127.0.0.1:8000 --run demo --token T

The loop trains a tiny causal LM (random init from a config: nothing is downloaded) with
AdamW; one `publish` per step costs the loop only the snapshot copy, the rest runs
behind it. Run with `--steps N`; the script prints each committed version.
"""

from __future__ import annotations

import argparse
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from deltaboard.publisher.publisher import Publisher, PublishResult

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


def tiny_model(seed: int = 0, *, tied: bool = False) -> LlamaForCausalLM:
    """`tied`: the output head shares the input embeddings (`tie_word_embeddings`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def train(publisher: Publisher, steps: int, lr: float = 3e-4, seed: int = 0) -> list[Future[PublishResult]]:
    """Train `steps` AdamW steps on a copy task, publishing after each; return the futures."""
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    futures = [publisher.publish(model, step=0)]
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 256, (4, 16), generator=g)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        futures.append(publisher.publish(model, step=step, meta={"loss": loss.item()}))
    return futures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--board", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--token", default=None)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with Publisher(args.board, args.run, token=args.token) as pub:  # assets: the model's config
        for fut in train(pub, args.steps):
            r = fut.result()
            print(
                f"version {r.version} ({r.kind}, step {r.step}): {r.changed_elements} changed, "
                f"{r.encoded_bytes} B, blocked {r.blocked_s * 1e3:.1f} ms"
            )


if __name__ == "__main__":
    main()
