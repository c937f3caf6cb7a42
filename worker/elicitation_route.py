"""Route a server's elicitation to an approver and wait for the signed answer (``elicitation:
approver`` in the server's ``server_requests`` policy; ``proofline/elicitations.py`` says why).

Runs on a thread of its own, off the sessions' event loop, with a connection of its own: the
question must be visible to approvers while the call that asked it is still in flight, so it is
committed at once, and the worker's main connection (which holds the action's locks) is not used.
Every answer read back is verified again here (key, role, binding, schema): a row the worker did not
write is hostile until its signature says otherwise.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from ledger import elicitations as book
from ledger import store
from proofline.elicitations import MAX_QUESTION_BYTES, verify_answer
from proofline.errors import ElicitationRefused
from proofline.keys import load_keyring
from proofline.settings import Settings

log = logging.getLogger(__name__)

#: How often the question's chain is looked at while the call waits.
POLL_SECONDS = 0.25


def _bounded(value: Any) -> Any:
    text = json.dumps(value, default=str)
    if len(text.encode()) <= MAX_QUESTION_BYTES:
        return value
    raise ElicitationRefused(f"the question is larger than {MAX_QUESTION_BYTES} bytes")


class ApproverRoute:
    """Asks approvers; one per worker process (``settings`` read when a question comes)."""

    def __init__(self, settings: Callable[[], Settings], sleep: Callable[[float], None] = time.sleep) -> None:
        self._settings = settings
        self._sleep = sleep

    def ask(self, *, action_id: str, server: str, role: str, message: str, schema: Any,
            wait_seconds: float, request_id: str | None) -> dict[str, Any]:
        """The answer for the server (``{"action": "accept"|"decline"|"cancel", "content"?}``) and
        what the ledger should say of it (``elicitation_id``, ``approver``, ``refused``...)."""
        settings = self._settings()
        eid = uuid.uuid4().hex
        try:
            question = {"action_id": action_id, "server": server, "role": role, "request_id": request_id,
                        "message": _bounded(message), "requested_schema": _bounded(schema or {"type": "object"}),
                        "wait_seconds": wait_seconds}
        except ElicitationRefused as exc:
            return {"action": "cancel", "routed": "approver", "refused": exc.code, "detail": exc.detail}
        actor = settings.worker_id
        with store.connect(settings.database_url.get_secret_value()) as conn:
            with store.transaction(conn) as cur:
                book.ask_txn(cur, eid, actor, question)
            with conn.cursor() as cur:
                question = book.state(cur, eid)["question"]  # as recorded: what an answer is bound to
            log.info("elicitation routed to approvers", extra={"event": "elicitation_asked", "action_id": action_id,
                                                                "elicitation_id": eid, "server": server})
            started = time.monotonic()
            while True:
                with conn.cursor() as cur:
                    signed = book.state(cur, eid)["answer"]
                if signed is None and time.monotonic() - started >= wait_seconds:
                    with store.transaction(conn) as cur:
                        signed = book.expire_txn(cur, eid, actor, time.monotonic() - started)
                    if signed is None:
                        return {"action": "cancel", "routed": "approver", "elicitation_id": eid,
                                "expired_after_seconds": round(time.monotonic() - started, 3)}
                if signed is not None:
                    try:
                        answer = verify_answer(signed, load_keyring(settings.keyring_file, settings.environment),
                                               elicitation_id=eid, question=question)
                    except ElicitationRefused as exc:
                        # A recorded answer that does not verify ends the question: nobody's word.
                        return {"action": "cancel", "routed": "approver", "elicitation_id": eid,
                                "refused": exc.code, "detail": exc.detail}
                    return {"action": answer.action, **({"content": answer.content} if answer.content is not None else {}),
                            "routed": "approver", "elicitation_id": eid, "approver": answer.approver}
                self._sleep(POLL_SECONDS)
