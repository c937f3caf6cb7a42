"""Secrets, pure parts: the seal (AES-256-GCM), settings that guard fault points, the environment
check, the tool contract hash, what task messages show, and the log/Sentry scrubbers."""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from mcp.types import Tool, ToolAnnotations
from pydantic import ValidationError

from ledger import seal
from ledger.redact import MARK, current_redactor, for_envelope
from proofline.canonical import canonical_bytes, tool_contract_hash
from proofline.errors import ConfigurationError, EnvironmentMismatch, SealedMessageUnreadable
from proofline.settings import Settings
from tests.unit.test_signing import envelope
from worker.dispatch import task_repr
from worker.observability import ScrubFilter, scrub_event
from worker.validate import revalidate_static

MESSAGE = {"envelope": {"action_id": "act-1", "arguments": {"note": "a\x00b", "amount": 1.5, "n": 10**15}},
           "key_id": "k-1", "signature": "ab" * 32}


@pytest.fixture
def key(tmp_path: Path) -> seal.SealKey:
    seal.write_key(tmp_path / "seal.key")
    return seal.sealer_for(Settings(seal_key_file=tmp_path / "seal.key"))


def test_sealed_message_round_trips_byte_exactly_with_a_nul(key: seal.SealKey) -> None:
    blob = seal.seal_message(key, "act-1", MESSAGE)
    assert seal.open_bytes("act-1", blob) == canonical_bytes(MESSAGE)
    opened = seal.open_message("act-1", blob)
    assert opened == MESSAGE and opened["envelope"]["arguments"]["note"] == "a\x00b"
    assert b"a\\u0000b" not in blob and b"note" not in blob  # encrypted, not encoded


def test_each_seal_uses_a_fresh_nonce(key: seal.SealKey) -> None:
    assert seal.seal_message(key, "act-1", MESSAGE) != seal.seal_message(key, "act-1", MESSAGE)


def test_a_sealed_message_opens_only_for_its_own_action(key: seal.SealKey) -> None:
    blob = seal.seal_message(key, "act-1", MESSAGE)
    with pytest.raises(SealedMessageUnreadable):
        seal.open_bytes("act-2", blob)


def test_a_tampered_blob_is_refused(key: seal.SealKey) -> None:
    blob = bytearray(seal.seal_message(key, "act-1", MESSAGE))
    blob[-5] ^= 1
    with pytest.raises(SealedMessageUnreadable):
        seal.open_bytes("act-1", bytes(blob))
    with pytest.raises(SealedMessageUnreadable):
        seal.open_bytes("act-1", b"not a seal")


def test_a_blob_sealed_with_an_unknown_key_is_refused(tmp_path: Path) -> None:
    stranger = seal.SealKey("never-loaded", os.urandom(32))
    with pytest.raises(SealedMessageUnreadable, match="no seal key"):
        seal.open_bytes("act-1", stranger.seal("act-1", b"{}"))


def test_rotated_keys_still_open_old_rows(tmp_path: Path) -> None:
    for name in ("old.key", "new.key"):
        seal.write_key(tmp_path / name)
    old = seal.sealer_for(Settings(seal_key_file=tmp_path / "old.key"))
    blob = seal.seal_message(old, "act-1", MESSAGE)
    new = seal.sealer_for(Settings(seal_key_file=tmp_path / "new.key"))
    assert new.key_id != old.key_id
    assert seal.open_message("act-1", blob) == MESSAGE


def test_key_files_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "seal.key"
    seal.write_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o644)
    with pytest.raises(ConfigurationError, match="readable by group or others"):
        seal.load_key(path)
    bad = tmp_path / "bad.key"
    bad.write_text(json.dumps({"key_id": "x", "key": "c2hvcnQ="}))
    bad.chmod(0o600)
    with pytest.raises(ConfigurationError, match="32-byte"):
        seal.load_key(bad)
    with pytest.raises(ConfigurationError, match="does not exist"):
        seal.load_key(tmp_path / "missing.key")
    with pytest.raises(ConfigurationError, match="no seal key"):
        seal.sealer_for(Settings())


def test_seal_key_defaults_into_keys_dir(tmp_path: Path) -> None:
    assert Settings(keys_dir=tmp_path).seal_key_file == tmp_path / "seal.key"
    assert Settings(keys_dir=tmp_path, seal_key_file=tmp_path / "x.key").seal_key_file == tmp_path / "x.key"


# --- fault points only through settings, never in production --------------------------------------


@pytest.mark.parametrize("environment", ["production", "staging"])
def test_settings_refuse_fault_points_outside_development_and_test(environment: str) -> None:
    with pytest.raises(ValidationError, match="fault points"):
        Settings(environment=environment, fault_points_enabled=True)
    assert not Settings(environment=environment).fault_points_enabled


@pytest.mark.parametrize("environment", ["development", "test"])
def test_settings_allow_fault_points_in_development_and_test(environment: str) -> None:
    assert Settings(environment=environment, fault_points_enabled=True).fault_points_enabled


def test_fault_points_read_the_settings_not_the_raw_environment(tmp_path: Path) -> None:
    import subprocess

    points = tmp_path / "points.json"
    points.write_text(json.dumps({"before_send": {"remaining": 1, "action": "raise"}}))
    code = ("from worker import faultpoints\n"
            "try:\n    faultpoints.hit('before_send')\nexcept faultpoints.FaultPointRaised:\n    print('raised')\n"
            "else:\n    print('quiet')\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("PROOFLINE_")}
    run = lambda env: subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True,  # noqa: E731
                                     text=True, cwd=Path(__file__).resolve().parents[2], timeout=60)
    # The old switch variables do nothing any more.
    assert run({"PROOFLINE_FAULT_POINTS_ENABLE": "yes-kill-my-workers",
                "PROOFLINE_FAULT_POINTS": str(points)}).stdout.strip() == "quiet"
    on = {"PROOFLINE_FAULT_POINTS_ENABLED": "true", "PROOFLINE_FAULT_POINTS_FILE": str(points)}
    assert run(on).stdout.strip() == "raised"
    refused = run({**on, "PROOFLINE_ENVIRONMENT": "production"})
    assert refused.returncode != 0 and "fault points may only be enabled" in refused.stderr


# --- environment ----------------------------------------------------------------------------------


def test_an_envelope_for_another_environment_is_refused() -> None:
    now = datetime.now(UTC)
    env = envelope(environment="staging")
    with pytest.raises(EnvironmentMismatch) as refused:
        revalidate_static(env, Settings(environment="production"), now, [], [])
    assert refused.value.code == "environment_mismatch"
    checked = revalidate_static(envelope(environment="production"), Settings(environment="production"), now, [], [])
    assert checked["environment"] == "production"


# --- the tool contract hash -------------------------------------------------------------------------


def _tool(**overrides) -> Tool:
    fields = {"name": "create_ticket", "description": "Open a ticket.",
              "input_schema": {"type": "object", "properties": {"title": {"type": "string"}}},
              "output_schema": {"type": "object"}, "annotations": ToolAnnotations(destructive_hint=False)}
    return Tool(**{**fields, **overrides})


def test_contract_hash_covers_name_schemas_description_and_annotations() -> None:
    base = tool_contract_hash(_tool())
    assert tool_contract_hash(_tool()) == base
    for changed in ({"name": "create_ticket2"}, {"description": "Open a ticket and page its owner."},
                    {"description": None}, {"annotations": ToolAnnotations(destructive_hint=True)},
                    {"annotations": None}, {"input_schema": {"type": "object"}}, {"output_schema": None}):
        assert tool_contract_hash(_tool(**changed)) != base, changed


def test_contract_hash_ignores_what_is_not_the_contract() -> None:
    assert tool_contract_hash(_tool(meta={"x": 1})) == tool_contract_hash(_tool())


# --- what a task message shows ---------------------------------------------------------------------


def test_task_messages_show_the_action_id_and_a_digest_only() -> None:
    args, kwargs = task_repr([{"envelope": {"action_id": "act-9", "arguments": {"api_key": "sk-LEAK"}}}])
    assert "act-9" in args and "sha256:" in args and "LEAK" not in args and kwargs == "{}"
    assert task_repr(["act-9"]) == ("('act-9',)", "{}")
    hostile, _ = task_repr([{"envelope": {"action_id": "x' + secret 'y"}}])
    assert "secret" not in hostile
    assert "LEAK" not in task_repr([1], {"password": "LEAK"})[1]


# --- logs and Sentry ---------------------------------------------------------------------------------


def _record(msg: str, *args, exc: BaseException | None = None, **extra) -> logging.LogRecord:
    record = logging.LogRecord("worker", logging.ERROR, __file__, 1, msg, args,
                               (type(exc), exc, exc.__traceback__) if exc else None)
    record.__dict__.update(extra)
    return record


def test_log_records_are_scrubbed_with_the_current_actions_secrets() -> None:
    token = current_redactor.set(for_envelope({"arguments": {"api_key": "sk-live-CANARY"}}))
    try:
        try:
            raise RuntimeError("bad call with sk-live-CANARY")
        except RuntimeError as exc:
            record = _record("calling %s with %s", "tool", "sk-live-CANARY", exc=exc,
                             extra_field={"password": "pw", "text": "4111111111111111"})
        assert ScrubFilter().filter(record)
        line = logging.Formatter("%(message)s").format(record)
    finally:
        current_redactor.reset(token)
    assert "CANARY" not in line and "RuntimeError" in line and line.startswith(f"calling tool with {MARK}")
    assert record.extra_field == {"password": MARK, "text": MARK}


def test_sentry_events_lose_frame_variables_task_arguments_and_secrets() -> None:
    event = {
        "exception": {"values": [{"value": "boom Bearer abc.def", "stacktrace": {"frames": [
            {"function": "f", "vars": {"signing_keys": "k", "url": "postgresql://u:pw@h/db"}}]}}]},
        "extra": {"celery-job": {"task_name": "proofline.execute",
                                 "args": [{"envelope": {"action_id": "act-1", "arguments": {"x": "CANARY"}}}],
                                 "kwargs": {}}},
        "request": {"data": "CANARY"},
        "breadcrumbs": {"values": [{"message": "card 4111 1111 1111 1111", "data": {"client_secret": "s"}}]},
    }
    out = json.dumps(scrub_event(event, {}))
    assert "CANARY" not in out and "vars" not in out and "pw@h" not in out and "4111" not in out
    assert "act-1" in out and "sha256:" in out and f"Bearer {MARK}" in out
