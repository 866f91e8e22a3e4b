"""The integrations: HF Trainer callback, plain torch loop, `deltaboard publish DIR`."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from deltaboard.publisher.examples.torch_loop import tiny_model, train
from deltaboard.publisher.hf_callback import DeltaboardCallback
from deltaboard.publisher.publisher import Publisher
from tests.publisher.pub_support import assert_same_view, materialize, view_bytes


class CopyTask(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(16) * 7 + i) % 256
        return {"input_ids": ids, "labels": ids}


def test_trainer_callback_publishes_the_start_and_each_optimizer_step(board, tmp_path):
    from transformers import Trainer, TrainingArguments

    model = tiny_model()
    pub = Publisher(board.client(board.publish_token), "hf")  # the model's own config
    callback = DeltaboardCallback(pub, close_at_end=True)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
    )
    Trainer(model=model, args=args, train_dataset=CopyTask(), callbacks=[callback]).train()
    assert callback.failures == 0 and callback.last is not None
    assert callback.last.result().version == 3
    reader = board.client(board.read_token)
    assert [reader.manifest("hf", v).meta["step"] for v in range(4)] == [0, 1, 2, 3]
    assert [reader.manifest("hf", v).kind for v in range(4)] == ["full", "delta", "delta", "delta"]
    assert_same_view(materialize(reader, "hf", 3), view_bytes(model.state_dict()))
    assert json.loads(reader.get_asset("hf", "config.json"))["model_type"] == "llama"


def test_torch_loop_example(board):
    with Publisher(board.client(board.publish_token), "loop") as pub:
        results = [f.result() for f in train(pub, steps=2)]
    assert [(r.version, r.step, r.kind) for r in results] == [
        (0, 0, "full"),
        (1, 1, "delta"),
        (2, 2, "delta"),
    ]
    assert all(r.changed_elements < r.total_elements for r in results[1:])


def test_publish_directory_command(board, tmp_path):
    from deltaboard.services.cli import build_app

    model = tiny_model(seed=3)
    cli = build_app()
    env = {"DELTABOARD_URL": board.url, "DELTABOARD_TOKEN": board.publish_token}
    reader = board.client(board.read_token)
    expected = []
    for v in range(3):
        directory = tmp_path / f"ckpt-{v}"
        model.save_pretrained(directory)
        expected.append(view_bytes(model.state_dict()))
        args = ["publish", str(directory), "--run", "ckpt", "--cache", str(tmp_path / "cache")]
        result = CliRunner().invoke(cli, args, env=env)
        assert result.exit_code == 0, result.output
        assert f"version {v}" in result.output
        with torch.no_grad():  # a sparse step: small-magnitude weights change their bf16 bits
            for p in model.parameters():
                p.add_(p.abs() * 0.005 * torch.sign(torch.randn_like(p)))
    assert [reader.manifest("ckpt", v).kind for v in range(3)] == ["full", "delta", "delta"]
    for v in range(3):
        got = materialize(reader, "ckpt", v)
        assert_same_view(got, {k: expected[v][k] for k in got})
    assert "config.json" in reader.get_run("ckpt").assets
