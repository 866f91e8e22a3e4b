"""`deltaboard demo`: the whole system on one machine, in one command.

It starts a board (a subprocess on a local directory), trains a small causal LM with AdamW
(fp32 master weights, bf16 rollout view) and publishes every step; meanwhile 2-3 rollout
nodes (follower + sidecar in this process, each with a reference engine subprocess)
follow the run and serve completions pinned to versions. The live view shows each
version's changed fraction and patch size against the full view, and each node's
version and lag; a summary table closes it. The exit code is non-zero if a node did not
converge to the last version or a pinned request was not served with exactly its version.
It prints where to look meanwhile: the board's dashboard (`/ui`) with the read token to
enter there, and each node's status page; with `--keep` the board and the nodes stay up
after the summary until Ctrl-C.

With `--board URL --token T --nodes 0` it is only the trainer, publishing to an existing
board (what the compose file's demo trainer runs).

The processes it starts (the board, the engines) go with it however it ends: each leads a
process group of its own (so a Ctrl-C at the terminal reaches the demo alone, which stops
them in order, then kills what is left of each group), and each has the kernel send it
SIGTERM when the demo dies, SIGKILL included (`as_child`). SIGTERM stops the demo as Ctrl-C
does, and once it has cleaned up it exits at once (`leave`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import httpx
import typer

if TYPE_CHECKING:  # FastAPI and uvicorn load only when nodes run
    from deltaboard.services.sidecar.background import BackgroundServer
    from deltaboard.services.sidecar.node import Sidecar

RUN = "demo"
PROMPT = [11, 7, 42, 99, 5, 1]
PARENT_ENV = "DELTABOARD_DEMO_PARENT"
"""The demo's pid, in the environment of each process it starts (`as_child`)."""
PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def deltaboard_command(*args: str) -> list[str]:
    """This installation's CLI, run by this interpreter (no reliance on PATH), in a process
    that goes when the demo goes (`as_child`)."""
    code = (
        "from deltaboard.services.demo import as_child; as_child(); "
        "from deltaboard.services.cli import main; main()"
    )
    return [sys.executable, "-c", code, *args]


def as_child() -> None:
    """In a process the demo started: have the kernel send it SIGTERM when the demo dies,
    whatever kills it (a SIGKILL leaves the demo no chance to stop anything), and exit at
    once if the demo died before that was set. Set here, in the child's own first line,
    rather than in a `preexec_fn`, which is unsafe in a process with threads, as the demo
    is. The signal follows the thread that started the child: the demo starts its
    children from its main thread, which lasts as long as it does."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(parent):
        sys.exit("the demo that started this process has gone")


def wait_healthy(url: str, process: subprocess.Popen[bytes], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not answer {url} within {timeout_s}s")


class Processes:
    """Child processes, each the leader of a process group of its own, with nothing of the
    demo's but its environment: no stdin, its output in its log file, no other descriptor
    (a child that held the demo's stdout would keep whoever reads it waiting after the
    demo is gone). `stop` sends each group TERM, in reverse order of start, and KILL to
    whatever of it is left after `STOP_TIMEOUT_S` (or is left by a leader that exited)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.children: list[subprocess.Popen[bytes]] = []

    def start(
        self, name: str, command: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as log:
            child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())},
                process_group=0,
            )
        self.children.append(child)
        return child

    def stop(self) -> None:
        # A leader not reaped yet keeps its group's id from being given to another process,
        # so only those are signalled, and each is reaped only after its group's KILL.
        children = [child for child in reversed(self.children) if child.returncode is None]
        for child in children:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in children:
            while not _exited(child) and time.monotonic() < deadline:
                time.sleep(0.05)
            _signal_group(child, signal.SIGKILL)
            child.wait()


def _exited(child: subprocess.Popen[bytes]) -> bool:
    """Whether `child` has exited, leaving it unreaped."""
    try:
        return os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _signal_group(child: subprocess.Popen[bytes], sig: int) -> None:
    """`sig` to the process group `child` leads (empty once it and its own children are gone)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, sig)


@dataclass
class PinnedResult:
    node: str
    version: int
    status: int
    served: tuple[int | None, int | None] | None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.served == (self.version, self.version)


@dataclass
class VersionStats:
    version: int
    kind: str
    changed_fraction: float
    patch_bytes: int


@dataclass
class DemoState:
    """Everything the live view and the summary show; written by the trainer thread."""

    steps: int
    step: int = 0
    full_bytes: int = 0
    versions: list[VersionStats] = field(default_factory=list)
    pinned: list[PinnedResult] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def head(self) -> int | None:
        return self.versions[-1].version if self.versions else None


@dataclass
class Node:
    id: str
    url: str
    sidecar: Sidecar
    server: BackgroundServer

    def served(self) -> int | None:
        served: int | None = self.sidecar.gate.served
        return served


def pinned_request(node: Node, version: int, state: DemoState, max_tokens: int) -> None:
    """A completion that must be served with exactly `version` (it may wait for it)."""
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 0,
        "weight_version": {"exact": version, "wait": 120},
    }
    served: tuple[int | None, int | None] | None = None
    try:
        response = httpx.post(f"{node.url}/v1/completions", json=body, timeout=180)
        status = response.status_code
        if status == 200:
            stamp = response.json().get("weight_version") or {}
            served = (stamp.get("start"), stamp.get("end"))
    except httpx.HTTPError:
        status = 0
    with state.lock:
        state.pinned.append(PinnedResult(node.id, version, status, served))


def render(state: DemoState, nodes: list[Node]) -> Any:
    from rich.console import Group
    from rich.table import Table

    last = state.versions[-1] if state.versions else None
    trainer = Table(title="trainer -> board", expand=False)
    for column in ("step", "version", "kind", "changed", "patch", "full view", "patch/full"):
        trainer.add_column(column, justify="right")
    if last is not None:
        trainer.add_row(
            f"{state.step}/{state.steps}",
            str(last.version),
            last.kind,
            f"{100 * last.changed_fraction:.2f}%",
            f"{last.patch_bytes / 1024:.1f} KiB",
            f"{state.full_bytes / 1024:.1f} KiB",
            f"{last.patch_bytes / max(state.full_bytes, 1):.3f}",
        )
    fleet = Table(title="rollout nodes", expand=False)
    for column in ("node", "version", "lag", "pinned ok"):
        fleet.add_column(column, justify="right")
    with state.lock:
        pinned = list(state.pinned)
    for node in nodes:
        served = node.served()
        lag = "-" if served is None or state.head is None else str(state.head - served)
        mine = [p for p in pinned if p.node == node.id]
        fleet.add_row(
            node.id, "-" if served is None else str(served), lag, f"{sum(p.ok for p in mine)}/{len(mine)}"
        )
    return Group(trainer, fleet) if nodes else trainer


def start_board(processes: Processes, workdir: Path) -> tuple[str, str, str]:
    """A board subprocess on a local directory: (url, publish token, read token)."""
    port = free_port()
    publish, read = f"publish-{secrets.token_hex(8)}", f"read-{secrets.token_hex(8)}"
    env = {
        "DELTABOARD_DATA_DIR": str(workdir / "board"),
        "DELTABOARD_PORT": str(port),
        "DELTABOARD_HOST": "127.0.0.1",
        "DELTABOARD_TOKENS": f"publish:{publish},read:{read}",
    }
    url = f"http://127.0.0.1:{port}"
    wait_healthy(
        f"{url}/healthz", processes.start("board", deltaboard_command("board", "serve"), env), "board"
    )
    return url, publish, read


def start_nodes(
    processes: Processes, workdir: Path, count: int, board_url: str, token: str, mode: str
) -> list[Node]:
    """Engines first (subprocesses, loading torch in parallel), then their sidecars."""
    from deltaboard.services.sidecar.background import BackgroundServer
    from deltaboard.services.sidecar.node import Sidecar, SidecarConfig

    engines = []
    for i in range(count):
        port = free_port()
        model = workdir / f"node-{i}"
        command = deltaboard_command("engine", "--model", str(model), "--port", str(port), "--name", RUN)
        engines.append((f"http://127.0.0.1:{port}", processes.start(f"engine-{i}", command)))
    nodes = []
    for i, (engine_url, process) in enumerate(engines):
        wait_healthy(f"{engine_url}/health", process, f"engine {i}")
        config = SidecarConfig(
            board_url=board_url,
            run=RUN,
            directory=workdir / f"node-{i}",
            engine_url=engine_url,
            mode="in_place" if mode == "in_place" else "quiesce",
            token=token,
            node_id=f"node-{i}",
            poll_s=2.0,
        )
        sidecar = Sidecar(config)
        server = BackgroundServer(sidecar.app).start()
        nodes.append(Node(f"node-{i}", server.url, sidecar, server))
    return nodes


@dataclass(frozen=True)
class TrainerSettings:
    lr: float
    warmup_steps: int
    max_tokens: int
    delay_s: float


def train_and_publish(
    state: DemoState, board_url: str, token: str, nodes: list[Node], settings: TrainerSettings
) -> None:
    from deltaboard.publisher.publisher import Publisher
    from deltaboard.services.trajectory import build_model, train

    model = build_model("tiny", seed=0)
    config: Any = model.config
    assets = {"config.json": config.to_json_string().encode()}
    pending: list[threading.Thread] = []
    with Publisher(board_url, RUN, token=token, assets=assets) as publisher:
        first = publisher.next_version

        def publish(step: int) -> None:
            version = first + len(state.versions)
            if nodes:  # pin before publishing: the node holds at this version for the request
                node = nodes[version % len(nodes)]
                thread = threading.Thread(
                    target=pinned_request, args=(node, version, state, settings.max_tokens), daemon=True
                )
                thread.start()
                pending.append(thread)
            result = publisher.publish(model, step=step).result()
            if not state.full_bytes:
                state.full_bytes = publisher.client.manifest(RUN, result.version).stats.view_bytes
            fraction = result.changed_elements / max(result.total_elements, 1)
            stats = VersionStats(result.version, result.kind, fraction, result.encoded_bytes)
            with state.lock:
                state.versions.append(stats)
                state.step = step

        # train() yields 0 first (the initial view: the keyframe), then after every step
        steps = train(
            model, steps=state.steps, lr=settings.lr, regime="fp32-master", warmup_steps=settings.warmup_steps
        )
        for step in steps:
            publish(step)
            time.sleep(settings.delay_s)
    for thread in pending:
        thread.join()


def await_convergence(nodes: list[Node], head: int | None, timeout_s: float) -> dict[str, bool]:
    """Whether each node reached `head`, both in its sidecar and in its engine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(n.served() != head for n in nodes):
        time.sleep(0.1)
    return {node.id: node.served() == head and engine_version(node) == head for node in nodes}


def engine_version(node: Node) -> int | None:
    """The version the node's engine itself says it serves (None if it cannot say)."""
    try:
        version: int | None = httpx.get(f"{node.sidecar.config.engine_url}/health", timeout=5).json()[
            "weight_version"
        ]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return version


def summary(
    state: DemoState, nodes: list[Node], converged: dict[str, bool], seconds: float
) -> dict[str, Any]:
    deltas = [v for v in state.versions if v.kind == "delta"]
    return {
        "versions": len(state.versions),
        "seconds": round(seconds, 2),
        "full_bytes": state.full_bytes,
        "mean_patch_bytes": sum(v.patch_bytes for v in deltas) / len(deltas) if deltas else 0.0,
        "mean_changed_fraction": sum(v.changed_fraction for v in deltas) / len(deltas) if deltas else 0.0,
        "nodes": [{"id": n.id, "version": n.served(), "converged": converged[n.id]} for n in nodes],
        "pinned_requests": len(state.pinned),
        "pinned_mismatches": sum(not p.ok for p in state.pinned),
    }


def succeeded(report: dict[str, Any]) -> bool:
    """The demo's verdict: every node converged and every pinned request got its version."""
    return all(n["converged"] for n in report["nodes"]) and report["pinned_mismatches"] == 0


def summary_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="deltaboard demo: summary")
    table.add_column("what")
    table.add_column("value", justify="right")
    full, patch = report["full_bytes"], report["mean_patch_bytes"]
    table.add_row("versions published", str(report["versions"]))
    table.add_row("full view", f"{full / 1024:.1f} KiB")
    table.add_row("mean patch", f"{patch / 1024:.1f} KiB ({patch / max(full, 1):.4f} of full)")
    table.add_row("mean changed per step", f"{100 * report['mean_changed_fraction']:.2f}%")
    for node in report["nodes"]:
        table.add_row(
            node["id"], f"version {node['version']} ({'converged' if node['converged'] else 'BEHIND'})"
        )
    table.add_row(
        "pinned requests", f"{report['pinned_requests']} ({report['pinned_mismatches']} mismatched)"
    )
    table.add_row("seconds", f"{report['seconds']:.1f}")
    return table


@contextlib.contextmanager
def logs_to_file(path: Path) -> Iterator[None]:
    """Send deltaboard's log records to `path` instead of over the live view."""
    logger = logging.getLogger("deltaboard")
    handler = logging.FileHandler(path)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        handler.close()


def addresses(board_url: str, read_token: str | None, nodes: list[Node]) -> list[str]:
    """Where to look while the demo runs: the board's dashboard with the read token to enter
    there (when the demo made it), and each node's status page."""
    lines = [f"dashboard: {board_url}/ui"]
    if read_token is not None:
        lines.append(f"read token to enter there: {read_token}")
    lines += [f"{node.id} status page: {node.url}/ui" for node in nodes]
    return lines


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def leave(code: int) -> NoReturn:
    """Exit with `code` now that the demo has stopped what it started: without the
    interpreter's own teardown (the modules of torch and numba, the joins of thread pools
    at exit), which takes seconds on a quiet machine and much longer on a busy one, while
    Ctrl-C should give the prompt back at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def keep_up(console: Any, lines: list[str]) -> None:
    """`--keep`: the board and the nodes stay up for a look at the pages, until Ctrl-C (a
    Ctrl-C as soon as the last line shows included).

    A clean-clone run's demo ignored its SIGINT for the 60 s the test waited, asleep here.
    Python's own handler is installed again first: a library loaded on the way may have
    replaced it at the C level, where `signal.getsignal` does not see it. The wait is in
    short sleeps: the kernel may hand a Ctrl-C to any of the process's threads, and Python
    raises it in the main thread only once that thread runs again (short sleeps alone did
    not cure the failure; which library replaced the handler was not found)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(KeyboardInterrupt):
        for line in [*lines, "keeping the board and the nodes up; Ctrl-C stops them"]:
            console.print(line, highlight=False, soft_wrap=True)
        while True:
            time.sleep(0.5)


def demo(
    steps: int = typer.Option(30, help="AdamW steps to train (one version each)"),
    nodes: int = typer.Option(3, min=0, max=8, help="rollout nodes (follower + sidecar + engine)"),
    lr: float = typer.Option(1e-6, help="learning rate (RL post-training uses 1e-6..3e-6)"),
    warmup: int = typer.Option(
        10, min=0, help="unpublished steps first, so Adam's moments are warm as a policy entering RL has them"
    ),
    mode: str = typer.Option("quiesce", help="sidecar commit mode: quiesce or in_place"),
    max_tokens: int = typer.Option(4, min=1, help="tokens per pinned completion"),
    step_delay: float = typer.Option(
        0.0, min=0.0, help="seconds between steps (pace a long-running trainer)"
    ),
    board: str | None = typer.Option(
        None,
        envvar="DELTABOARD_URL",
        help="publish to this board instead of starting one (default: start one)",
        show_default=False,
    ),
    token: str | None = typer.Option(
        None,
        envvar="DELTABOARD_TOKEN",
        help="publish token for --board (default: none)",
        show_default=False,
    ),
    workdir: Path | None = typer.Option(
        None,
        help="keep board data, node directories and logs here (default: a temporary directory)",
        show_default=False,
    ),
    json_path: Path | None = typer.Option(
        None, "--json", help="write the summary as JSON (default: no)", show_default=False
    ),
    keep: bool = typer.Option(
        False, "--keep", help="keep the board and the nodes up after the demo, until Ctrl-C"
    ),
) -> None:
    """Train, publish, follow and serve pinned completions end to end on embedded defaults."""
    from rich.console import Console
    from rich.live import Live

    if mode not in ("quiesce", "in_place"):
        raise typer.BadParameter("--mode must be quiesce or in_place")
    console = Console()
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupt)  # stopped as Ctrl-C stops it
    try:
        with contextlib.ExitStack() as stack:
            root = workdir or Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="deltaboard-demo-"))
            )
            (root / "logs").mkdir(parents=True, exist_ok=True)
            # Said before anything slow (starting processes, loading torch), so that the
            # person who typed the command sees at once what it does and where its logs go.
            where = "a board" if board is None else f"the board at {board}"
            console.print(
                f"deltaboard demo: {where}, {nodes} rollout node(s) and a trainer of {steps} steps; "
                f"logs in {root / 'logs'}",
                highlight=False,
            )
            stack.enter_context(logs_to_file(root / "logs" / "nodes.log"))
            processes = Processes(root / "logs")
            stack.callback(processes.stop)
            shown_token: str | None = None  # a token the demo made; one passed in is not printed
            if board is None:
                board, token, read_token = start_board(processes, root)
                shown_token = read_token
                console.print(f"board on {board}", highlight=False)
            else:
                read_token = token or ""
            if nodes:
                console.print(f"starting {nodes} engine(s) and sidecar(s) (each engine loads torch)")
            fleet = start_nodes(processes, root, nodes, board, read_token, mode)
            for line in addresses(board, shown_token, fleet):
                console.print(line, highlight=False, soft_wrap=True)
            console.print("training; each step is published as a new version")
            for node in fleet:
                stack.callback(node.server.stop)
            state = DemoState(steps)
            with Live(get_renderable=lambda: render(state, fleet), console=console, refresh_per_second=4):
                settings = TrainerSettings(lr, warmup, max_tokens, step_delay)
                train_and_publish(state, board, token or "", fleet, settings)
                converged = await_convergence(fleet, state.head, timeout_s=60)
            report = summary(state, fleet, converged, time.monotonic() - started)
            console.print()
            console.print(summary_table(report))
            if json_path is not None:
                json_path.write_text(json.dumps(report, indent=2))
            if keep:
                keep_up(console, addresses(board, shown_token, fleet))
    except KeyboardInterrupt:  # the children are stopped: what is left is the exit
        console.print("interrupted", highlight=False)
        leave(130)
    if not succeeded(report):
        console.print("[red]FAILED[/red]: a node did not converge or a pinned request got another version")
        leave(1)
    leave(0)
