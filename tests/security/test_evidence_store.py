"""The protected evidence store through the product: real Celery workers, the system-of-record MCP
server over stdio, Postgres and its roles, the ``proofline`` command line and the console.

The stack's contracts capture ``ticket.create`` (arguments, result and reads, its title declared
sensitive) and leave ``refund.issue`` as it ships (no capture). The auditor's private key is moved
out of the keys folder the workers read before they start: they hold the public half only.

- captured for one action type and not the other, each capture named (digest, no value) by an
  ``evidence_captured`` ledger event;
- a canary in an argument is in no table, log, task event or span, except as ciphertext;
- no runtime or reader role may SELECT the store, and the worker's key material opens nothing;
- the auditor's role and key read the raw values back, the read is a ledger event, the ledger verifies;
- tampered ciphertext, or a capture moved to another action, fails authentication (and the attempt is recorded);
- the console's evidence page: an auditor opens it (recorded with the user's name), an operator gets 403.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from ledger import vault_store
from ledger.redact import MARK
from ledger.states import CaptureKind, Outcome
from proofline.auditor_keys import AuditorKey, read_private
from proofline.console.access import ConsoleRole, add_user
from proofline.errors import AuditorKeyRequired, EvidenceCaptureTampered
from proofline.keys import KeyRole, load_signing_key
from proofline.settings import ROOT
from proofline.vault import Sealed, open_sealed
from proofline_kit.sor import store as sor
from tests.conftest import Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.console.conftest import chromium, log_in, running_console, shot
from tests.helpers import new_account, restart_env
from tests.integration.cli_run import assert_error, proofline
from tests.security.test_secrets import TaskEvents, database_hits, worker_log_text

CANARY = "vault-canary-" + uuid.uuid4().hex[:12]
#: Every role but the auditor's: none may read the store (the worker and the runtime only insert).
NOT_AUDITORS = ("worker", "recovery", "runtime", "controller", "operator", "reader")
Denied = psycopg.errors.InsufficientPrivilege


@pytest.fixture(scope="module")
def vault(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("vault")
    contracts = tmp / "contracts"
    shutil.copytree(ROOT / "contracts", contracts)
    doc = yaml.safe_load((contracts / "ticket.create.yaml").read_text())
    doc["sensitive_fields"] = ["args.title"]
    doc["evidence_capture"] = {"arguments": True, "result": True, "reads": True, "retention": "audit"}
    (contracts / "ticket.create.yaml").write_text(yaml.safe_dump(doc))
    # A restart is verified in the verification task (it has an independent source): its reads only.
    doc = yaml.safe_load((contracts / "service.restart.yaml").read_text())
    doc["evidence_capture"] = {"reads": True, "retention": "short"}
    (contracts / "service.restart.yaml").write_text(yaml.safe_dump(doc))
    stack = build_stack("stdio", tmp, extra_env={
        "PROOFLINE_CONTRACTS_DIR": str(contracts), "PROOFLINE_TASK_EVENTS": "true",
        "OTEL_TRACES_EXPORTER": "jsonl", "PROOFLINE_TRACES_DIR": str(tmp / "traces"), "OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        # The auditor's folder: the workers' keys folder keeps auditor.pub and loses auditor.key.
        (tmp / "auditor").mkdir(mode=0o700)
        os.replace(tmp / "keys" / "auditor.key", auditor_key_file(stack))
        start_workers(stack)
        yield stack
    finally:
        teardown_stack(stack)


@pytest.fixture(scope="module")
def events(vault: Stack) -> Iterator[TaskEvents]:
    receiver = TaskEvents(vault)
    yield receiver
    receiver.stop()


def auditor_key_file(stack: Stack) -> Path:
    return stack.workdir / "auditor" / "auditor.key"


def auditor_env(stack: Stack, **extra: str) -> dict[str, str]:
    return {"PROOFLINE_AUDITOR_KEY_FILE": str(auditor_key_file(stack)),
            "PROOFLINE_AUDITOR_DATABASE_URL": stack.urls["auditor"], **extra}


def ticket(stack: Stack) -> Any:
    return stack.envelope("ticket.create", arguments={"tenant": "acme", "title": f"{CANARY}-{uuid.uuid4().hex[:6]}",
                                                      "owner": "ops"},
                          target={"type": "ticket_queue", "id": "acme-ops"})


def refund(stack: Stack) -> Any:
    account = new_account(stack)
    version = sor.get_account(stack.sor_db, account)["account"]["version"]
    return stack.envelope("refund.issue", arguments={"account": account, "tenant": "acme", "amount_cents": 500,
                                                     "reason": "sla"},
                          target={"type": "account", "id": account, "expected_version": version})


def verified(stack: Stack, *envelopes: Any) -> None:
    for env in envelopes:
        stack.publish(env)
    for env in envelopes:
        row = stack.wait_settled(env.action_id, timeout=60)
        assert row.outcome == Outcome.completed_verified, (env.action_id, stack.events(env.action_id))


def rows(stack: Stack, action_id: str) -> list[dict[str, Any]]:
    with psycopg.connect(stack.admin_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute("SELECT * FROM evidence_captures WHERE action_id = %s ORDER BY kind",
                            (action_id,)).fetchall()


def captured_events(stack: Stack, action_id: str) -> list[dict[str, Any]]:
    return [e["evidence"] for e in stack.timeline(action_id) if e["event"] == vault_store.CAPTURED]


@pytest.fixture(scope="module")
def pair(vault: Stack, events: TaskEvents) -> tuple[Any, Any]:
    """One captured ticket (a canary in its title) and one refund, both verified."""
    t, r = ticket(vault), refund(vault)
    verified(vault, t, r)
    # The captures are written after the result's commit: wait for their event, never a fixed time.
    wait_for(lambda: captured_events(vault, t.action_id), 20, what="the ticket's evidence_captured event")
    return t, r


def show(stack: Stack, *args: str, env: dict[str, str] | None = None) -> Any:
    """``proofline --json evidence show``: the captures as JSON."""
    return proofline(stack, "--json", "evidence", "show", *args, env=env)


def refused(stack: Stack, *args: str, env: dict[str, str] | None = None) -> Any:
    """``proofline evidence show`` expected to fail: its one line on stderr."""
    return proofline(stack, "evidence", "show", *args, env=env)


# --- capture -------------------------------------------------------------------------------------


def test_evidence_is_captured_for_one_action_type_and_not_another(vault: Stack, pair: tuple[Any, Any]) -> None:
    t, r = pair
    kept = rows(vault, t.action_id)
    assert sorted(row["kind"] for row in kept) == sorted(
        [CaptureKind.arguments, CaptureKind.result, CaptureKind.precondition_read, CaptureKind.verification_read])
    assert {row["retention"] for row in kept} == {"audit"}
    assert rows(vault, r.action_id) == [] and captured_events(vault, r.action_id) == []
    # The ledger names each capture by digest and key: what was captured is proven, not held.
    [event] = captured_events(vault, t.action_id)
    assert {c["capture_id"]: c["sha256"] for c in event["captures"]} == {
        row["capture_id"]: row["plaintext_sha256"] for row in kept}
    key_id = read_private(auditor_key_file(vault)).key_id
    assert {c["key_id"] for c in event["captures"]} == {key_id} and event["retention"] == "audit"
    revalidated = next(e for e in vault.timeline(t.action_id) if e["event"] == "revalidated")["evidence"]
    assert revalidated["evidence_capture"]["key_id"] == key_id
    assert "evidence_capture" not in next(e for e in vault.timeline(r.action_id) if e["event"] == "revalidated")[
        "evidence"]


def test_the_canary_is_only_ciphertext_nowhere_in_tables_logs_task_events_or_spans(
        vault: Stack, pair: tuple[Any, Any], events: TaskEvents) -> None:
    t, _ = pair
    title = t.arguments["title"]
    # Redaction still removes it from the records (the contract declares the title sensitive) ...
    row = vault.action(t.action_id)
    assert row.envelope["arguments"]["title"] == MARK and row.recovery_data["after"]["ticket"]["title"] == MARK
    # ... and no column holds it, as text or as bytes: the evidence store holds it sealed only.
    assert rows(vault, t.action_id) and database_hits(vault, [CANARY]) == []
    logs = worker_log_text(vault)
    assert t.action_id in logs and CANARY not in logs
    received = wait_for(lambda: [e for e in events.received if t.action_id in str(e.get("args"))], 20,
                        what="the ticket's task events")
    assert received and CANARY not in json.dumps(events.received) + json.dumps(events.sent)
    spans = wait_for(lambda: "".join(p.read_text() for p in (vault.workdir / "traces").glob("*.jsonl"))
                     or None, 20, what="span files")
    assert "proofline.tool_call" in spans and CANARY not in spans and title not in spans


def test_the_verification_task_captures_each_read_of_each_source(vault: Stack) -> None:
    env = restart_env(vault)
    verified(vault, env)
    events = wait_for(lambda: len(captured_events(vault, env.action_id)) == 2 and captured_events(vault, env.action_id),
                      20, what="the execute task's and the verification task's evidence_captured events")
    kinds = [[c["kind"] for c in e["captures"]] for e in events]
    assert kinds == [["precondition_read"], ["verification_read", "verification_read"]]
    assert {r["retention"] for r in rows(vault, env.action_id)} == {"short"}
    out = show(vault, env.action_id, env=auditor_env(vault))
    assert out.returncode == 0, out.stderr
    reads = [c["value"] for c in json.loads(out.stdout)["captures"] if c["kind"] == "verification_read"]
    assert sorted(r["source"] for r in reads) == ["monitoring", "primary"]
    monitoring = next(r for r in reads if r["source"] == "monitoring")
    assert monitoring["after"]["restarts"][0]["idempotency_key"] == env.idempotency_key


def test_without_the_auditor_public_key_a_capturing_action_is_refused_before_the_call(vault: Stack) -> None:
    public = vault.workdir / "keys" / "auditor.pub"
    os.replace(public, public.with_suffix(".away"))
    try:
        t, r = ticket(vault), refund(vault)
        for env in (t, r):
            vault.publish(env)
        row = vault.wait_settled(t.action_id, timeout=60)
        assert (row.outcome, row.reason_code) == (Outcome.not_started, "evidence_capture_unavailable")
        assert vault.effects(t.idempotency_key) == 0  # nothing was sent
        # Another action type, capturing nothing, runs as before.
        assert vault.wait_settled(r.action_id, timeout=60).outcome == Outcome.completed_verified
    finally:
        os.replace(public.with_suffix(".away"), public)


def test_a_capture_that_cannot_be_stored_costs_the_action_nothing(vault: Stack) -> None:
    with psycopg.connect(vault.admin_url, autocommit=True) as conn:
        conn.execute("REVOKE INSERT ON evidence_captures FROM proofline_worker")
    try:
        t = ticket(vault)
        verified(vault, t)  # the result and its verdict are recorded whatever the store does
        failed = wait_for(lambda: [e["evidence"] for e in vault.timeline(t.action_id)
                                   if e["event"] == "evidence_capture_failed"], 20, what="evidence_capture_failed")
        assert failed[0]["captures"] == 4 and CANARY not in json.dumps(failed)
        assert rows(vault, t.action_id) == [] and captured_events(vault, t.action_id) == []
        assert vault.effects(t.idempotency_key) == 1
    finally:
        with psycopg.connect(vault.admin_url, autocommit=True) as conn:
            conn.execute("GRANT INSERT ON evidence_captures TO proofline_worker")


# --- who can read --------------------------------------------------------------------------------


def test_no_runtime_or_reader_role_may_select_the_store(vault: Stack, pair: tuple[Any, Any]) -> None:
    for role in NOT_AUDITORS:
        with psycopg.connect(vault.urls[role], autocommit=True) as conn, pytest.raises(Denied):
            conn.execute("SELECT ciphertext FROM evidence_captures LIMIT 1")
    with psycopg.connect(vault.urls["auditor"], autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM evidence_captures").fetchone()[0] >= 4
        # The auditor reads; it writes nothing but its reads' events.
        with pytest.raises(Denied):
            conn.execute("DELETE FROM evidence_captures")
        with pytest.raises(psycopg.Error) as guarded:
            conn.execute("INSERT INTO ledger_events (action_id, event, actor, evidence) VALUES (%s, 'tool_called', "
                         "'auditor', '{}')", (pair[0].action_id,))
        assert guarded.value.sqlstate == "PL003"  # the ledger's event guard: not an auditor's event


def test_the_worker_key_material_opens_nothing(vault: Stack, pair: tuple[Any, Any]) -> None:
    t, _ = pair
    row = rows(vault, t.action_id)[0]
    item = Sealed(row["capture_id"], row["action_id"], row["kind"], row["key_id"], bytes(row["ephemeral_public"]),
                  bytes(row["nonce"]), bytes(row["ciphertext"]), row["plaintext_sha256"])
    # The worker's own private key, taken as an X25519 key: the wrong key, by id and by cryptography.
    worker = load_signing_key(vault.workdir / "keys" / "worker.key", KeyRole.worker)
    as_x25519 = X25519PrivateKey.from_private_bytes(worker.private.private_bytes_raw())
    with pytest.raises(AuditorKeyRequired):
        open_sealed(AuditorKey(worker.key_id, as_x25519), item)
    with pytest.raises(EvidenceCaptureTampered):
        open_sealed(AuditorKey(item.key_id, as_x25519), item)
    # The workers' keys folder holds the public half only; the CLI with the workers' settings refuses.
    assert sorted(p.name for p in (vault.workdir / "keys").glob("auditor*")) == ["auditor.pub"]
    assert_error(refused(vault, t.action_id), 3, "auditor_key_required")
    # The auditor's key through the reader's role: refused by the store, nothing decrypted or recorded.
    out = refused(vault, t.action_id, env=auditor_env(vault, PROOFLINE_AUDITOR_DATABASE_URL=vault.urls["reader"]))
    assert_error(out, 13, "auditor_role_required")
    assert [e for e in vault.timeline(t.action_id) if e["event"] == vault_store.READ] == []


def test_the_auditor_reads_the_raw_values_and_the_read_is_a_ledger_event(vault: Stack, pair: tuple[Any, Any]) -> None:
    t, _ = pair
    out = show(vault, t.action_id, "--reader", "carol@audit", env=auditor_env(vault))
    assert out.returncode == 0, out.stderr
    opened = {c["kind"]: c for c in json.loads(out.stdout)["captures"]}
    assert opened["arguments"]["value"] == t.arguments
    # The result's values as received (the tool returns no secret: the stored copy is the same).
    assert opened["result"]["value"] == vault.action(t.action_id).result["values"]
    assert opened["result"]["value"]["ticket_id"].startswith("T")
    assert opened["precondition_read"]["value"] == {"found": False, "ticket": None}
    read = opened["verification_read"]["value"]
    assert read["source"] == "primary" and read["after"]["ticket"]["title"] == t.arguments["title"]
    [event] = [e for e in vault.timeline(t.action_id) if e["event"] == vault_store.READ]
    assert event["actor"] == "carol@audit" and event["evidence"]["reader"] == "carol@audit"
    assert sorted(event["evidence"]["captures"]) == sorted(c["capture_id"] for c in opened.values())
    assert event["evidence"]["via"] == "cli" and "failed" not in event["evidence"]
    # One capture by its id: read and recorded the same way.
    one = next(iter(opened.values()))["capture_id"]
    again = show(vault, "--capture", one, env=auditor_env(vault))
    assert again.returncode == 0 and [c["capture_id"] for c in json.loads(again.stdout)["captures"]] == [one]
    assert proofline(vault, "verify-ledger").returncode == 0


def test_tampered_or_moved_captures_fail_authentication_and_the_attempt_is_recorded(vault: Stack) -> None:
    t, other = ticket(vault), ticket(vault)
    verified(vault, t, other)
    for env in (t, other):
        wait_for(lambda e=env: captured_events(vault, e.action_id), 20, what="evidence_captured")
    kept = rows(vault, t.action_id)
    with psycopg.connect(vault.admin_url, autocommit=True) as conn:  # what a database owner could do
        conn.execute("UPDATE evidence_captures SET ciphertext = set_byte(ciphertext, 0, get_byte(ciphertext, 0) # 1) "
                     "WHERE capture_id = %s", (kept[0]["capture_id"],))
        # A capture of ``other`` moved onto ``t``'s action: its ciphertext is bound to ``other``.
        moved = rows(vault, other.action_id)[0]["capture_id"]
        conn.execute("UPDATE evidence_captures SET action_id = %s WHERE capture_id = %s", (t.action_id, moved))
    out = refused(vault, "--capture", kept[0]["capture_id"], env=auditor_env(vault))
    assert_error(out, 16, "evidence_capture_tampered")
    out = refused(vault, "--capture", moved, env=auditor_env(vault))
    assert_error(out, 16, "evidence_capture_tampered")
    attempts = [e["evidence"] for e in vault.timeline(t.action_id) if e["event"] == vault_store.READ]
    assert [a["failed"] for a in attempts] == [{kept[0]["capture_id"]: "evidence_capture_tampered"},
                                               {moved: "evidence_capture_tampered"}]
    # The moved blob fails on the cryptography too, not only on the ledger's digest.
    row = next(r for r in rows(vault, t.action_id) if r["capture_id"] == moved)
    item = Sealed(moved, row["action_id"], row["kind"], row["key_id"], bytes(row["ephemeral_public"]),
                  bytes(row["nonce"]), bytes(row["ciphertext"]), row["plaintext_sha256"])
    key = read_private(auditor_key_file(vault))
    with pytest.raises(EvidenceCaptureTampered):
        open_sealed(key, item)
    assert open_sealed(key, dataclasses.replace(item, action_id=other.action_id))["title"] == other.arguments["title"]


# --- the console ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def console(vault: Stack) -> Iterator[Any]:
    users = vault.workdir / "console-users.json"
    tokens = {"audit-dana": add_user(users, "audit-dana", ConsoleRole.auditor),
              "ops-erin": add_user(users, "ops-erin", ConsoleRole.operator)}
    env_before = dict(vault.env)
    vault.env.update(auditor_env(vault))  # the console serving the page holds the auditor's key and role
    try:
        with running_console(vault, users, tokens) as running:
            yield running
    finally:
        vault.env.clear()
        vault.env.update(env_before)


def http_login(console: Any, user: str) -> urllib.request.OpenerDirector:
    jar = CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    page = opener.open(f"{console.url}/login").read().decode()
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    opener.open(f"{console.url}/login", urllib.parse.urlencode(
        {"user": user, "token": console.tokens[user], "csrf_token": csrf}).encode())
    return opener


def test_an_operator_gets_403_from_the_evidence_page(vault: Stack, pair: tuple[Any, Any], console: Any) -> None:
    t, _ = pair
    operator = http_login(console, "ops-erin")
    home = operator.open(f"{console.url}/").read().decode()
    assert "ops-erin" in home  # logged in; the POST carries the operator's own valid CSRF token
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', home).group(1)
    for method, data in (("GET", None), ("POST", urllib.parse.urlencode({"csrf_token": csrf}).encode())):
        with pytest.raises(urllib.error.HTTPError) as refused:
            operator.open(urllib.request.Request(f"{console.url}/evidence/{t.action_id}", data=data, method=method))
        assert refused.value.code == 403 and "console_forbidden" in refused.value.read().decode()
    assert all(e["actor"] != "ops-erin" for e in vault.timeline(t.action_id) if e["event"] == vault_store.READ)


def test_an_auditor_opens_the_captures_in_the_console_and_the_read_is_recorded(
        vault: Stack, pair: tuple[Any, Any], console: Any) -> None:
    t, _ = pair
    with chromium(vault) as browser:
        page = log_in(browser, console, "audit-dana")
        page.goto(f"/actions/{t.action_id}")
        page.click("#evidence-link")
        page.wait_for_url(f"**/evidence/{t.action_id}")  # a click does not wait for the page it opens
        page.wait_for_selector("#captured tr")
        assert page.locator("#captured tr").count() == 5  # a header and the four captures
        assert CANARY not in page.content()  # listed by digest; nothing opened yet
        shot(page, "evidence-listed")
        page.click("#open")
        page.wait_for_selector("section.capture")
        assert page.locator("section.capture").count() == 4 and t.arguments["title"] in page.content()
        shot(page, "evidence-opened")
    reads = [e for e in vault.timeline(t.action_id) if e["event"] == vault_store.READ and e["actor"] == "audit-dana"]
    assert len(reads) == 1 and reads[0]["evidence"]["via"] == "console" and len(reads[0]["evidence"]["opened"]) == 4
    assert proofline(vault, "verify-ledger").returncode == 0
