"""A command-line process whose output a test reads line by line as it comes, so that the
test acts on what the process says it is doing (a phase starting, a service listening)
instead of on a delay tuned to one machine's speed."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path


class Watched:
    """A process started with stdout and stderr merged into one stream of lines."""

    def __init__(self, args: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.args = list(args)
        self.process = subprocess.Popen(
            self.args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, wanted: Callable[[str], bool], timeout_s: float = 120.0) -> str | None:
        """The first line for which `wanted` holds, as soon as it is printed; None if the
        process ended without printing one."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if wanted(line):
                        return line
                seen = len(self.lines)
                if not self._reader.is_alive():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.args}: no such line within {timeout_s} s:\n{self.output()}")
                self._changed.wait(left)

    def wait_until(self, ready: Callable[[], bool], what: str, timeout_s: float = 240.0) -> None:
        """Poll `ready` (a service answering) while the process lives."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            code = self.process.poll()
            assert code is None, f"{what} exited with {code}:\n{self.output()}"
            assert time.monotonic() < deadline, f"{what} did not come up:\n{self.output()}"
            time.sleep(0.05)

    def finish(self, timeout_s: float = 120.0) -> int:
        """Wait for the end of the process and of its output; its exit status."""
        code = self.process.wait(timeout_s)
        self._reader.join(timeout_s)
        return code

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send `sig` and wait; a process that does not stop is killed and the test fails."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.finish(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"{self.args} did not stop on {sig.name}:\n{self.output()}") from None
