"""The publisher with real transformers models (random init from a config, nothing
downloaded): tied weights, the config's dtype, assets taken from the model or from
sub-folders, and the directory a follower materializes loading with `from_pretrained`."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.clients.follower import Follower
from deltaboard.publisher.assets import asset_files
from deltaboard.publisher.examples.torch_loop import tiny_model
from deltaboard.publisher.publisher import Publisher
from deltaboard.publisher.view import rollout_view


def train_step(model: Any, seed: int = 0) -> None:
    """One AdamW step at a large learning rate: every tensor's view changes, the tied
    embedding included."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def follow(board: Any, run: str, directory: Path) -> Path:
    with Follower(board.client(board.read_token), run, directory, node_id="node") as follower:
        follower.sync()
        return Path(follower.model_dir)


def load(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory)  # no dtype=: the config's


def logits(model: Any) -> torch.Tensor:
    tokens = torch.arange(32).reshape(2, 16) * 7 % model.config.vocab_size
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=tokens).logits
    return out


def assert_serves_view(directory: Path, trainer: Any) -> None:
    """`from_pretrained(directory)` computes bit for bit what the trainer's bf16 view does."""
    loaded = load(directory)
    reference = copy.deepcopy(loaded)
    reference.load_state_dict(rollout_view(trainer.state_dict(), ViewSpec()), strict=True)
    assert torch.equal(logits(loaded), logits(reference))


def test_tied_weights_are_published_once_and_the_directory_loads(board, tmp_path):
    model = tiny_model(tied=True)
    client, reader = board.client(board.publish_token), board.client(board.read_token)
    results = {}
    with Publisher(client, "tied") as once, Publisher(client, "copies", assets={}) as twice:
        for step in range(2):
            if step:
                train_step(model)
            copies = {name: t.clone() for name, t in model.state_dict().items()}  # no shared storage
            results[step] = (once.publish(model).result(), twice.publish(copies).result())
    (tied_key, copies_key), (tied, copied) = results[0], results[1]
    assert "lm_head.weight" not in {t.name for t in reader.manifest("tied", 0).tensors}
    head = model.lm_head.weight.numel()
    assert tied_key.total_elements == copies_key.total_elements - head
    # the delta drops exactly the tied copy's patch
    entries = {t.name: t for t in reader.manifest("copies", 1).tensors}
    assert copied.encoded_bytes - tied.encoded_bytes == entries["lm_head.weight"].blob.length > 0
    assert_serves_view(follow(board, "tied", tmp_path / "node"), model)


def test_config_says_the_served_dtype(board, tmp_path):
    model = tiny_model()  # fp32 parameters, served in bf16
    model.save_pretrained(tmp_path / "trainer")  # the assets as the trainer saved them
    assert json.loads((tmp_path / "trainer" / "config.json").read_text())["dtype"] == "float32"
    with Publisher(board.client(board.publish_token), "dtype", assets=tmp_path / "trainer") as pub:
        pub.publish(model).result()
    directory = follow(board, "dtype", tmp_path / "node")
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load(directory)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert_serves_view(directory, model)


def test_assets_come_from_the_model_or_a_state_dict_is_refused(board):
    client, reader = board.client(board.publish_token), board.client(board.read_token)
    model = tiny_model()
    with Publisher(client, "from-model") as pub:
        pub.publish(model).result()
    assert set(reader.get_run("from-model").assets) == {"config.json", "generation_config.json"}
    assert json.loads(reader.get_asset("from-model", "config.json"))["model_type"] == "llama"
    with Publisher(client, "bare") as pub:
        with pytest.raises(ValueError, match=r"no config\.json.*assets=\{\}"):
            pub.publish(model.state_dict())
        pub.publish(model).result()  # the refusal left the publisher as it was
    with Publisher(client, "weights-only", assets={}) as pub:
        assert pub.publish(model.state_dict()).result().version == 0
    assert reader.get_run("weights-only").assets == ()


def test_assets_in_sub_folders_reach_the_follower(board, tmp_path, caplog):
    source = tmp_path / "checkpoint"
    files = {
        "config.json": b'{"model_type": "bert"}',
        "tokenizer.json": b"{}",
        "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
        "modules.json": b"[]",
    }
    skipped = {
        "model.safetensors": b"weights are versions",
        "1_Pooling/model.onnx": b"weights",
        "checkpoint-5/config.json": b"another checkpoint",
        "a/b/deep.json": b"too deep for an asset name",
        ".cache/x.json": b"hidden",
    }
    for name, data in {**files, **skipped}.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(data)
    with caplog.at_level(logging.WARNING):
        assert set(asset_files(source)) == set(files)
    assert "a/b" in caplog.text  # the file left out is named, not dropped in silence
    with Publisher(board.client(board.publish_token), "tree", assets=source) as pub:
        pub.publish({"w": torch.zeros(4)}).result()
    directory = follow(board, "tree", tmp_path / "node")
    for name, data in files.items():
        if name != "config.json":  # rewritten to say the served dtype
            assert (directory / name).read_bytes() == data, name


def test_resized_embeddings_go_out_as_a_keyframe_with_their_config(board, tmp_path):
    model = tiny_model(tied=True)
    with Publisher(board.client(board.publish_token), "resize") as pub:
        pub.publish(model).result()
        model.resize_token_embeddings(320)
        resized = pub.publish(model).result()
        train_step(model)
        after = pub.publish(model).result()
    assert resized.kind == "full"
    assert resized.layout_change is not None
    assert resized.layout_change.reshaped == ("model.embed_tokens.weight",)
    assert after.kind == "delta"
    directory = follow(board, "resize", tmp_path / "node")
    assert json.loads((directory / "config.json").read_text())["vocab_size"] == 320
    assert_serves_view(directory, model)
