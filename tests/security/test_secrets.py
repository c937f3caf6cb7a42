"""Issue 7 item 6: secrets on the real stack (Postgres, Redis, Celery workers, the MCP system of
record over streamable HTTP). Canary secrets go in as arguments and come back in tool results;
afterwards none of them may be found in any text column of the ledger database, in the worker
logs, in what Celery task events (Flower's task view) carry, or in what Sentry receives."""

from __future__ import annotations

import gzip
import json
import shutil
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from ledger.redact import MARK
from ledger.states import Outcome
from proofline.canonical import canonical_bytes
from proofline.controller import describe_server, publish_message, signed_message
from proofline.keys import KeyRole, load_signing_key
from proofline.settings import ROOT
from proofline.signing import sign_document
from proofline_kit.sor import store as sor
from tests.conftest import Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import LosingBroker, new_account
from worker.faultpoints import arm, fired

TAG = uuid.uuid4().hex[:8]
CARD = "4111 1111 1111 1111"
CANARIES = {
    "api_key": f"CANARY-apikey-{TAG}",
    "access_token": f"CANARY-access-{TAG}",
    "client_secret": f"CANARY-client-{TAG}",
    "authorization": f"CANARY-bearer-{TAG}",
    "title": f"CANARY-title-{TAG}",          # declared sensitive by the (test) contract: args.title
    "refused": f"CANARY-refused-{TAG}",
    "sentry": f"CANARY-sentry-{TAG}",
}
NEEDLES = [*CANARIES.values(), CARD, CARD.replace(" ", "")]


class SentryReceiver:
    """A loopback HTTP endpoint standing in for Sentry: the worker's real SDK and HTTP transport
    post envelopes to it (DSN ``http://public@127.0.0.1:<port>/1``)."""

    def __init__(self) -> None:
        self.bodies: list[str] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    raw = gzip.decompress(raw)
                elif encoding == "br":
                    import brotli

                    raw = brotli.decompress(raw)
                received.append(raw.decode(errors="replace"))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *_: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # binds a port itself
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def dsn(self) -> str:
        return f"http://public@127.0.0.1:{self.server.server_address[1]}/1"

    def events(self) -> list[dict[str, Any]]:
        """Error events (envelope items of type ``event``)."""
        return self.items("event")

    def items(self, kind: str) -> list[dict[str, Any]]:
        """Envelope items of one type (``event``, ``transaction``)."""
        out = []
        for body in self.bodies:
            lines = body.split("\n")
            for header, payload in zip(lines[1::2], lines[2::2], strict=False):
                try:
                    if json.loads(header).get("type") == kind:
                        out.append(json.loads(payload))
                except ValueError:
                    continue
        return out

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class TaskEvents:
    """A real Celery event receiver, as Flower runs one: every ``task-received`` and ``task-sent``
    event (workers send the latter for what they publish: retries, verifications)."""

    def __init__(self, stack: Stack) -> None:
        self.received: list[dict[str, Any]] = []
        self.sent: list[dict[str, Any]] = []
        self.probes: list[dict[str, Any]] = []
        self.stack = stack
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        # Subscribed before anything is published: a probe event of our own, sent until it comes back.
        with stack.app.events.default_dispatcher() as dispatcher:
            wait_for(lambda: dispatcher.send("proofline-probe") or self.probes, 60, interval=0.2,
                     what="the event receiver to be subscribed")

    def _run(self) -> None:
        with self.stack.app.connection_for_read() as conn:
            self.recv = self.stack.app.events.Receiver(conn, handlers={"task-received": self.received.append,
                                                                        "task-sent": self.sent.append,
                                                                        "proofline-probe": self.probes.append})
            self.recv.capture(limit=None, timeout=None, wakeup=False)

    def stop(self) -> None:
        self.recv.should_stop = True
        self.thread.join(5)


@pytest.fixture(scope="module")
def sentry() -> Iterator[SentryReceiver]:
    receiver = SentryReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory, sentry: SentryReceiver) -> Iterator[Stack]:
    """The HTTP deployment with task events on, Sentry pointed at the loopback receiver, and a
    contracts directory whose ticket.create declares ``sensitive_fields: [args.title]``."""
    tmp = tmp_path_factory.mktemp("secrets")
    contracts = tmp / "contracts"
    shutil.copytree(ROOT / "contracts", contracts)
    doc = yaml.safe_load((contracts / "ticket.create.yaml").read_text())
    doc["sensitive_fields"] = ["args.title"]
    (contracts / "ticket.create.yaml").write_text(yaml.safe_dump(doc))
    stack = build_stack("http", tmp, extra_env={
        "PROOFLINE_CONTRACTS_DIR": str(contracts), "PROOFLINE_TASK_EVENTS": "true",
        "PROOFLINE_SENTRY_DSN": sentry.dsn})
    try:
        start_workers(stack)
        yield stack
    finally:
        teardown_stack(stack)


@pytest.fixture(scope="module")
def events(secure: Stack) -> Iterator[TaskEvents]:
    receiver = TaskEvents(secure)
    yield receiver
    receiver.stop()


def ticket(stack: Stack, title: str, **arguments: Any):
    return stack.envelope("ticket.create", arguments={"tenant": "acme", "title": title, "owner": "ops", **arguments},
                          target={"type": "ticket_queue", "id": "acme-ops"})


def database_hits(stack: Stack, needles: list[str]) -> list[tuple[str, str, str]]:
    """(table, column, needle) for every text, varchar, json or jsonb column of every table in the
    stack's database holding a needle, plus every bytea column holding its bytes."""
    hits = []
    with psycopg.connect(stack.admin_url, autocommit=True) as conn:
        columns = conn.execute(
            """SELECT table_name, column_name, data_type FROM information_schema.columns
               WHERE table_schema = 'public' AND data_type IN ('text', 'character varying', 'json', 'jsonb',
                                                                'bytea', 'ARRAY', 'USER-DEFINED')""").fetchall()
        assert {("actions", "envelope"), ("ledger_events", "evidence"), ("idempotency_records", "result"),
                ("actions", "sealed_message")} <= {(t, c) for t, c, _ in columns}
        for table, column, data_type in columns:
            for needle in needles:
                if data_type == "bytea":
                    sql = f'SELECT count(*) FROM "{table}" WHERE position(convert_to(%s, \'UTF8\') in "{column}") > 0'
                else:
                    sql = f'SELECT count(*) FROM "{table}" WHERE strpos("{column}"::text, %s) > 0'
                if conn.execute(sql, (needle,)).fetchone()[0]:
                    hits.append((table, column, needle))
    return hits


def worker_log_text(stack: Stack) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(stack.workdir.glob("worker-*.log")))


# --- the tests -------------------------------------------------------------------------------------


def test_canaries_reach_no_table_log_task_event_or_sentry_event(secure: Stack, events: TaskEvents,
                                                                sentry: SentryReceiver) -> None:
    stack = secure
    # Under secret names, and under a field only the contract declares sensitive (title); the
    # title comes back from the system of record in every verification read.
    env = ticket(stack, CANARIES["title"], api_key=CANARIES["api_key"], access_token=CANARIES["access_token"],
                 client_secret=CANARIES["client_secret"], Authorization=f"Bearer {CANARIES['authorization']}")
    # A card number and a bearer credential in free text, echoed back by the refund read.
    account = new_account(stack)
    version = sor.get_account(stack.sor_db, account)["account"]["version"]
    refund = stack.envelope("refund.issue", arguments={
        "account": account, "tenant": "acme", "amount_cents": 700,
        "reason": f"customer card {CARD}, token Bearer {CANARIES['authorization']}"},
        target={"type": "account", "id": account, "expected_version": version})
    # A correctly signed envelope of the wrong shape: the refusal text quotes the offending input.
    hostile = env.model_dump(mode="json")
    hostile["approval"] = {**hostile["approval"], "expires_at": "not a time", "password": CANARIES["refused"]}
    for e in (env, refund):
        stack.publish(e)
    stack.deliver(sign_hostile(stack, hostile))
    for e in (env, refund):
        row = stack.wait_settled(e.action_id, timeout=60)
        assert row.outcome == Outcome.completed_verified, (e.action_id, stack.events(e.action_id))
        assert stack.effects(e.idempotency_key) == 1
    wait_for(lambda: any("approval" in str(r["evidence"]) for r in stack.refusals()), 30, what="the refusal")

    # The records are there, redacted; the sealed original still holds the real values.
    row = stack.action(env.action_id)
    assert row.envelope["arguments"]["api_key"] == MARK and row.envelope["arguments"]["title"] == MARK
    assert row.signed_message["envelope"]["arguments"]["api_key"] == CANARIES["api_key"]
    assert row.recovery_data["after"]["ticket"]["title"] == MARK
    published = next(e for e in stack.timeline(env.action_id) if e["event"] == "published")["evidence"]
    assert published["arguments"]["client_secret"] == MARK and published["idempotency_key"] == env.idempotency_key
    lease = next(e for e in stack.timeline(env.action_id) if e["event"] == "lease_acquired")["evidence"]
    assert isinstance(lease["fencing_token"], int)  # identifiers the runtime needs are kept
    after = stack.action(refund.action_id).recovery_data["after"]["refund"]
    assert after["reason"] == f"customer card {MARK}, token Bearer {MARK}"
    assert "(" in str(stack.refusals()[-1]["evidence"])  # the refusal's text is there, scrubbed

    assert database_hits(stack, NEEDLES) == []
    logs = worker_log_text(stack)
    assert "proofline.execute" in logs and env.action_id in logs
    assert [n for n in NEEDLES if n in logs] == []
    shown = wait_for(lambda: [e for e in events.received if env.action_id in str(e.get("args"))
                              and e.get("name") == "proofline.execute"], 20, what="the execute task's received event")
    assert "sha256:" in str(shown[0]["args"]) and shown[0]["kwargs"] == "{}"
    assert [n for n in NEEDLES if n in json.dumps(events.received)] == []
    assert [n for n in NEEDLES if any(n in body for body in sentry.bodies)] == []


def sign_hostile(stack: Stack, document: dict[str, Any]) -> dict[str, Any]:
    """Sign an arbitrary document with the stack's controller key, as a controller holding it could."""
    key = load_signing_key(stack.settings.signing_key_file, KeyRole.controller, stack.settings.environment)
    return sign_document(document, key)


def test_an_error_in_a_task_reaches_sentry_without_secrets(secure: Stack, events: TaskEvents,
                                                            sentry: SentryReceiver) -> None:
    stack = secure
    env = ticket(stack, f"t-{TAG}-sentry", api_key=CANARIES["sentry"])
    before = fired(stack.faultpoints, "before_send")
    # An unforeseen exception inside the task, with the envelope in its frames and arguments.
    arm(stack.faultpoints, "before_send", remaining=1, action="raise")
    try:
        stack.publish(env)
        wait_for(lambda: fired(stack.faultpoints, "before_send") > before, 30, what="the fault point")

        def event() -> dict[str, Any] | None:
            for e in sentry.events():
                if "FaultPointRaised" in json.dumps(e.get("exception", {})):
                    return e
            return None

        captured = wait_for(event, 30, what="the Sentry event of the failed task")
    finally:
        arm(stack.faultpoints, "before_send", remaining=0)
    assert captured["environment"] == stack.settings.environment
    text = json.dumps(captured)
    assert '"vars"' not in text
    # The task's arguments (the whole envelope) are not in the event.
    assert captured["extra"]["celery-job"]["args"] == "[Filtered]"
    assert captured["logentry"]["message"].startswith("execute failed")
    assert [n for n in NEEDLES if any(n in body for body in sentry.bodies)] == []
    # Celery retried it (its own publish computes a full repr: the task view still shows a digest),
    # and the action still ends verified, once.
    row = stack.wait_settled(env.action_id, timeout=90)
    assert row.outcome == Outcome.completed_verified and stack.effects(env.idempotency_key) == 1
    assert len([e for e in events.received if env.action_id in str(e.get("args"))
                and e.get("name") == "proofline.execute"]) >= 2
    assert [n for n in NEEDLES if n in json.dumps(events.received)] == []
    # The worker's own publication of the retry, as a task-sent event.
    retried = [e for e in events.sent if env.action_id in str(e.get("args")) and e.get("name") == "proofline.execute"]
    assert retried and all(e["args"] == retried[0]["args"] and "sha256:" in e["args"] for e in retried)
    assert [n for n in NEEDLES if n in json.dumps(events.sent)] == []
    assert CANARIES["sentry"] not in worker_log_text(stack)
    assert database_hits(stack, [CANARIES["sentry"]]) == []


def test_a_lost_message_with_a_nul_is_redriven_byte_exactly_from_the_sealed_copy(secure: Stack) -> None:
    stack = secure
    env = ticket(stack, f"t-{TAG}-nul", note="line\x00after the NUL")
    message = stack.message(env)
    broker = LosingBroker()
    publish_message(stack.conn, broker, message, env, seal_key=stack.seal_key, settings=stack.settings)
    assert len(broker.lost) == 1
    row = stack.action(env.action_id)
    assert canonical_bytes(row.signed_message) == canonical_bytes(message)
    assert row.signed_message["envelope"]["arguments"]["note"] == "line\x00after the NUL"
    # The jsonb copy could not have held it: a re-drive from there would fail its signature.
    assert row.envelope["arguments"]["note"] != "line\x00after the NUL"
    settled = stack.wait_settled(env.action_id, timeout=60)
    assert settled.outcome == Outcome.completed_verified, stack.events(env.action_id)
    redriven = [e for e in stack.timeline(env.action_id) if e["event"] == "redriven"]
    assert redriven and redriven[0]["evidence"]["reason"] == "not_started"
    assert stack.effects(env.idempotency_key) == 1
    assert not [r for r in stack.refusals() if env.action_id in str(r["evidence"])]


def test_a_staging_envelope_is_refused_by_a_development_worker(secure: Stack) -> None:
    stack = secure
    assert ticket(stack, "t").environment == stack.settings.environment == "development"
    env = stack.envelope("ticket.create", arguments={"tenant": "acme", "title": f"t-{TAG}-env", "owner": "ops"},
                         target={"type": "ticket_queue", "id": "acme-ops"}, environment="staging")
    stack.publish(env)
    row = stack.wait_settled(env.action_id)
    assert (row.outcome, row.reason_code) == (Outcome.not_started, "environment_mismatch")
    assert stack.effects(env.idempotency_key) == 0
    assert "tool_called" not in stack.events(env.action_id)


def test_a_changed_description_is_a_changed_contract(secure: Stack) -> None:
    stack = secure
    approved = ticket(stack, f"t-{TAG}-approved-before")
    _, before = describe_server(stack.settings, "sor")
    schemas_before = tool_schemas(stack)
    stack.restart_writer(SOR_CONTRACT_VARIANT="3")
    try:
        _, after = describe_server(stack.settings, "sor")
        assert tool_schemas(stack) == schemas_before  # same name and schemas: only the description moved
        assert after["create_ticket"] != before["create_ticket"]
        assert {k: v for k, v in after.items() if k != "create_ticket"} == \
            {k: v for k, v in before.items() if k != "create_ticket"}
        stack.publish(approved)
        row = stack.wait_settled(approved.action_id)
        assert (row.outcome, row.reason_code) == (Outcome.not_started, "tool_contract_changed")
        assert stack.effects(approved.idempotency_key) == 0
    finally:
        stack.restart_writer()
    assert describe_server(stack.settings, "sor")[1] == before


def tool_schemas(stack: Stack) -> dict[str, Any]:
    import asyncio

    from mcp import Client

    from worker.connect import endpoint_target
    from worker.servers import server_named

    server = server_named(Path(stack.servers_file), "sor")

    async def probe() -> dict[str, Any]:
        async with Client(endpoint_target(server.write, Path(stack.servers_file).parent),
                          mode=server.write.protocol) as client:
            tools = await client.list_tools(cache_mode="bypass")
            return {t.name: (t.input_schema, t.output_schema, t.annotations) for t in tools.tools}

    return asyncio.run(probe())


def test_sign_helper_matches_the_controller(secure: Stack) -> None:
    """The hostile message above is signed exactly as the controller signs (else it would be
    refused for its signature, not for its shape, and prove nothing about refusal text)."""
    env = ticket(secure, "t")
    assert sign_hostile(secure, env.model_dump(mode="json")) == signed_message(secure.settings, env)


def test_a_role_password_is_stored_as_a_scram_verifier(tmp_path: Path) -> None:
    """ops/role_password.py, which the compose file runs after migrations (a role of our own)."""
    from ops.role_password import set_password
    from tests.conftest import ADMIN_URL

    role, password = f"pl_secret_test_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}"')
    try:
        set_password(ADMIN_URL, role, password)
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            stored, login = conn.execute("SELECT rolpassword, rolcanlogin FROM pg_authid WHERE rolname = %s",
                                         (role,)).fetchone()
        assert login and stored.startswith("SCRAM-SHA-256$") and password not in stored
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def test_the_compose_file_ships_no_secret_and_no_open_door() -> None:
    """docker compose is not installed here: the file is checked as data."""
    text = (ROOT / "docker-compose.yml").read_text()
    doc = yaml.safe_load(text)
    services = doc["services"]
    assert "PROOFLINE_SIGNING_KEYS" not in text and "proofline-development-key" not in text
    assert "POSTGRES_PASSWORD" not in services["postgres"]["environment"]
    pg = services["postgres"]["environment"]
    assert pg["POSTGRES_HOST_AUTH_METHOD"] == "scram-sha-256" and pg["POSTGRES_PASSWORD_FILE"].startswith("/run/secrets/")
    assert "requirepass" in str(services["redis"]["command"]) and "redis_password" in services["redis"]["secrets"]
    assert services["flower"]["ports"] == ["127.0.0.1:5555:5555"]
    assert "FLOWER_BASIC_AUTH" in services["flower"]["environment"]
    env = services["worker"]["environment"]
    assert env["PROOFLINE_KEYS_DIR"] == "/keys/execute" and env["PROOFLINE_ENVIRONMENT"] == "production"
    # The execute worker's keys: its worker key (evidence only), never a key that signs envelopes.
    split = str(services["keys"]["command"])
    assert "cp -p keyring.json seal.key worker.key /keys/execute/" in split
    assert services["worker"]["volumes"] == ["keys-execute:/keys/execute:ro"]
    assert all("keys-execute" not in str(services[s].get("volumes")) for s in ("beat", "flower", "recovery"))
    assert ":?" in env["PROOFLINE_DATABASE_URL"] and ":?" in env["PROOFLINE_BROKER_URL"]
    assert "keys generate" in str(services["keys"]["command"])
    for tool_server in ("sor", "sor-reader"):  # untrusted: no credentials, no keys
        assert "environment" not in services[tool_server] and "keys" not in str(services[tool_server])
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_remote_inspection_shows_no_arguments(secure: Stack) -> None:
    """``celery inspect scheduled|reserved|active`` (Flower's worker pages) on a task held for its
    countdown: Celery's own commands would return the whole envelope."""
    from worker.dispatch import CeleryDispatch

    stack = secure
    env = ticket(stack, f"t-{TAG}-inspect", api_key=CANARIES["api_key"])
    task_id = CeleryDispatch(stack.app).execute(stack.message(env), countdown=30)
    try:
        def held() -> list[dict[str, Any]]:
            answers = stack.app.control.inspect(timeout=2.0).scheduled() or {}
            return [e for entries in answers.values() for e in entries if e["request"]["id"] == task_id]

        entry = wait_for(held, 20, what="the worker to hold the countdown task")[0]
        assert env.action_id in str(entry["request"]["args"]) and "sha256:" in str(entry["request"]["args"])
        answers = [stack.app.control.inspect(timeout=2.0).scheduled(), stack.app.control.inspect(timeout=2.0).reserved(),
                   stack.app.control.inspect(timeout=2.0).active()]
        assert [n for n in NEEDLES if n in json.dumps(answers, default=str)] == []
    finally:
        stack.app.control.revoke(task_id)


def test_operator_text_is_stored_scrubbed(secure: Stack) -> None:
    """Cancellation reasons, kill switch reasons and revocation reasons are free text an operator
    types (or pastes): they are stored through the same value patterns."""
    from ledger import store
    from ledger.states import KillSwitchScope
    from proofline.controller import publish
    from recovery.cancel import cancel
    from recovery.operator import clear_switch, set_switch
    from worker.dispatch import CeleryDispatch

    stack = secure
    held = ticket(stack, f"t-{TAG}-held")
    publish(stack.settings, stack.conn, stack.app, held, hold=True)
    pasted = f"customer card {CARD} / Authorization: Bearer {CANARIES['authorization']}x"
    # Operator commands run as the operator role (docs/concepts/database-roles.md).
    assert cancel(stack.operator, CeleryDispatch(stack.app), held.action_id, "ops@example.com", pasted)["accepted"]
    value = f"nothing@nobody-{TAG}"
    set_switch(stack.operator, KillSwitchScope.tool_tenant, value, "ops@example.com", pasted)
    clear_switch(stack.operator, KillSwitchScope.tool_tenant, value, "ops@example.com", pasted)
    with store.transaction(stack.operator) as cur:
        store.revoke_identity_txn(cur, f"agent:gone-{TAG}", "ops@example.com", pasted)
    with stack.conn.cursor() as cur:
        cur.execute("SELECT cancel_reason FROM actions WHERE action_id = %s", (held.action_id,))
        assert cur.fetchone()["cancel_reason"] == f"customer card {MARK} / Authorization: Bearer {MARK}"
    assert database_hits(stack, NEEDLES) == []
