"""A follower's FP8 directory loads in transformers' fine-grained FP8 support and generates
(on a GPU; skipped without one, and without transformers).

A tiny Llama with random weights is published as an FP8 block-scaled view through a real
board; the follower's directory is then loaded by `from_pretrained`, which must keep the
linear weights as FP8 with their block scales (bit for bit what the follower wrote), and
greedy generation must follow the bf16 model that dequantizing the same bytes gives.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from deltaboard.board.contract.view_spec import fp8_view
from deltaboard.clients.follower import Follower
from deltaboard.publisher.assets import model_assets
from deltaboard.publisher.publisher import Publisher
from deltaboard.publisher.quantize import dequantize_fp8_block

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.LlamaForCausalLM(config).float().eval()
    return model


def test_transformers_loads_the_fp8_directory_and_generates(board, tmp_path):
    master = _tiny_llama()
    node = tmp_path / "node"
    with (
        Publisher(
            board.client(board.publish_token),
            "fp8-hf",
            spec=fp8_view("amax"),
            assets=model_assets(master),
        ) as pub,
        Follower(board.client(board.read_token), "fp8-hf", node, node_id="gpu") as follower,
    ):
        pub.publish(master.state_dict()).result()
        with torch.no_grad():  # one RL-sized step, so that the directory is a delta's result
            for p in master.parameters():
                p.add_(p.abs() * 3e-3 * torch.randn_like(p).sign())
        pub.publish(master.state_dict()).result()
        assert follower.sync() == 1

    with safe_open(str(node / "model.safetensors"), framework="pt") as f:
        files = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert files[Q_PROJ].dtype == torch.float8_e4m3fn

    fp8 = transformers.AutoModelForCausalLM.from_pretrained(node, device_map="cuda")
    loaded = dict(fp8.named_parameters()) | dict(fp8.named_buffers())
    assert loaded[Q_PROJ].dtype == torch.float8_e4m3fn
    for name in (Q_PROJ, Q_PROJ + "_scale_inv"):
        assert torch.equal(loaded[name].cpu().view(torch.uint8), files[name].view(torch.uint8)), name

    # The same bytes dequantized by the documented rule, in a plain bf16 model.
    plain = {
        name: dequantize_fp8_block(t, files[name + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
        for name, t in files.items()
        if not name.endswith("_scale_inv")
    }
    reference = transformers.LlamaForCausalLM(master.config).to(torch.bfloat16)
    reference.load_state_dict({k: v.to(torch.bfloat16) for k, v in plain.items()}, strict=False)
    reference = reference.cuda().eval()

    prompt = torch.arange(3, 19, device="cuda")[None]
    with torch.no_grad():
        got = fp8(prompt).logits.float()
        want = reference(prompt).logits.float()
        out = fp8.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.isfinite(got).all()
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cosine > 0.98, cosine
    assert out.shape == (1, prompt.shape[1] + 8)
    print(f"fp8 directory: loaded as {type(loaded[Q_PROJ]).__name__} fp8, logits cosine {cosine:.4f}")
