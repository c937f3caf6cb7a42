"""``proofline init``: a deployment folder from nothing, ready for ``proofline dev`` and for real services.

The folder holds everything a deployment reads, with the permissions each part needs:

- ``keys/``: one 0700 folder per private key (controller, recovery, ledger, seal, the auditor's
  X25519 key, and the approver key of whoever ran init), each key 0600; ``keys/keyring.json`` and
  ``keys/auditor.pub`` (0644) are what every process reads;
- ``servers.yaml`` and ``contracts/`` (one commented contract, ``pins.json`` of its server's tools);
- ``authority.yaml`` (the template's action type in ``propose``) and ``authority.json`` (it,
  signed with the approver key);
- ``.env`` (shared settings), ``worker.env``, ``recovery.env``, ``controller.env`` and ``auditor.env``
  (what only those processes, or the auditor, hold);
- ``systemd/`` (worker, recovery, beat, console, exporter) and ``compose.yaml`` (the same five);
- ``var/`` (0700): the state the processes write (``proofline dev`` keeps its Postgres here too).

The texts of these files live in ``proofline/scaffold_files.py``.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from proofline import scaffold_files as texts
from proofline.auditor_keys import PRIVATE_FILE as AUDITOR_KEY
from proofline.auditor_keys import PUBLIC_FILE as AUDITOR_PUB
from proofline.authority import read_policy_yaml, sign_policy
from proofline.errors import InitFolderNotEmpty, NotADeploymentFolder
from proofline.keys import FILES, KEYRING_FILE, SEAL_FILE, KeyRole, add_approver, generate, load_signing_key
from proofline.settings import PACKAGED_CONTRACTS_DIR

#: The action type of the contract template, and the one the scaffolded policy names.
TEMPLATE_ACTION_TYPE = "ticket.create"
#: Private folders (keys, state) and private files (keys, the env files that hold passwords).
PRIVATE_DIR, PRIVATE_FILE, PUBLIC_DIR, PUBLIC_FILE = 0o700, 0o600, 0o755, 0o644
#: The systemd units init writes: unit name -> what runs in it.
UNITS = ("worker", "recovery", "beat", "console", "exporter")


@dataclass(frozen=True)
class Layout:
    """Where each file of a deployment folder lives (``root`` is absolute)."""

    root: Path

    @classmethod
    def at(cls, directory: Path) -> Layout:
        return cls(Path(directory).expanduser().resolve())

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    def key_file(self, role: str) -> Path:
        """The private key of ``role`` (controller, recovery, ledger, seal, auditor, approver) in its own folder."""
        name = {**FILES, "seal": SEAL_FILE, "auditor": AUDITOR_KEY, "approver": "approver.key"}[role]
        return self.keys / role / name

    @property
    def keyring(self) -> Path:
        return self.keys / KEYRING_FILE

    @property
    def auditor_public(self) -> Path:
        """The auditor's public key: every worker seals captured evidence to it."""
        return self.keys / AUDITOR_PUB

    @property
    def var(self) -> Path:
        return self.root / "var"

    @property
    def env_file(self) -> Path:
        return self.root / ".env"

    @property
    def servers_file(self) -> Path:
        return self.root / "servers.yaml"

    @property
    def contracts(self) -> Path:
        return self.root / "contracts"

    @property
    def authority_yaml(self) -> Path:
        return self.root / "authority.yaml"

    @property
    def authority_json(self) -> Path:
        return self.root / "authority.json"

    @property
    def proofline(self) -> Path:
        """The ``proofline`` command of the environment init ran in (the units start it by full path)."""
        return Path(sys.executable).parent / "proofline"

    def require(self) -> None:
        """Refuse a folder ``proofline init`` did not make (``dev_not_a_deployment_folder``)."""
        needed = (self.env_file, self.servers_file, self.keyring, self.authority_json, self.key_file("controller"))
        missing = [str(p.relative_to(self.root)) for p in needed if not p.exists()]
        if missing:
            raise NotADeploymentFolder(f"{self.root} is not a deployment folder: it has no {', '.join(missing)} "
                                       "(make one with `proofline init DIR`, then run `proofline dev --dir DIR`)",
                                       folder=str(self.root))


def default_approver() -> str:
    """Who runs init: the approver identity the scaffolded key and policy name by default."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


def init(directory: Path, *, approver: str | None = None, force: bool = False) -> Layout:
    """Write a deployment folder at ``directory``; refuse a non-empty one unless ``force``."""
    layout = Layout.at(directory)
    if layout.root.exists() and not layout.root.is_dir():
        raise InitFolderNotEmpty(f"{layout.root} exists and is not a folder", folder=str(layout.root))
    if layout.root.is_dir() and any(layout.root.iterdir()) and not force:
        raise InitFolderNotEmpty(f"{layout.root} is not empty: nothing was written (pass --force to write the "
                                 "deployment's files over it; its keys are replaced by new ones)",
                                 folder=str(layout.root))
    layout.root.mkdir(parents=True, exist_ok=True)
    _folder(layout.var, PRIVATE_DIR)
    _keys(layout, approver or default_approver())
    _write(layout.servers_file, texts.servers_file(), PUBLIC_FILE)
    _folder(layout.contracts, PUBLIC_DIR)
    _write(layout.contracts / f"{TEMPLATE_ACTION_TYPE}.yaml", texts.contract_template(), PUBLIC_FILE)
    # The template's server is the kit's system of record, whose tools are pinned in the package;
    # a server of your own is pinned with `proofline contracts pin` (docs/tutorial/your-deployment.md).
    shutil.copyfile(PACKAGED_CONTRACTS_DIR / "pins.json", layout.contracts / "pins.json")
    _authority(layout)
    _write(layout.env_file, texts.env_file(layout), PRIVATE_FILE)
    _write(layout.root / "worker.env", texts.worker_env(layout), PRIVATE_FILE)
    _write(layout.root / "recovery.env", texts.recovery_env(layout), PRIVATE_FILE)
    _write(layout.root / "controller.env", texts.controller_env(layout), PRIVATE_FILE)
    _write(layout.root / "auditor.env", texts.auditor_env(layout), PRIVATE_FILE)
    _folder(layout.root / "systemd", PUBLIC_DIR)
    for unit in UNITS:
        _write(layout.root / "systemd" / f"proofline-{unit}.service", texts.systemd_unit(layout, unit), PUBLIC_FILE)
    _write(layout.root / "compose.yaml", texts.compose_file(layout), PUBLIC_FILE)
    return layout


def next_commands(layout: Layout) -> list[str]:
    """The three commands that follow init: run the stack, load its settings, publish and approve."""
    return [f"proofline dev --dir {layout.root}",
            f"set -a; . {layout.var / 'dev.env'}; set +a   # in a second terminal, once dev is up",
            f"proofline approve ACTION_ID --key {layout.key_file('approver')}   # an action of "
            f"{TEMPLATE_ACTION_TYPE} waits as proposed until you do"]


def _keys(layout: Layout, approver: str) -> None:
    """Generate every key into ``keys/`` and move each private one into a 0700 folder of its own:
    a process is given the folders of the keys it may hold, never the others."""
    _folder(layout.keys, PUBLIC_DIR)
    generate(layout.keys, force=True)
    for role in (*FILES, "seal", "auditor"):
        _folder(layout.key_file(role).parent, PRIVATE_DIR)
        os.replace(layout.keys / layout.key_file(role).name, layout.key_file(role))  # keeps its 0600
    _folder(layout.key_file("approver").parent, PRIVATE_DIR)
    layout.key_file("approver").unlink(missing_ok=True)
    add_approver(layout.keyring, layout.key_file("approver"), approver)
    os.chmod(layout.keyring, PUBLIC_FILE)
    os.chmod(layout.auditor_public, PUBLIC_FILE)


def _authority(layout: Layout) -> None:
    """The policy YAML (what a person edits) and its signed JSON (what every process verifies)."""
    _write(layout.authority_yaml, texts.authority_policy(), PUBLIC_FILE)
    policy = read_policy_yaml(layout.authority_yaml)
    signed = sign_policy(policy, load_signing_key(layout.key_file("approver"), KeyRole.approver))
    _write(layout.authority_json, json.dumps(signed, indent=2) + "\n", PUBLIC_FILE)


def _folder(path: Path, mode: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)  # mkdir's mode is masked by the umask; the folder's mode is the point


def _write(path: Path, text: str, mode: int) -> None:
    """Create ``path`` with its final mode from the start (an env file is never briefly world-readable)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, mode)
