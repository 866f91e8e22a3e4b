"""An FP8 block-scaled view along a chain, through a real board, to a follower's directory.

The codec sees F8_E4M3 weights and F32 scales as any other dtype: after every version the
follower's files hold the trainer's FP8 view bit for bit, safetensors reads every
tensor, the config says how to load it, and dequantizing what the directory holds by the
documented rule gives what the plain reference quantizer gives for the trainer's master.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors import safe_open

from deltaboard.board.contract.view_spec import fp8_view
from deltaboard.clients.follower import Follower
from deltaboard.publisher.publisher import Publisher
from deltaboard.publisher.quantize import dequantize_fp8_block
from tests.clients.support import CONFIG, assert_view, states, view_of
from tests.publisher.test_quantize import reference

SIZES = {
    "model.embed_tokens.weight": (64, 40),
    "model.layers.0.self_attn.q_proj.weight": (130, 140),  # ragged in both dimensions
    "model.layers.0.self_attn.q_proj.bias": (192,),
    "model.layers.0.mlp.down_proj.weight": (40, 300),
    "model.norm.weight": (40,),
    "lm_head.weight": (64, 40),
}
QUANTIZED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight")


def test_a_follower_materializes_an_fp8_chain_bit_exact(board, tmp_path):
    spec = fp8_view("amax")
    node = tmp_path / "node"
    kinds = []
    changed = []
    first: dict[str, np.ndarray] = {}
    last: dict[str, np.ndarray] = {}
    with (
        Publisher(
            board.client(board.publish_token),
            "fp8",
            keyframe_every=3,
            spec=spec,
            assets={"config.json": json.dumps(CONFIG).encode()},
        ) as pub,
        Follower(board.client(board.read_token), "fp8", node, node_id="n") as follower,
    ):
        for version, state in enumerate(states(SIZES, 6)):
            published = pub.publish(state).result()
            kinds.append(published.kind)
            changed.append(published.changed_elements)
            assert follower.sync() == version
            want = view_of(state, spec)
            assert_view(node, want)
            first = first if version else want
            last = want
            with safe_open(str(node / "model.safetensors"), framework="pt") as f:
                got = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
            for name in QUANTIZED:
                assert got[name].dtype == torch.float8_e4m3fn
                assert got[name + "_scale_inv"].dtype == torch.float32
                codes, scales = reference(state[name].numpy(), "amax")
                assert np.array_equal(got[name].view(torch.uint8).numpy(), codes)
                values = dequantize_fp8_block(got[name], got[name + "_scale_inv"])
                assert torch.equal(
                    values,
                    dequantize_fp8_block(
                        torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(scales)
                    ),
                )
            assert got["lm_head.weight"].dtype == torch.bfloat16
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta"]
    assert all(c > 0 for c, k in zip(changed, kinds, strict=True) if k == "delta")
    assert not all(np.array_equal(first[n], last[n]) for n in QUANTIZED)  # FP8 values did move
    config = json.loads((node / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
