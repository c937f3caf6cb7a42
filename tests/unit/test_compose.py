"""The compose file and the Dockerfile agree with each other and with the product (docker itself
cannot run here): the image installs the built wheel; every Proofline process is told where its
contracts, servers file, state and keys are; those paths exist in the image or are mounted; every
setting named is a real one; the reconciler has its timer and a worker for its queue; every module
a service runs ships in the wheel; every service, volume and secret referred to is declared."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from proofline.settings import ROOT, Settings

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SERVICES: dict[str, dict] = COMPOSE["services"]
#: Services built from this repository's image that run Proofline itself (not a tool server).
PROOFLINE = {name: s for name, s in SERVICES.items() if s.get("build") == "." and "PROOFLINE_DATABASE_URL"
             in (s.get("environment") or {})}
PATHS = ("PROOFLINE_CONTRACTS_DIR", "PROOFLINE_SERVERS_FILE", "PROOFLINE_STATE_DIR")


def runtime_stage() -> str:
    return DOCKERFILE.split("\nFROM ")[-1]


def image_paths() -> set[str]:
    """Paths the runtime stage creates: COPY destinations and mkdir arguments."""
    stage = runtime_stage()
    made = set(re.findall(r"^COPY (?:--from=\S+ )?\S+ (/\S+)$", stage, re.M))
    for block in re.findall(r"mkdir -p ([^&]+)", stage):
        made.update(p for p in block.replace("\\", " ").split() if p.startswith("/"))
    return made


def mounts(service: dict) -> set[str]:
    return {v.split(":")[1] for v in service.get("volumes", [])}


def command_words(service: dict) -> list[str]:
    """The command's words, with ``sh -c`` scripts split into theirs too."""
    command = service.get("command") or []
    words = command if isinstance(command, list) else shlex.split(command)
    return [part for word in words for part in (shlex.split(word, posix=True) if " " in word else [word])]


def test_the_image_installs_the_built_wheel_not_the_source_tree() -> None:
    stage = runtime_stage()
    assert re.search(r"^RUN pip install [^\n]*\S+\.whl", stage, re.M), stage
    assert not re.search(r"pip install[^\n]*(\s-e\s|\s\.(\s|$))", stage)
    assert not re.search(r"^COPY (proofline|worker|ledger|recovery) ", stage, re.M)


def test_every_proofline_process_is_given_every_path() -> None:
    assert set(PROOFLINE) >= {"worker", "recovery", "beat", "flower", "migrate"}
    made = image_paths()
    for name, service in PROOFLINE.items():
        env = service["environment"]
        for key in PATHS:
            assert env.get(key, "").startswith("/"), f"{name}: {key} is not an absolute path"
            assert env[key] in made | mounts(service), f"{name}: {key}={env[key]} is neither in the image nor mounted"
        for key in ("PROOFLINE_KEYS_DIR", "PROOFLINE_CHECKPOINT_DIR"):
            if key in env:
                assert env[key] in mounts(service), f"{name}: {key}={env[key]} is not a mounted volume"


def test_every_setting_named_exists() -> None:
    fields = set(Settings.model_fields)
    for name, service in PROOFLINE.items():
        for key in service["environment"]:
            if key.startswith("PROOFLINE_"):
                assert key.removeprefix("PROOFLINE_").lower() in fields, f"{name}: {key} is no setting"


def test_the_reconciler_has_its_timer_and_a_worker_for_its_queue() -> None:
    assert command_words(SERVICES["beat"])[:2] == ["proofline", "beat"]
    consumers = [n for n, s in PROOFLINE.items() if command_words(s)[:2] == ["proofline", "worker"]
                 and "reconcile" in " ".join(command_words(s))]
    assert consumers, "no worker consumes the reconcile queue"


def test_every_module_a_service_runs_ships_in_the_wheel() -> None:
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = {p.rstrip("*") for p in packages}
    for name, service in SERVICES.items():
        words = command_words(service)
        for i, word in enumerate(words):
            if word in ("-m", "-A") and i + 1 < len(words):
                assert words[i + 1].split(".")[0] in tops, f"{name} runs {words[i + 1]}, which is not in the wheel"
        joined = " ".join(words)
        for script in re.findall(r"python (/\S+\.py)", joined):
            assert script in image_paths(), f"{name} runs {script}, which the image does not hold"


@pytest.mark.parametrize("kind", ["volumes", "secrets"])
def test_every_volume_and_secret_is_declared(kind: str) -> None:
    declared = set(COMPOSE.get(kind) or {})
    for name, service in SERVICES.items():
        used = {v.split(":")[0] for v in service.get("volumes", [])} if kind == "volumes" else set(
            service.get("secrets", []))
        assert used <= declared, f"{name} uses undeclared {kind}: {used - declared}"


def test_every_dependency_is_a_service() -> None:
    for name, service in SERVICES.items():
        assert set(service.get("depends_on") or {}) <= set(SERVICES), name


def test_the_image_holds_the_configuration_it_is_told_about() -> None:
    """The COPY sources exist in the repository (a renamed file would break the build)."""
    for source, _ in re.findall(r"^COPY (?!--from)(\S+) (/\S+)$", runtime_stage(), re.M):
        assert (ROOT / source).exists(), source
    assert Path(ROOT / "ops" / "servers.compose.yaml").exists()
