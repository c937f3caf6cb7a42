"""One typed settings object, read from environment variables prefixed ``PROOFLINE_``.

``celeryconfig.py``, the worker, the controller and the CLI all read this object; nothing else
reads the environment.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    """Runtime settings. Every field maps to ``PROOFLINE_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="PROOFLINE_", frozen=True, extra="ignore")

    #: "production" refuses test-only fault points (worker/faultpoints.py) whatever else is set.
    environment: str = "development"

    #: Postgres for the ledger, as the runtime role (no UPDATE/DELETE on ledger events).
    database_url: str = "postgresql://proofline_runtime@127.0.0.1:5432/proofline"
    #: Postgres as a role that may run migrations.
    admin_database_url: str | None = None
    #: Celery broker. ``redis://`` in production; ``sqla+postgresql+psycopg://`` needs no server.
    broker_url: str = "redis://127.0.0.1:6379/0"

    #: HMAC keys by key id, for envelope signatures. JSON object in the environment.
    signing_keys: dict[str, str] = Field(default_factory=lambda: {"dev-1": "proofline-development-key"})
    #: The key id controllers sign new envelopes with.
    active_key_id: str = "dev-1"

    servers_file: Path = ROOT / "servers.yaml"
    contracts_dir: Path = ROOT / "contracts"
    #: Policy versions this runtime still accepts.
    accepted_policy_versions: list[int] = Field(default_factory=lambda: [5])

    #: A lease not renewed for this long is expired (database clock).
    lease_ttl_seconds: float = 10.0
    heartbeat_seconds: float = 2.0
    #: How long an idempotency record answers for its key.
    replay_window_seconds: float = 7 * 24 * 3600
    #: No envelope may carry a deadline further away than this; the broker visibility timeout is longer.
    max_deadline_seconds: float = 3600.0
    #: At most this many progress notifications per call are recorded in the ledger.
    progress_events_limit: int = 20

    #: How often Celery beat runs the reconciler.
    reconcile_interval_seconds: float = 10.0
    #: A published action not started (or a recovery not decided) after this long is re-driven.
    redrive_after_seconds: float = 60.0
    #: A verification with no progress for this long is started again.
    verify_stall_seconds: float = 180.0

    #: Send Celery task events from the start (Flower also enables them at runtime).
    task_events: bool = False

    #: Errors go to Sentry when set.
    sentry_dsn: str | None = None

    worker_id: str = Field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")

    # --- containment: messages and deliveries ---
    #: A task message delivered this many times without reaching a recorded outcome (its worker
    #: process died each time) is moved to the ``dead_letter`` queue on the next delivery.
    max_unsettled_deliveries: int = 3
    #: Retries of one delivery (database away, unexpected error, target busy) before it is recorded
    #: as abandoned and left to the reconciler.
    task_retry_limit: int = 50
    #: The reconciler closes a still-published action this long after its deadline.
    deadline_grace_seconds: float = 60.0
    #: Pool processes are replaced after this many tasks, or once they hold this much memory (KiB).
    worker_max_tasks_per_child: int = 1000
    worker_max_memory_per_child_kb: int = 512 * 1024

    @property
    def visibility_timeout(self) -> int:
        """Broker visibility timeout: longer than the longest absolute deadline, so Redis never redelivers a live task."""
        return int(self.max_deadline_seconds * 2 + 60)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
