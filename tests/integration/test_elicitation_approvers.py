"""A server's elicitation routed to approvers (``server_requests: {elicitation: approver}``): the
question is on the ledger while the call waits, an approver answers it with a signed statement
through the CLI, and the server receives exactly that answer; nobody answering in time is
``cancel``; an answer row the worker cannot verify is never passed on.

Real Postgres, Redis, a Celery worker and the sandboxed stdio system of record (2026-07-28: the
question arrives embedded in an ``InputRequiredResult`` and the call is sent again with the answer).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from ledger import elicitations as book
from ledger import store
from ledger.states import ActionStatus, Outcome
from proofline.canonical import canonical_bytes
from proofline.elicitations import _CONTEXT, ElicitationAnswer, question_hash, sign_answer
from proofline.keys import KeyRole, add_approver, load_signing_key
from proofline.signing import encode_signature
from proofline_kit import zygote
from proofline_kit.sor import store as sor
from proofline_kit.sor.asks import asks_path
from tests.conftest import Stack, build_stack, start_workers, teardown_stack, wait_for
from tests.helpers import evidence_of, ticket_env

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is needed")

WAIT_SECONDS = 15


@pytest.fixture(scope="module")
def asked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    tmp = Path(tmp_path_factory.mktemp("elicit"))
    stack = build_stack("stdio", tmp / "stack")
    try:
        spec = yaml.safe_load(stack.servers_file.read_text())
        spec["servers"]["sor"]["server_requests"] = {"elicitation": "approver", "elicitation_wait_seconds": WAIT_SECONDS}
        stack.servers_file.write_text(yaml.safe_dump(spec))
        add_approver(stack.settings.keyring_file, tmp / "alice.key", "alice@example.com", development=True)
        start_workers(stack)
        yield stack, tmp / "alice.key"
    finally:
        teardown_stack(stack)


def question_for(stack: Stack, action_id: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        with stack.conn.cursor() as cur:
            return next((q for q in book.pending(cur) if q["question"].get("action_id") == action_id), None)

    wait_for(lambda: find() is not None, 60, interval=0.2, what="the question on the ledger")
    return find()


def cli(stack: Stack, key: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**stack.env, "PROOFLINE_APPROVER_KEY_FILE": str(key)}
    return zygote.run([sys.executable, "-m", "proofline", "elicitations", *args], env=env, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def server_saw(stack: Stack) -> list[Any]:
    """What the server received for its elicitations, in order."""
    path = asks_path(str(stack.sor_db))
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [line["answer"] for line in lines if line["method"] == "elicitation/create"]


def run_asking(stack: Stack, answer) -> tuple[Any, dict[str, Any], list[Any], Any]:  # noqa: ANN001
    """Publish an action whose tool asks one question; ``answer(question)`` acts while the call waits."""
    before = len(server_saw(stack))
    env = ticket_env(stack)
    sor.set_fault(stack.sor_db, "create_ticket", "ask_elicitation")
    try:
        stack.publish(env)
        question = question_for(stack, env.action_id)
        answer(question)
        row = stack.wait_settled(env.action_id, timeout=120)
    finally:
        sor.clear_faults(stack.sor_db, "create_ticket")
    assert stack.effects(env.idempotency_key) == 1
    return row, question, server_saw(stack)[before:], env


def test_an_approvers_signed_answer_reaches_the_server_and_the_action_is_verified(asked) -> None:
    stack, key = asked

    def accept(question: dict[str, Any]) -> None:
        q = question["question"]
        assert (q["server"], q["role"]) == ("sor", "write")
        assert q["message"].startswith("Approve closing") and q["requested_schema"]["required"] == ["approve"]
        listed = cli(stack, key, "list")
        assert listed.returncode == 0 and question["elicitation_id"] in listed.stdout, listed.stderr
        done = cli(stack, key, "answer", question["elicitation_id"], "--accept", '{"approve": true}')
        assert done.returncode == 0, done.stderr
        assert "accept by alice@example.com" in done.stdout

    row, question, seen, env = run_asking(stack, accept)
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified), row.reason_code
    assert seen == [{"action": "accept", "content": {"approve": True}}]
    [request] = [r for r in evidence_of(stack, env.action_id, "server_request") if r["method"] == "elicitation/create"]
    assert request["answer"] == {"action": "accept", "routed": "approver", "elicitation_id": question["elicitation_id"],
                                 "approver": "alice@example.com"}
    # Answered once: a second answer is refused with its reason, and the question is no longer listed.
    again = cli(stack, key, "answer", question["elicitation_id"], "--decline")
    assert again.returncode != 0 and "elicitation_refused" in again.stderr and "answered" in again.stderr
    shown = cli(stack, key, "show", question["elicitation_id"])
    assert shown.returncode == 0 and "(answered)" in shown.stdout


def test_an_answer_outside_the_requested_schema_is_refused_before_it_is_recorded(asked) -> None:
    stack, key = asked

    def wrong_then_decline(question: dict[str, Any]) -> None:
        bad = cli(stack, key, "answer", question["elicitation_id"], "--accept", '{"approve": "yes"}')
        assert bad.returncode != 0 and "requested schema at approve" in bad.stderr, bad.stderr
        ok = cli(stack, key, "answer", question["elicitation_id"], "--decline")
        assert ok.returncode == 0, ok.stderr

    row, _, seen, _ = run_asking(stack, wrong_then_decline)
    assert seen == [{"action": "decline"}]
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)


def test_nobody_answering_in_time_is_a_cancel_and_a_late_answer_is_refused(asked) -> None:
    stack, key = asked
    row, question, seen, env = run_asking(stack, lambda q: None)
    assert seen == [{"action": "cancel"}], "\n".join(f"{e['event']} {json.dumps(e['evidence'], default=str)[:400]}"
                                                      for e in stack.timeline(env.action_id))
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
    [request] = [r for r in evidence_of(stack, env.action_id, "server_request") if r["method"] == "elicitation/create"]
    assert request["answer"]["action"] == "cancel" and float(request["answer"]["expired_after_seconds"]) >= WAIT_SECONDS
    late = cli(stack, key, "answer", question["elicitation_id"], "--accept", '{"approve": true}')
    assert late.returncode != 0 and "expired" in late.stderr


def test_an_answer_row_the_worker_cannot_verify_is_never_passed_on(asked) -> None:
    """A row written behind the CLI's back (an answer signed by a controller key under an approver's
    name) is refused by the worker; the server gets ``cancel``."""
    stack, _ = asked
    controller = load_signing_key(stack.settings.keys_dir / "controller.key", KeyRole.controller)

    def forge(question: dict[str, Any]) -> None:
        eid, q = question["elicitation_id"], question["question"]
        statement = ElicitationAnswer(elicitation_id=eid, action_id=q["action_id"], question_hash=question_hash(q),
                                      action="accept", content={"approve": True}, approver="alice@example.com",
                                      issued_at=datetime.now(UTC))
        document = statement.model_dump(mode="json")
        # Signed by a controller key under the approver's name: sign_answer itself refuses that key.
        with pytest.raises(Exception, match="may not answer"):
            sign_answer(statement, controller)
        forged = {"answer": document, "key_id": controller.key_id,
                  "signature": encode_signature(controller.sign(_CONTEXT + canonical_bytes(document)))}
        # Written with the operator role, as a row behind the CLI's back would be.
        with store.connect(stack.env["PROOFLINE_OPERATOR_DATABASE_URL"]) as conn, store.transaction(conn) as cur:
            book.answer_txn(cur, eid, forged, "intruder")

    row, question, seen, env = run_asking(stack, forge)
    assert seen == [{"action": "cancel"}]
    [request] = [r for r in evidence_of(stack, env.action_id, "server_request") if r["method"] == "elicitation/create"]
    assert request["answer"]["refused"] == "elicitation_refused" and "controller key" in request["answer"]["detail"]
    assert (row.status, row.outcome) == (ActionStatus.closed, Outcome.completed_verified)
