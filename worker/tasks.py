"""The Celery app and its tasks, registered under stable names that controllers ``send_task`` to."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from celery import Celery, signals

from proofline.settings import get_settings
from worker.execute import RetryLater, execute
from worker.mcp_client import close_sessions
from worker.runtime import runtime

log = logging.getLogger(__name__)

EXECUTE = "proofline.execute"
#: Deliveries of one message after unexpected errors; past this, the reconciler re-drives it.
UNEXPECTED_RETRIES = 5
VERIFY = "proofline.verify"

app = Celery("proofline")
app.config_from_object("celeryconfig")


def _init_sentry() -> None:
    dsn = get_settings().sentry_dsn
    if dsn:
        import sentry_sdk

        sentry_sdk.init(dsn=dsn)


@signals.worker_process_shutdown.connect
def _close(**_: Any) -> None:
    close_sessions()


def enqueue_verify(action_id: str) -> None:
    app.send_task(VERIFY, args=[action_id], queue="verify")


def _delivery(task: Any) -> dict[str, Any]:
    info = task.request.delivery_info or {}
    return {"task_id": task.request.id, "redelivered": bool(info.get("redelivered")),
            "retries": task.request.retries}


@app.task(name=EXECUTE, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def execute_task(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Execute one envelope. Any argument shape is accepted so that malformed input is refused
    and recorded by the runtime instead of failing inside Celery."""
    message = args[0] if len(args) == 1 and not kwargs else {"args": list(args), "kwargs": kwargs}
    rt = runtime()
    try:
        return execute(rt, message, _delivery(self), enqueue_verify)
    except RetryLater as later:
        raise self.retry(countdown=later.countdown, max_retries=None) from None
    except psycopg.OperationalError as exc:
        # The database went away mid-task: nothing past the last commit happened as far as the
        # ledger knows. Drop the connection and deliver again; the idempotency record decides.
        rt.reset_connection()
        log.warning("database unavailable; retrying", extra={"event": "db_unavailable"})
        raise self.retry(countdown=1.0, max_retries=None, exc=exc) from None
    except Exception as exc:
        # A defect or an unforeseen failure must not lose the action: the claim-first idempotency
        # record makes running the same envelope again safe, so deliver it again (bounded).
        log.exception("execute failed; retrying", extra={"event": "execute_error"})
        raise self.retry(countdown=2.0, max_retries=UNEXPECTED_RETRIES, exc=exc) from None


@app.task(name=VERIFY, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def verify_task(self, action_id: str) -> dict[str, Any]:
    from recovery.verify import verify

    rt = runtime()
    try:
        return verify(rt, action_id)
    except psycopg.OperationalError as exc:
        rt.reset_connection()
        raise self.retry(countdown=1.0, max_retries=None, exc=exc) from None
    except Exception as exc:
        log.exception("verify failed; retrying", extra={"event": "verify_error", "action_id": action_id})
        raise self.retry(countdown=2.0, max_retries=UNEXPECTED_RETRIES, exc=exc) from None


_init_sentry()
