"""The Celery app and its tasks, registered under stable names that controllers ``send_task`` to."""

from __future__ import annotations

import gc
import logging
from typing import Any

import psycopg
from celery import Celery, signals

from ledger.redact import POLICY, current_redactor, for_message
from proofline.errors import ConfigurationError, ProoflineError
from proofline.settings import get_settings, reveal
from proofline.telemetry.logs import install as install_log_format
from proofline.telemetry.metrics import sweep_finished
from recovery.settle import after_settle
from worker import heap as _heap  # noqa: F401 - freezes the start-up heap of each worker process
from worker import host_process, preload
from worker import node as _node  # noqa: F401 - hands the node name down to the pool processes
from worker.dead_letters import DeadLetterRecorder
from worker.dispatch import CeleryDispatch
from worker.execute import RetryLater, execute
from worker.held_events import HeldEventsFlush
from worker.mcp_client import close_sessions
from worker.observability import init_sentry, install_log_scrubbing
from worker.runtime import runtime
from worker.sandbox_probe import bwrap_problem
from worker.sandbox_reader import reap_orphans
from worker.servers import check_sandbox_policy, load_servers, sandboxed_identities
from worker.summary import task_line, with_outcome
from worker.task_base import GuardedTask
from worker.telemetry import install as install_telemetry
from worker.wire import CONTENT_TYPE

log = logging.getLogger(__name__)

EXECUTE = "proofline.execute"
COMPENSATE = "proofline.compensate"
VERIFY = "proofline.verify"
RECHECK = "proofline.recheck"
READ = "proofline.read"

app = Celery("proofline", task_cls="worker.task_base:GuardedTask")
app.config_from_object("worker.celery_config")
# On RabbitMQ, what the broker dead-lettered is recorded in the ledger (a no-op step elsewhere).
app.steps["consumer"].add(DeadLetterRecorder)
# With task events on, events a failed publish held back are sent again within seconds.
app.steps["consumer"].add(HeldEventsFlush)
# The control plane (revoke, ping) stays plain JSON; tasks use the guarded wire format only.
app.control.mailbox.accept = ["json", CONTENT_TYPE]
app.control.mailbox.serializer = "json"

_settings = get_settings()
#: Retries of one delivery, explicit: ``max_retries=None`` in ``Task.retry`` means the task's
#: default (3), not "unlimited". Transient pre-call failures stop earlier, at the envelope's
#: deadline (worker/execute.py); past this limit the delivery is recorded as abandoned and the
#: reconciler re-drives the action from the ledger.
RETRY_POLICY: dict[str, Any] = {
    "max_retries": _settings.task_retry_limit,
    "autoretry_for": (Exception,),
    "dont_autoretry_for": (RetryLater,),
    "retry_backoff": 1,
    "retry_backoff_max": 30,
    "retry_jitter": True,
}
TASK_OPTIONS: dict[str, Any] = {"bind": True, "acks_late": True, "reject_on_worker_lost": True, "ignore_result": True,
                                **RETRY_POLICY}


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _scrub_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    install_log_scrubbing(*([logger] if logger is not None else []))
    # After the scrubbing filter: the action's fields and the extras are written as it left them.
    install_log_format(get_settings().log_format, *([logger] if logger is not None else []))
    # The MCP SDK's HTTP client logs every request at INFO (three lines per action, each carrying
    # the action's fields): the ledger and the spans already hold them. Its warnings still show.
    logging.getLogger("httpx2").setLevel(logging.WARNING)


@signals.worker_process_shutdown.connect
def _close(**_: Any) -> None:
    close_sessions()


@signals.worker_init.connect
@signals.worker_process_init.connect
def _reap_sandbox_files(**_: Any) -> None:
    """Remove the audit folders and status files of pool processes that were killed (a replaced
    pool process starts here; its predecessor could not clean up): worker/sandbox_reader.py."""
    removed = reap_orphans()
    if removed:
        log.warning("removed sandbox files of dead worker processes", extra={
            "event": "sandbox_files_reaped", "count": len(removed)})


@signals.worker_init.connect
def _check_sandboxes(**_: Any) -> None:
    """Refuse to start (production) with an unsandboxed stdio server that gives no reason, or
    (anywhere) with a sandboxed one when bwrap cannot start a sandbox here; log the reasons of the
    unsandboxed servers that give one."""
    settings = get_settings()
    try:
        reasons = check_sandbox_policy(settings.servers_file, settings.environment)
        # The same probe as `proofline worker` and doctor (proofline/setup_checks.py), for a worker
        # started with `celery -A worker.tasks worker`: no sandbox, no start.
        sandboxed = sandboxed_identities(settings.servers_file)
        problem = bwrap_problem() if sandboxed else None
        if problem:
            raise ConfigurationError(f"{settings.servers_file}: {', '.join(sandboxed)} run sandboxed but {problem}")
    except ProoflineError as exc:
        # Celery logs and ignores exceptions from signal receivers; SystemExit stops the worker.
        log.critical("refusing to start: %s", exc, extra={"event": "sandbox_policy_refused"})
        raise SystemExit(f"proofline worker refuses to start: {exc}") from None
    for identity, reason in reasons.items():
        log.warning("stdio server runs unsandboxed", extra={"event": "sandbox_disabled", "identity": identity,
                                                            "reason": reason})


@signals.worker_init.connect
def _preload(**_: Any) -> None:
    """Warm what every pool process would otherwise load on its first action (worker/preload.py)."""
    settings = get_settings()
    preload.modules()
    preload.configuration(settings.contracts_dir, settings.servers_file)
    gc.freeze()  # what was just loaded joins the frozen start-up heap (worker/heap.py)


@signals.worker_init.connect
def _start_session_host(**_: Any) -> None:
    """Start the node's session host before the pool forks (worker/session_host.py), when a stdio
    server is configured and ``stdio_session_host`` is on."""
    settings = get_settings()
    if not settings.stdio_session_host:
        return
    try:
        servers = load_servers(settings.servers_file)
    except ProoflineError:
        return  # refused elsewhere, with the file's own message
    if any(e.transport == "stdio" for s in servers.values() for e in (s.write, s.read)):
        host_process.start(settings.stdio_session_spares)


@signals.worker_shutdown.connect
def _stop_session_host(**_: Any) -> None:
    host_process.stop()


#: Worker and recovery are wired together here, and only here: a settled action's follow-ups.
dispatch = CeleryDispatch(app, on_settled=after_settle)


def _delivery(task: Any) -> dict[str, Any]:
    info = task.request.delivery_info or {}
    return {"task_id": task.request.id, "redelivered": bool(info.get("redelivered")),
            "retries": task.request.retries}


@app.task(name=EXECUTE, **TASK_OPTIONS)
def execute_task(self, *args: Any, **kwargs: Any) -> str:
    return _execute(self, args, kwargs)


@app.task(name=COMPENSATE, **TASK_OPTIONS)
def compensate_task(self, *args: Any, **kwargs: Any) -> str:
    """A recovery action: the same governed path as any action, on its own queue."""
    return _execute(self, args, kwargs)


def _execute(self: Any, args: tuple, kwargs: dict) -> str:
    """Execute one envelope. Any argument shape is accepted so that malformed input is refused
    and recorded by the runtime instead of failing inside Celery."""
    message = args[0] if len(args) == 1 and not kwargs else {"args": list(args), "kwargs": kwargs}
    # Until the envelope is validated, scrub logs and errors with what the message itself declares.
    current_redactor.set(for_message(message))
    rt = runtime()
    try:
        return task_line(with_outcome(rt.conn, execute(rt, message, _delivery(self), dispatch)))
    except RetryLater as later:
        # Recorded already (target busy, read unavailable): deliver the same envelope again later.
        raise self.retry(countdown=later.countdown, exc=later) from None
    except psycopg.OperationalError:
        # The database went away mid-task: nothing past the last commit happened as far as the
        # ledger knows. Drop the connection; Celery's autoretry delivers it again with backoff.
        rt.reset_connection()
        log.warning("database unavailable; retrying", extra={"event": "db_unavailable"})
        raise
    except Exception as exc:
        # A defect or an unforeseen failure must not lose the action: the claim-first idempotency
        # record makes running the same envelope again safe, so it is retried (bounded). Only the
        # error is logged, never the envelope.
        # The traceback goes to the log and Sentry (both scrubbed: worker/observability.py), so an
        # operator sees the defect; Sentry events carry no local variables.
        log.error("execute failed; retrying: %s", type(exc).__name__, exc_info=True,
                  extra={"event": "execute_error"})
        raise


def _follow_up(self: Any, step: str, action_id: str, fn: Any) -> str:
    """Run a follow-up stage (verify, recover), retried by Celery's autoretry (bounded, backoff);
    past the limit the reconciler re-drives the action from the ledger."""
    current_redactor.set(POLICY)  # the stage sets its action's redactor once it has loaded it
    rt = runtime()
    try:
        result = fn(rt, action_id, dispatch)
        # The connection is taken after the stage ran: a stage that read the system of record for
        # longer than the session's idle timeout has left the one it started with closed by Postgres.
        return task_line(with_outcome(rt.conn, result))
    except psycopg.OperationalError:
        rt.reset_connection()
        raise
    except Exception as exc:
        log.error(f"{step} failed; retrying: %s", type(exc).__name__,
                  extra={"event": f"{step}_error", "action_id": action_id})
        raise


@app.task(name=VERIFY, **TASK_OPTIONS)
def verify_task(self, action_id: str) -> str:
    from recovery.verify import verify

    return _follow_up(self, "verify", action_id, verify)


@app.task(name=RECHECK, **TASK_OPTIONS)
def recheck_task(self, check_id: int, attempt: int) -> dict[str, Any]:
    """A post-condition re-check the reconciler claimed (``recovery/recheck.py``); its row and the
    claim's attempt are its idempotency: a second delivery of the same claim finds it finished."""
    from recovery.recheck import recheck

    return _follow_up(self, "recheck", str(check_id), lambda rt, _, d: recheck(rt, int(check_id), int(attempt), d))


@app.task(name=READ, bind=True, acks_late=True, ignore_result=True)
def read_task(self, message: Any = None) -> str:
    """A gateway read (``worker/contract_read.py``): verified, read once, answered in the ledger. Not
    retried: a read the system of record could not answer is answered ``read_unavailable``."""
    from worker.contract_read import answer_read

    current_redactor.set(POLICY)
    rt = runtime()
    try:
        return str(answer_read(rt, message))
    except psycopg.OperationalError:
        rt.reset_connection()
        raise


@app.task(name="proofline.recover", **TASK_OPTIONS)
def recover_task(self, action_id: str) -> str:
    from recovery.recover import recover

    return _follow_up(self, "recover", action_id, recover)


class _NoEvents:
    """An event dispatcher that publishes nothing (for a sweep's ``task-sent`` event)."""

    def publish(self, *args: Any, **kwargs: Any) -> None:
        return None


class SweepTask(GuardedTask):
    """A routine sweep: beat sends one every few seconds, and its events would bury the actions'
    own tasks in Flower. It sends none: not when it is published (``task-sent``), nor while it
    runs (``send_events``). What a sweep re-drove is in the ledger (``redriven`` events) and in the
    worker's log (``reconcile_sweep``)."""

    abstract = True
    send_events = False

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        options.setdefault("event_dispatcher", _NoEvents())
        return super().apply_async(args, kwargs, **options)


@app.task(name="proofline.reconcile", base=SweepTask, ignore_result=True)
def reconcile_task() -> dict[str, Any]:
    """One reconciler sweep for the whole fleet: every node's beat sends this task each period, and
    the first copy to claim the period runs it (``recovery/sweep_gate.py``); the others skip. The
    run is one transaction (``recovery/reconciler.py``, ``sweep_once``)."""
    from recovery.reconciler import sweep_once

    current_redactor.set(POLICY)
    rt = runtime()
    conn = rt.conn
    # The run's transaction (and the sweep's lock with it) lives on this connection: it must not be
    # swapped for a fresh one while the sweep runs.
    rt.holding_locks = True
    try:
        run = sweep_once(conn, dispatch, rt.settings)
    except psycopg.OperationalError:
        rt.reset_connection()
        raise
    finally:
        rt.holding_locks = False
    if run is None:
        return {"skipped": 1}
    # Authority grown on evidence: a regression demotes its action type (recovery/authority_watch.py).
    from recovery.authority_watch import watch

    watch(conn, rt.settings, rt.settings.worker_id)
    sweep_finished()
    return run.counts


@app.task(name="proofline.checkpoint", base=SweepTask, ignore_result=True)
def checkpoint_task() -> dict[str, Any]:
    """Sign and store a ledger checkpoint. Only processes holding the ledger key should consume the
    ``checkpoint`` queue; one that does not refuses the task with a clear code and keeps running."""
    from ledger.checkpoint import write_checkpoint
    from ledger.store import connect
    from proofline.errors import CheckpointExists, LedgerKeyUnavailable

    settings = get_settings()
    try:
        # A connection of its own: a first checkpoint of a large ledger outlasts the worker
        # connection's idle timeouts, and nothing it does should disturb a lease holder's session.
        with connect(reveal(settings.database_url), application_name=f"proofline-checkpoint-{settings.worker_id}",
                     connect_timeout=10) as conn:
            return write_checkpoint(conn, settings, actor=settings.worker_id)
    except LedgerKeyUnavailable as exc:
        log.error("checkpoint refused: this worker holds no ledger key",
                  extra={"event": "checkpoint_refused", "reason_code": exc.code, "detail": exc.detail})
        return {"refused": exc.code}
    except CheckpointExists as exc:
        # Another checkpointer wrote this number first: its checkpoint stands, ours is not needed.
        log.info("checkpoint already written by another process", extra={"event": "checkpoint_exists"})
        return {"skipped": exc.code}


@app.task(name="proofline.prune", base=SweepTask, ignore_result=True)
def prune_task() -> dict[str, Any]:
    """Prune what retention allows (ledger/retention.py), as the pruning role: without
    ``pruner_database_url`` the task refuses, since no runtime role may remove anything."""
    from ledger.retention import prune
    from ledger.store import connect
    from proofline.errors import ConfigurationError

    settings = get_settings()
    url = reveal(settings.pruner_database_url)
    if not url:
        exc = ConfigurationError("prune_interval_seconds is set but pruner_database_url is not")
        log.error("prune refused", extra={"event": "prune_refused", "reason_code": exc.code, "detail": exc.detail})
        return {"refused": exc.code}
    with connect(url, application_name=f"proofline-prune-{settings.worker_id}", connect_timeout=10) as conn:
        done = prune(conn, settings, actor=settings.worker_id)
    return {k: v for k, v in done.items() if k != "heads"}


init_sentry(get_settings())
install_log_scrubbing()
install_telemetry()
