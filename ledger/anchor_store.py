"""Where signed ledger checkpoints live: outside Postgres, append-only.

The interface is small on purpose (append, latest, list, read) so that an object store with
retention locks (S3 Object Lock, GCS bucket lock) can stand in for the directory. A store never
overwrites: appending a number that exists raises :class:`CheckpointExists`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Protocol

from proofline.errors import CheckpointExists, CheckpointInvalid
from proofline.settings import Settings

NAME = re.compile(r"^(\d{12})\.json$")


class AnchorStore(Protocol):
    #: Where the checkpoints are (for messages).
    location: str

    def append(self, number: int, data: bytes) -> None:
        """Store checkpoint ``number`` durably, or raise CheckpointExists; never replace one."""

    def list(self) -> list[int]:
        """Every stored checkpoint number, ascending."""

    def read(self, number: int) -> bytes:
        """The stored bytes of one checkpoint (CheckpointInvalid when it is not there)."""

    def latest(self) -> tuple[int, bytes] | None:
        """The highest-numbered checkpoint, or None for an empty store."""


class DirectoryStore:
    """One file per checkpoint, ``<number:012d>.json``, in a directory per ledger.

    A checkpoint is written to a private temporary file (O_EXCL, fsync) and then hard-linked to its
    final name: ``link`` fails if the name exists, so a file is never replaced, and readers never see
    a partial file under a checkpoint's name.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.location = str(self.directory)

    @staticmethod
    def _name(number: int) -> str:
        return f"{number:012d}.json"

    def append(self, number: int, data: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o750)
        final = self.directory / self._name(number)
        temp = self.directory / f".{self._name(number)}.{os.getpid()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o440)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temp, final)
            except FileExistsError:
                raise CheckpointExists(f"checkpoint {number} already exists in {self.location}",
                                       number=number) from None
        finally:
            temp.unlink(missing_ok=True)
        # The new directory entry must survive a crash too.
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def list(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := NAME.match(p.name)))

    def read(self, number: int) -> bytes:
        try:
            return (self.directory / self._name(number)).read_bytes()
        except OSError as exc:
            raise CheckpointInvalid(f"checkpoint {number} cannot be read: {exc}", number=number) from None

    def latest(self) -> tuple[int, bytes] | None:
        numbers = self.list()
        return (numbers[-1], self.read(numbers[-1])) if numbers else None


def checkpoint_root(settings: Settings) -> Path:
    return Path(settings.checkpoint_dir) if settings.checkpoint_dir is not None else Path(settings.state_dir) / "checkpoints"


def store_for(settings: Settings, ledger: str) -> AnchorStore:
    """The store of one ledger (a Postgres database): one checkpoint directory may serve several."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", ledger) or ledger.startswith("."):
        raise CheckpointInvalid(f"ledger name {ledger!r} cannot name a checkpoint directory")
    return DirectoryStore(checkpoint_root(settings) / ledger)
