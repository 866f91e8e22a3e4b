"""Two slots and a `current` link: how readers never see a mix of two versions.

A follower directory looks like this::

    DIR/
      current -> .deltaboard/slots/A      the served version (a symlink, flipped by rename)
      config.json -> current/config.json  one link per top-level entry of the served slot,
      model.safetensors -> current/...    so that from_pretrained(DIR) loads it
      .deltaboard/
        slots/A/  slots/B/                two complete Hugging Face checkpoints
        journal.json  lock  cache/

A new version is written into the *other* slot (staging) while the current one is
served untouched; it becomes current by `rename(2)` of a fresh symlink over `current`,
which is atomic. After the follower's commit hook returns, the slot that was served is
brought to the new version too (the same changes written again, or a copy), so that it
can stage the next one. Engines integrated through the commit hook reload inside the
hook, while nothing else changes, and never see a mix. A reader outside the hook must
resolve `current` once (`os.path.realpath`) and finish loading before the next version
is committed.

Disk cost: two copies of the view, plus during an update the blobs being applied (a
delta is under 1% of the view per version behind; a keyframe about 0.7x the view).
Steady-state updates write only the changed bytes, into both slots; a full local copy
happens only after a bootstrap, a keyframe-based catch-up, a long catch-up or a crash in
the middle of a write.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import IO

from deltaboard.clients.follower.errors import DirectoryError
from deltaboard.clients.follower.journal import SlotName, fsync_dir

META = ".deltaboard"
CURRENT = "current"
SLOT_NAMES: tuple[SlotName, SlotName] = ("A", "B")


def other(name: SlotName) -> SlotName:
    return "B" if name == "A" else "A"


class Slots:
    """The on-disk structure of one follower directory, and the only code that changes it."""

    def __init__(self, root: Path, *, durable: bool = False) -> None:
        self.root = root
        self.durable = durable
        self.meta = root / META
        self.current_link = root / CURRENT
        self._lock_file: IO[bytes] | None = None

    # ---- ownership -------------------------------------------------------------------

    def open(self) -> None:
        """Create or adopt the directory and take its lock (one follower per directory).

        A directory with other content is refused rather than adopted: the follower would
        otherwise shadow or delete files it does not own.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.meta.exists() and any(self.root.iterdir()):
            raise DirectoryError(f"{self.root} is not empty and is not a deltaboard follower directory")
        for sub in ("slots/A", "slots/B", "cache/blobs", "cache/manifests"):
            (self.meta / sub).mkdir(parents=True, exist_ok=True)
        lock = open(self.meta / "lock", "wb")  # noqa: SIM115 - held for the follower's lifetime
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise DirectoryError(
                f"another follower process holds {self.root} (a `deltaboard follow`, a `pull` or a"
                " sidecar, which runs its own follower): stop it, or give this one another directory"
            ) from None
        self._lock_file = lock

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # ---- paths -----------------------------------------------------------------------

    def slot_dir(self, name: SlotName) -> Path:
        return self.meta / "slots" / name

    @property
    def journal_path(self) -> Path:
        return self.meta / "journal.json"

    @property
    def blob_dir(self) -> Path:
        return self.meta / "cache" / "blobs"

    @property
    def manifest_dir(self) -> Path:
        return self.meta / "cache" / "manifests"

    def current(self) -> SlotName | None:
        """The served slot, read from the link itself (the one source of truth for it)."""
        try:
            target = os.readlink(self.current_link)
        except FileNotFoundError:
            return None
        name = Path(target).name
        if name not in SLOT_NAMES:
            raise DirectoryError(f"{self.current_link} points to {target!r}, not to a slot")
        return "A" if name == "A" else "B"

    # ---- mutations -------------------------------------------------------------------

    def reset(self, name: SlotName) -> None:
        """Empty a slot (never the current one)."""
        self._refuse_current(name)
        path = self.slot_dir(name)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)

    def copy(self, src: SlotName, dst: SlotName) -> None:
        """Make `dst` a byte copy of `src` (copy_file_range/sendfile under shutil)."""
        self.reset(dst)
        shutil.copytree(self.slot_dir(src), self.slot_dir(dst), dirs_exist_ok=True)

    def fsync(self, name: SlotName) -> None:
        """Flush every file of a slot to disk (writes made through mappings included)."""
        for path in self.slot_dir(name).rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(self.slot_dir(name))

    def swap(self, name: SlotName) -> None:
        """Make `name` current: a new symlink renamed over `current` (atomic), then the
        top-level links refreshed for entries the new slot has and the old one had not."""
        tmp = self.root / f".{CURRENT}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(Path(META) / "slots" / name)
        os.replace(tmp, self.current_link)
        if self.durable:
            fsync_dir(self.root)
        self.refresh_links()

    def refresh_links(self) -> None:
        """Link each top-level entry of the served slot from the root, and drop links to
        entries it no longer has (also run at start-up, for a kill right after a swap)."""
        name = self.current()
        if name is None:
            return
        served = {p.name for p in self.slot_dir(name).iterdir()}
        for entry in served:
            link = self.root / entry
            if not link.is_symlink() and not link.exists():
                link.symlink_to(Path(CURRENT) / entry)
        for link in self.root.iterdir():
            target = os.readlink(link) if link.is_symlink() else ""
            if target.startswith(CURRENT + os.sep) and Path(target).name not in served:
                link.unlink()

    def _refuse_current(self, name: SlotName) -> None:
        if self.current() == name:
            raise AssertionError(f"refusing to modify the served slot {name}")
