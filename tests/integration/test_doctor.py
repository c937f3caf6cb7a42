"""``proofline doctor`` on real services: a healthy deployment passes every check, and each broken
part (no reconciler yet, the database missing, migrations behind, a keys folder without keys) fails
exactly its own check, in one line that says how to fix it, with a non-zero exit."""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
import yaml

from ledger.migrate import upgrade
from proofline_kit import zygote
from tests.conftest import (
    ADMIN_URL,
    ROOT,
    build_stack,
    drop_database,
    start_process,
    start_workers,
    teardown_stack,
    wait_for,
    with_database,
)

pytestmark = pytest.mark.timeout(240)
CHECKS = ["environment", "key-files", "database", "db-auth", "migrations", "broker", "broker-auth", "reconciler", "keys",
          "authority", "contracts", "evidence_capture", "pins", "servers"]


def doctor(env: dict[str, str], cwd: Path, *extra: str) -> tuple[int, dict[str, dict]]:
    out = zygote.run([sys.executable, "-m", "proofline", "doctor", "--json", *extra], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=90)
    assert "Traceback" not in out.stderr, out.stderr
    report = json.loads(out.stdout)
    assert [c["name"] for c in report["checks"]] == CHECKS
    assert report["ok"] == (out.returncode == 0)
    return out.returncode, {c["name"]: c for c in report["checks"]}


def failed(checks: dict[str, dict]) -> list[str]:
    return [name for name, c in checks.items() if not c["ok"]]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    s = build_stack("stdio", tmp_path_factory.mktemp("doctor"))
    try:
        yield s
    finally:
        teardown_stack(s)


def test_doctor_fails_without_a_reconciler_then_passes_once_beat_runs(stack) -> None:
    code, checks = doctor(stack.env, stack.workdir)
    assert code == 1 and failed(checks) == ["reconciler"], checks
    assert "proofline beat" in checks["reconciler"]["fix"]

    # A worker that consumes the reconcile queue, and `proofline beat` (the timer): sweeps start.
    start_workers(stack, beat=False)
    stack.processes.append(start_process([sys.executable, "-m", "proofline", "beat", "--schedule",
                                          str(stack.workdir / "beat-schedule")], stack.env,
                                         stack.workdir / "beat.log"))

    def healthy() -> dict | None:
        code, checks = doctor(stack.env, stack.workdir)
        return checks if code == 0 else None

    checks = wait_for(healthy, 60, interval=1.0, what="doctor to pass with the reconciler sweeping")
    assert checks["reconciler"]["detail"].startswith("last sweep")
    lines = zygote.run([sys.executable, "-m", "proofline", "doctor"], env=stack.env, cwd=stack.workdir,
                           capture_output=True, text=True, timeout=90).stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["ok", name] for name in CHECKS]


def test_doctor_names_a_keys_folder_without_keys(stack, tmp_path: Path) -> None:
    empty = tmp_path / "keys"
    empty.mkdir()
    code, checks = doctor({**stack.env, "PROOFLINE_KEYS_DIR": str(empty)}, tmp_path)
    assert code == 1 and "keys" in failed(checks), checks
    assert "proofline keys generate" in checks["keys"]["fix"]
    assert not {"database", "migrations", "broker", "contracts", "servers"} & set(failed(checks))


def test_doctor_names_a_capture_policy_without_an_auditor_public_key(stack, tmp_path: Path) -> None:
    contracts = tmp_path / "contracts"
    shutil.copytree(ROOT / "contracts", contracts)
    doc = yaml.safe_load((contracts / "ticket.create.yaml").read_text())
    doc["evidence_capture"] = {"arguments": True}
    (contracts / "ticket.create.yaml").write_text(yaml.safe_dump(doc))
    env = {**stack.env, "PROOFLINE_CONTRACTS_DIR": str(contracts)}
    code, checks = doctor({**env, "PROOFLINE_AUDITOR_PUBLIC_KEY_FILE": str(tmp_path / "absent.pub")}, tmp_path)
    assert "evidence_capture" in failed(checks) and "ticket.create" in checks["evidence_capture"]["detail"]
    assert "keys add-auditor" in checks["evidence_capture"]["fix"]
    _, checks = doctor(env, tmp_path)  # the stack's keys folder has auditor.pub
    assert checks["evidence_capture"]["ok"] and "sealed to auditor key" in checks["evidence_capture"]["detail"]


def test_doctor_names_a_missing_database(stack, tmp_path: Path) -> None:
    gone = with_database(ADMIN_URL, f"pl_absent_{uuid.uuid4().hex[:8]}")
    env = {**stack.env, "PROOFLINE_DATABASE_URL": gone, "PROOFLINE_READER_DATABASE_URL": gone}
    code, checks = doctor(env, tmp_path)
    assert code == 1
    assert {"database", "migrations", "reconciler"} <= set(failed(checks)), checks
    assert "does not exist" in checks["database"]["detail"]
    assert checks["migrations"]["detail"].startswith("not checked")
    assert checks["broker"]["ok"] and checks["contracts"]["ok"]
    plain = zygote.run([sys.executable, "-m", "proofline", "doctor"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=90)
    assert plain.returncode == 1 and "Traceback" not in plain.stdout + plain.stderr
    database = [line for line in plain.stdout.splitlines() if line.split()[1:2] == ["database"]]
    assert database[0].startswith("FAIL  database") and "fix:" in database[0]


def test_doctor_names_migrations_behind(stack, tmp_path: Path) -> None:
    name = f"pl_behind_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    admin = with_database(ADMIN_URL, name)
    try:
        upgrade(admin, "0008")  # one revision before the code's head
        env = {**stack.env, "PROOFLINE_DATABASE_URL": admin, "PROOFLINE_READER_DATABASE_URL": admin}
        code, checks = doctor(env, tmp_path)
        assert code == 1 and "migrations" in failed(checks), checks
        assert "0008" in checks["migrations"]["detail"] and "proofline migrate" in checks["migrations"]["fix"]
        assert checks["database"]["ok"]
    finally:
        drop_database(admin)


def test_the_packaged_defaults_need_no_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without PROOFLINE_CONTRACTS_DIR / PROOFLINE_SERVERS_FILE the settings name files inside the
    package, which the wheel ships (pyproject package data)."""
    from proofline.settings import PACKAGED_CONTRACTS_DIR, PACKAGED_SERVERS_FILE, Settings

    for name in ("PROOFLINE_CONTRACTS_DIR", "PROOFLINE_SERVERS_FILE", "PROOFLINE_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings()
    assert settings.contracts_dir == PACKAGED_CONTRACTS_DIR and settings.servers_file == PACKAGED_SERVERS_FILE
    assert PACKAGED_CONTRACTS_DIR.is_relative_to(ROOT / "proofline")
    assert sorted(p.name for p in PACKAGED_CONTRACTS_DIR.glob("*.yaml"))
    assert settings.servers_base_dir == settings.state_dir


def test_doctor_names_a_bad_egress_allowlist_and_lists_a_good_one(stack, tmp_path: Path) -> None:
    """The servers check loads the file as the worker's start check does (worker/servers.py)."""
    servers = yaml.safe_load(Path(stack.servers_file).read_text())
    sandbox = servers["servers"]["sor"].setdefault("sandbox", {})
    sandbox["network"] = {"allow": ["127.0.0.1:8443", "10.2.3.4:5432"]}
    bad = Path(stack.servers_file).with_name(f"servers-egress-{uuid.uuid4().hex[:6]}.yaml")  # its paths hold
    bad.write_text(yaml.safe_dump(servers))
    env = {**stack.env, "PROOFLINE_SERVERS_FILE": str(bad)}
    code, checks = doctor(env, tmp_path)
    assert code == 1 and "servers" in failed(checks)
    detail = checks["servers"]["detail"]
    assert str(bad) in detail and "server sor" in detail and "'10.2.3.4:5432'" in detail, detail
    assert "loopback" in detail and str(bad) in checks["servers"]["fix"]
    sandbox["network"] = {"allow": ["127.0.0.1:8443"]}
    bad.write_text(yaml.safe_dump(servers))
    _, checks = doctor(env, tmp_path)
    assert checks["servers"]["ok"], checks["servers"]
    assert "egress allowed: sor/write to 127.0.0.1:8443; sor/read to 127.0.0.1:8443" in checks["servers"]["detail"]
