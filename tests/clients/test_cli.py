"""`deltaboard pull`, `follow`, `verify` and `publish` as processes, configured by environment:
what they print, how they fail, and how they stop."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Callable

import torch
from safetensors.torch import save_file
from typer.main import get_command

from deltaboard.board.server.records import manifest_json
from deltaboard.clients.follower.verify import served
from deltaboard.services.bench.link import LinkProcess
from deltaboard.services.cli import build_app
from tests.clients.support import assert_view, publish_states
from tests.support.processes import Watched
from tests.support.servers import VENV_BIN

SIZES = {"a.weight": (128, 64), "b.weight": (64,)}
CLI = [str(VENV_BIN / "deltaboard")]
INTERRUPTED = "interrupted; run the same command again to resume"


def environment(url: str, token: str | None = None) -> dict[str, str]:
    env = {"DELTABOARD_URL": url, "PATH": str(VENV_BIN)}
    return env if token is None else {**env, "DELTABOARD_TOKEN": token}


def starts_with(prefix: str) -> Callable[[str], bool]:
    return lambda line: line.startswith(prefix)


def one_red_line(args: list[str], env: dict[str, str]) -> str:
    """Run a command that must fail as a user's mistake: exit status 1, one line on stderr
    saying what is wrong, no traceback anywhere; returns the line."""
    done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=120)
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), done
    assert "Traceback" not in done.stdout + done.stderr
    return lines[0]


def test_pull_follow_verify_say_what_they_did(board, tmp_path):
    client = board.client(board.publish_token)
    views = publish_states(client, "cli", SIZES, 2)
    env = environment(board.url, board.read_token)
    d = tmp_path / "node"
    pulled = subprocess.run(
        [*CLI, "pull", "--run", "cli", "--dir", str(d), "--version", "0"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert pulled.returncode == 0, pulled.stderr
    assert_view(d, views[0])
    out = pulled.stdout
    # every phase named, in its own unit, with its total known from the start
    assert "downloading " in out and "applying 2 tensors" in out and "copying the served slot 1 slot" in out
    assert re.search(r"applying\s.*\b2/2 tensors", out), out
    assert "?" not in out and "None" not in out
    assert re.search(r"cli: nothing yet -> version 0 in \S+ \(done in \d+\.\d\d s\)", out), out

    follow = Watched([*CLI, "follow", "--run", "cli", "--to", str(d)], env=env)  # --to: the old name
    assert follow.wait_for_line(lambda line: "serving version 1" in line) is not None
    assert_view(d, views[1])
    line = one_red_line(["pull", "--run", "cli", "--dir", str(d)], env)  # while `follow` holds it
    assert "another follower process holds" in line and "sidecar" in line and "stop it" in line
    assert follow.stop(signal.SIGTERM) == 0
    assert "following cli into" in follow.output() and "(serving version 0)" in follow.output()
    assert "stopped" in follow.output()

    checked = subprocess.run([*CLI, "verify", "--dir", str(d)], env=env, capture_output=True, text=True)
    assert checked.returncode == 0 and "ok: 2 tensors" in checked.stdout, checked
    assert re.search(r"hashing cli@1\s.*\b16\.5/16\.5 kB", checked.stdout), checked.stdout


def test_publish_names_its_phases_and_times_the_whole_command(board, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "test"}))
    env = environment(board.url, board.publish_token)
    weights = torch.randn(256, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    for version in (0, 1):
        save_file({"w": weights}, str(checkpoint / "model.safetensors"))
        done = subprocess.run(
            [*CLI, "publish", "--dir", str(checkpoint), "--run", "pub", "--cache", str(tmp_path / "cache")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert re.search(rf"pub version {version} \((full|delta)\): .* \(done in \d+\.\d\d s\)", done.stdout)
        assert "publishing" in done.stdout and "?" not in done.stdout
        weights = weights * 1.01
    # the second publish first brought the cache to version 0: a phase of its own, named
    assert "cache of pub: downloading" in done.stdout and "cache of pub: applying 1 tensor" in done.stdout


def test_mistakes_are_one_red_line(board, tmp_path):
    publish_states(board.client(board.publish_token), "cli", SIZES, 1)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    save_file({"w": torch.zeros(4, 4)}, str(checkpoint / "model.safetensors"))
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    publish = ["publish", "--run", "cli", "--cache", str(tmp_path / "cache")]

    line = one_red_line([*publish, "--dir", str(checkpoint)], environment(board.url))
    assert "refused the token" in line and "--token" in line
    line = one_red_line([*publish, "--dir", str(checkpoint)], environment(board.url, "not-a-token-of-it"))
    assert "refused the token (unknown token)" in line
    line = one_red_line([*publish, "--dir", str(checkpoint)], environment(board.url, board.read_token))
    assert "token lacks scope 'publish'" in line and "None" not in line
    line = one_red_line([*publish, "--dir", str(empty)], environment(board.url, board.publish_token))
    assert "holds no *.safetensors file" in line

    reader = environment(board.url, board.read_token)
    line = one_red_line(["pull", "--run", "cli", "--dir", str(a_file)], reader)
    assert "is a file" in line
    line = one_red_line(["pull", "--run", "nope", "--dir", str(tmp_path / "x")], reader)
    assert line.startswith("error: UnknownRun")
    down = environment("http://127.0.0.1:9", board.read_token)  # nothing listens on the discard port
    line = one_red_line(["pull", "--run", "cli", "--dir", str(tmp_path / "y")], down)
    assert "cannot reach http://127.0.0.1:9" in line

    mistake = ["pull", "--run", "cli", "--dir", str(a_file)]
    debug = subprocess.run([*CLI, "--debug", *mistake], env=reader, capture_output=True, text=True)
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    debug = subprocess.run(
        [*CLI, *mistake], env={**reader, "DELTABOARD_DEBUG": "1"}, capture_output=True, text=True
    )
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr


def test_a_manifest_no_follower_can_use_is_one_red_line(board, tmp_path):
    """A manifest stored by an older, laxer board (edited in the store here): a negative
    shape, an unknown dtype."""
    publish_states(board.client(board.publish_token), "neg", SIZES, 1)
    publish_states(board.client(board.publish_token), "dtype", SIZES, 1)
    board.stop()
    for run, field, value in (("neg", "shape", [-128, -64]), ("dtype", "dtype", "Q7")):
        path = board.data_dir / "store" / "runs" / run / "manifests" / f"{0:012d}.json"
        manifest = json.loads(manifest_json(path.read_bytes()))
        manifest["tensors"][field][0] = value  # format 2: one column per field
        path.write_text(json.dumps(manifest))
    board.start()
    reader = environment(board.url, board.read_token)
    line = one_red_line(["pull", "--run", "neg", "--dir", str(tmp_path / "a")], reader)
    assert "negative" in line
    line = one_red_line(["pull", "--run", "dtype", "--dir", str(tmp_path / "b")], reader)
    assert "Q7" in line


def test_ctrl_c_stops_a_pull_at_once_and_the_same_command_resumes(board, tmp_path):
    """Interrupted in the download, then in the apply: each time the process is gone
    within a second, says how to go on, and the next run finishes the job bit for bit.
    The board is reached through an emulated 50 Mbit/s link, so that the download of the
    view outlasts the second by far whatever this machine's speed."""
    sizes = {f"layers.{i}.weight": (1024, 1024) for i in range(6)}  # 12 MiB of bf16 view
    views = publish_states(board.client(board.publish_token), "big", sizes, 1)
    d = tmp_path / "node"
    with LinkProcess("127.0.0.1", board.port, 0.05) as link:
        pull = [*CLI, "pull", "--run", "big", "--dir", str(d)]
        env = environment(link.url, board.read_token)
        for phase in ("downloading", "applying"):
            running = Watched(pull, env=env)
            assert running.wait_for_line(starts_with(phase)) is not None
            sent = time.monotonic()
            assert running.stop(signal.SIGINT) == 130, running.output()
            assert time.monotonic() - sent < 1.0
            assert INTERRUPTED in running.output() and "Traceback" not in running.output()
            assert not (d / "current").exists()  # nothing served yet: it did not run on to the end
        # the resumed download counted what the first run had left: it ended at its total
        counted = re.search(r"downloading\s.*?([\d.]+)/([\d.]+) [kMG]?B", running.output())
        assert counted is not None and counted[1] == counted[2], running.output()
        finished = subprocess.run(pull, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert served(d).version == 0
    assert_view(d, views[0])


def test_every_command_follows_the_conventions():
    """`--version`; `--dir` for the checkpoint directory; every option explained, with its
    default; DELTABOARD_URL and DELTABOARD_TOKEN wherever a board is reached; bracketed
    words in help text shown as written."""
    version = subprocess.run([*CLI, "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and re.fullmatch(r"deltaboard \d+\.\d+\.\d+\S*\n", version.stdout)
    app = get_command(build_app())
    commands = app.commands  # type: ignore[attr-defined]
    for name in ("publish", "verify", "pull", "follow", "engine", "sidecar"):
        assert "--dir" in [o for p in commands[name].params for o in p.opts], name
    for name in ("publish", "verify", "pull", "follow", "sidecar", "demo"):
        envvars = {o: p.envvar for p in commands[name].params for o in p.opts}
        assert envvars["--board"] == "DELTABOARD_URL" and envvars["--token"] == "DELTABOARD_TOKEN", name
    groups = [commands, commands["board"].commands, commands["bench"].commands]
    for command in (c for group in groups for c in group.values() if c.name not in ("board", "bench")):
        for param in command.params:
            if param.param_type_name != "option" or param.hidden or param.name == "help":
                continue
            assert param.help, f"{command.name} {param.opts}"
            said = "(default:" in param.help or param.help.endswith("[required]")
            shown = param.default is not None and param.show_default is not False
            assert param.required or said or shown, f"{command.name} {param.opts}: no default shown"
    help_text = subprocess.run([*CLI, "board", "serve", "--help"], capture_output=True, text=True).stdout
    assert "(default: warning)" in " ".join(help_text.split())
    help_text = subprocess.run([*CLI, "pull", "--help"], capture_output=True, text=True).stdout
    assert "(created if absent). [required]" in " ".join(help_text.split())  # rich markup ate "[required]"
