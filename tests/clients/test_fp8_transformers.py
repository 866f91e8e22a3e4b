"""A follower's FP8 directory loads where Hugging Face fine-grained FP8 checkpoints load.

A tiny Llama with random weights is published as an FP8 block-scaled view through a real
board and a follower materializes it. Then transformers' own fine-grained FP8 support
reads the directory: on any machine with `dequantize=True` (what transformers does on a
machine without a suitable GPU), and on a GPU natively, keeping the linear weights as FP8
with their block scales, bit for bit what the follower wrote. Either way greedy
generation runs and its logits follow the bf16 model that dequantizing the same bytes by
the documented rule gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from safetensors import safe_open

from deltaboard.board.contract.view_spec import fp8_view
from deltaboard.clients.follower import Follower
from deltaboard.publisher.assets import model_assets
from deltaboard.publisher.publisher import Publisher
from deltaboard.publisher.quantize import dequantize_fp8_block
from tests.services.fakes.tiny_model import tiny_config

if TYPE_CHECKING:
    from tests.conftest import BoardPool

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
PROMPT = list(range(3, 19))


def _tiny_llama() -> torch.nn.Module:
    # whole 128x128 blocks (ragged ones are test_fp8_view's): the GPU path of transformers wants them
    config = tiny_config(vocab_size=1024, hidden_size=256, intermediate_size=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.LlamaForCausalLM(config).float().eval()
    return model


@pytest.fixture(scope="module")
def fp8_directory(
    board_pool: BoardPool, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module]:
    """The follower's directory at version 1 (a delta's result) and the master model."""
    board = board_pool.take()
    master = _tiny_llama()
    node = tmp_path_factory.mktemp("fp8") / "node"
    try:
        with (
            Publisher(
                board.client(board.publish_token),
                "fp8-hf",
                spec=fp8_view("amax"),
                assets=model_assets(master),
            ) as pub,
            Follower(board.client(board.read_token), "fp8-hf", node, node_id="hf") as follower,
        ):
            pub.publish(master.state_dict()).result()
            with torch.no_grad():  # one RL-sized step
                for p in master.parameters():
                    p.add_(p.abs() * 3e-3 * torch.randn_like(p).sign())
            assert pub.publish(master.state_dict()).result().kind == "delta"
            assert follower.sync() == 1
    finally:
        board.stop()
    return node, master


def _files(node: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(node / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _reference(node: Path, master: torch.nn.Module, device: str) -> Any:
    """The bf16 model of the directory's bytes, dequantized by the documented rule."""
    files = _files(node)
    plain = {
        name: dequantize_fp8_block(t, files[name + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
        for name, t in files.items()
        if not name.endswith("_scale_inv")
    }
    model = transformers.LlamaForCausalLM(master.config).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(
        {k: v.to(torch.bfloat16) for k, v in plain.items()}, strict=False
    )
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model.to(device).eval()


def _generates_like(model: Any, reference: Any, device: str) -> float:
    prompt = torch.tensor([PROMPT], device=device)
    with torch.no_grad():
        got = model(prompt).logits.float()
        want = reference(prompt).logits.float()
        out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.isfinite(got).all()
    assert out.shape == (1, len(PROMPT) + 8)
    cosine = float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0))
    assert cosine > 0.98, cosine
    return cosine


def test_transformers_dequantizes_the_directory_and_generates(fp8_directory):
    node, master = fp8_directory
    files = _files(node)
    assert files[Q_PROJ].dtype == torch.float8_e4m3fn and files["lm_head.weight"].dtype == torch.bfloat16
    config = transformers.FineGrainedFP8Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(node, quantization_config=config)
    weight = dict(model.named_parameters())[Q_PROJ]
    assert weight.dtype == torch.bfloat16
    want = dequantize_fp8_block(files[Q_PROJ], files[Q_PROJ + "_scale_inv"])
    assert torch.allclose(weight.float(), want, rtol=1e-2, atol=0)  # bf16 arithmetic inside
    _generates_like(model, _reference(node, master, "cpu"), "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="native FP8 needs a GPU")
def test_transformers_loads_the_directory_as_fp8_on_the_gpu(fp8_directory):
    node, master = fp8_directory
    files = _files(node)
    model = transformers.AutoModelForCausalLM.from_pretrained(node, device_map="cuda")
    loaded = dict(model.named_parameters()) | dict(model.named_buffers())
    for name in (Q_PROJ, Q_PROJ + "_scale_inv"):
        assert loaded[name].dtype == files[name].dtype, name
        assert torch.equal(loaded[name].cpu().view(torch.uint8), files[name].view(torch.uint8)), name
    reference = _reference(node, master, "cuda")
    try:
        cosine = _generates_like(model, reference, "cuda")
        print(f"native FP8 matmuls: logits cosine {cosine:.4f}")
    except ImportError as missing:  # the FP8 matmul comes from the Hub's kernels: offline, none
        config = transformers.FineGrainedFP8Config(dequantize=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            node, device_map="cuda", quantization_config=config
        )
        cosine = _generates_like(model, reference, "cuda")
        print(f"FP8 weights bit-exact; no FP8 matmul kernel ({missing}); dequantized: cosine {cosine:.4f}")
