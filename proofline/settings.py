"""One typed settings object, read from environment variables prefixed ``PROOFLINE_``.

``worker/celery_config.py`` (the Celery configuration), the worker, the controller and the CLI all read this object; nothing else
reads the environment.
"""

from __future__ import annotations

import hashlib
import os
import socket
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Where the ``proofline`` package is installed (site-packages, or the checkout in development).
ROOT = Path(__file__).resolve().parent.parent
#: The demo's contracts and servers file, shipped inside the package: the defaults when
#: ``PROOFLINE_CONTRACTS_DIR`` / ``PROOFLINE_SERVERS_FILE`` are not set.
PACKAGED_CONTRACTS_DIR = Path(__file__).resolve().parent / "defaults" / "contracts"
PACKAGED_SERVERS_FILE = Path(__file__).resolve().parent / "defaults" / "servers.yaml"


def default_state_dir(package: Path = Path(__file__).resolve().parent) -> Path:
    """``$XDG_STATE_HOME/proofline/install-<hash>``, else ``~/.local/state/proofline/install-<hash>``:
    one folder per installed copy of Proofline (a checkout, a virtual environment; the hash is of
    the package's folder), so two checkouts never share a demo's database. Never the current
    directory."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "proofline" / f"install-{hashlib.sha256(str(package).encode()).hexdigest()[:12]}"


class Environment(StrEnum):
    """Where a deployment runs (``PROOFLINE_ENVIRONMENT``), spelled exactly: any other value is
    refused at start, so a typo can never switch the production rules off."""

    #: A developer's machine: development keys, one process with every role and unsandboxed servers
    #: are accepted (each with a warning or a recorded reason).
    development = "development"
    #: Automated tests: as development; test-only fault points may be enabled.
    test = "test"
    #: A rehearsal of production on its own keys and data: development's rules, no fault points.
    staging = "staging"
    #: Every production rule on: no development keys, execution and recovery in separate processes,
    #: stdio servers sandboxed (and audited) unless the servers file gives a reason.
    production = "production"


#: The only environments in which test-only fault points may be switched on.
FAULT_POINT_ENVIRONMENTS = (Environment.development, Environment.test)


class Settings(BaseSettings):
    """Runtime settings. Every field maps to ``PROOFLINE_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="PROOFLINE_", frozen=True, extra="ignore")

    #: This deployment's environment: workers refuse envelopes approved for another one
    #: (``environment_mismatch``), and only development/test may enable fault points.
    environment: Environment = Environment.development

    @field_validator("environment", mode="before")
    @classmethod
    def _known_environment(cls, value: object) -> object:
        if isinstance(value, str) and value not in {e.value for e in Environment}:
            raise ValueError(f"{value!r} is not an environment: use one of {', '.join(e.value for e in Environment)}, "
                             "spelled exactly (lower case, no spaces)")
        return value

    #: Postgres for the ledger, as this process's own role (docs/concepts/database-roles.md); the default
    #: proofline_runtime is the development role (worker + recovery).
    #: URLs may hold passwords: they are ``SecretStr`` (never shown by repr, logs or Sentry); read
    #: them with :func:`reveal` where a connection is opened.
    database_url: SecretStr = SecretStr("postgresql://proofline_runtime@127.0.0.1:5432/proofline")
    #: Postgres as a role that may run migrations.
    admin_database_url: SecretStr | None = None
    #: Celery broker: ``redis://`` or ``amqp://`` (RabbitMQ, quorum queues: docs/how-to/rabbitmq.md);
    #: ``sqla+postgresql+psycopg://`` needs no server. A RabbitMQ cluster is a ``;``-separated list of
    #: its nodes' URLs (``amqp://a//;amqp://b//``): publishers and consumers fail over along it.
    broker_url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")

    #: The MCP servers file. Default: the demo's, shipped in the package.
    servers_file: Path = PACKAGED_SERVERS_FILE
    #: The folder of action contracts (``*.yaml``). Default: the demo's, shipped in the package.
    contracts_dir: Path = PACKAGED_CONTRACTS_DIR
    #: Files this process writes when no other setting names a place: the demo's data, ledger
    #: checkpoints, and the working folders of the packaged servers file.
    state_dir: Path = Field(default_factory=default_state_dir)
    #: The pinned contract registry (``proofline contracts pin``); default ``pins.json`` in contracts_dir.
    pins_file: Path | None = None
    #: Policy versions this runtime still accepts.
    accepted_policy_versions: list[int] = Field(default_factory=lambda: [5])

    #: The execute task reads the system of record once itself, right after a call the server
    #: reported complete, and records the result and a proven ``expected`` verdict in one commit;
    #: any other first read (and every other outcome) goes to the verification task. False: every
    #: verification is its own task.
    inline_verification: bool = True
    #: A lease not renewed for this long is expired (database clock).
    lease_ttl_seconds: float = 10.0
    #: How often a worker renews the lease it holds (and keeps its lock session busy).
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
    #: ...unless its queue still holds messages (a backlog, not a loss) and it is younger than
    #: this: the longest a message lost behind a backlog goes unnoticed.
    redrive_backlog_max_seconds: float = Field(default=900.0, ge=0)
    #: The fleet's re-drive budget: of the published actions nobody started, a periodic sweep
    #: re-sends at most twice what the workers drained since the previous sweep (executions
    #: started over the last 30 s or six periods, whichever is longer, as a rate), times this
    #: share, less its own re-sends still waiting (``recovery/redrive_budget.py``).
    redrive_budget_share: float = Field(default=1.0, gt=0)
    #: ...and never fewer than this many per sweep, so lost messages are still re-sent while
    #: nothing drains (at most 200, a sweep's limit).
    redrive_budget_min: int = Field(default=10, ge=1, le=200)
    #: A verification with no progress for this long is started again.
    verify_stall_seconds: float = 180.0
    #: A post-condition re-check sent to a worker and not finished after this long (the worker
    #: died) is claimed again by the reconciler and sent once more.
    recheck_claim_seconds: float = Field(default=300.0, gt=0)

    #: Send Celery task events from the start (Flower also enables them at runtime).
    task_events: bool = False

    #: Errors go to Sentry when set.
    sentry_dsn: SecretStr | None = None
    #: The release Sentry events (and traces' service.version) carry; default: the package version.
    release: str | None = None
    #: Sentry performance tracing: the fraction of tasks traced (0 or unset: errors only).
    sentry_traces_sample_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    #: Log lines as text (Celery's format plus the action's fields) or one JSON object per line.
    log_format: Literal["text", "json"] = "text"
    #: Tenants that metrics label by name (comma-separated, at most 100); every other tenant is
    #: ``tenant="other"``, so a metric's series stay bounded however many tenants send actions.
    telemetry_tenants: str = ""

    @field_validator("telemetry_tenants")
    @classmethod
    def _few_tenants(cls, value: str) -> str:
        if len({t.strip() for t in value.split(",") if t.strip()}) > 100:
            raise ValueError("names more than 100 tenants: label fewer, the others are counted as 'other'")
        return value

    @property
    def metric_tenants(self) -> frozenset[str]:
        """The tenants named in ``telemetry_tenants`` (the labels a metric may carry)."""
        return frozenset(t.strip() for t in self.telemetry_tenants.split(",") if t.strip())

    #: The Celery node this process belongs to (``name@host``); set by the worker's main process at
    #: start for its pool processes (``worker/node.py``), so the ledger's actors name the node.
    node_name: str | None = None
    #: Who this process is in the ledger, leases and sweep runs: ``<node or host>:<pid>``.
    worker_id: str = Field(default_factory=lambda data: f"{data.get('node_name') or socket.gethostname()}:{os.getpid()}")

    # --- ledger checkpoints ---
    #: Directory of key files (``proofline keys generate --dir``); other *_file settings default into it.
    keys_dir: Path | None = None
    #: The ledger's Ed25519 signing key (JSON, role "ledger"); default ``keys_dir/ledger.key``.
    ledger_key_file: Path | None = None
    #: Where signed checkpoints are appended, outside Postgres; default ``checkpoints`` in state_dir.
    checkpoint_dir: Path | None = None
    #: How often Celery beat asks for a checkpoint (task ``proofline.checkpoint``, queue ``checkpoint``).
    checkpoint_interval_seconds: float = 300.0
    # --- retention (ledger/retention.py; docs/how-to/retention-and-export.md) ---
    #: Days a settled record of class ``short`` is kept before ``proofline ledger prune`` may remove it.
    retention_short_days: float = Field(default=7.0, ge=0)
    #: Days for class ``standard`` (the default class of settled actions and their evidence).
    retention_standard_days: float = Field(default=90.0, ge=0)
    #: Days for class ``audit`` (``legal_hold`` is never pruned).
    retention_audit_days: float = Field(default=2555.0, ge=0)
    #: How often Celery beat sends ``proofline.prune`` (queue ``checkpoint``); 0 (the default): never.
    prune_interval_seconds: float = Field(default=0.0, ge=0)
    # --- secrets and redaction ---
    #: AES-256-GCM key sealing the stored signed messages (default ``keys_dir/seal.key``).
    seal_key_file: Path | None = None
    #: Test-only worker kill points (worker/faultpoints.py): the armed points file, and the switch.
    fault_points_file: Path | None = None
    #: Refused (a validation error) unless ``environment`` is one of FAULT_POINT_ENVIRONMENTS.
    fault_points_enabled: bool = False

    @model_validator(mode="after")
    def _secrets_and_fault_points(self) -> Settings:
        if self.seal_key_file is None and self.keys_dir is not None:
            object.__setattr__(self, "seal_key_file", self.keys_dir / "seal.key")
        if self.fault_points_enabled and self.environment not in FAULT_POINT_ENVIRONMENTS:
            raise ValueError(f"fault points may only be enabled in {', '.join(FAULT_POINT_ENVIRONMENTS)}, "
                             f"not in environment {self.environment.value!r}")
        return self
    # --- database roles ---
    #: The CLI's commands that act as another role connect here when set, else to ``database_url``:
    #: ``publish`` as proofline_controller; kill switches, revoke, cancel and ``manual resolve`` as
    #: proofline_operator; status, verify-ledger, forensics and the listings as proofline_reader.
    controller_database_url: SecretStr | None = None
    operator_database_url: SecretStr | None = None
    reader_database_url: SecretStr | None = None
    #: ``proofline evidence show`` and the console's evidence page read the protected evidence store
    #: as proofline_auditor through this URL (no other role may read it).
    auditor_database_url: SecretStr | None = None
    # --- who publishes ---
    #: Who requests the actions this controller publishes when the caller names nobody (``publish
    #: --requester``, the SDK's ``requester=``); signed into every envelope. Unset: the user and
    #: host that publish (``alice@build-01``), never a placeholder.
    requester: str | None = None
    #: The workload (agent) identity signed into envelopes when the caller names none; unset:
    #: ``proofline-controller:<user>@<host>``, the process that published.
    workload_identity: str | None = None
    #: ``proofline ledger prune`` and the ``proofline.prune`` task connect here (role ``proofline_pruner``).
    pruner_database_url: SecretStr | None = None
    # --- the operator console ---
    #: Where ``proofline console`` listens: loopback unless configured.
    console_host: str = "127.0.0.1"
    console_port: int = 8470
    #: The console's users (name, role, token hash); default ``console-users.json`` in state_dir.
    console_users_file: Path | None = None
    # --- keys and signatures ---
    #: The controller's Ed25519 private key (controllers only).
    signing_key_file: Path | None = None
    #: The recovery key that signs derived envelopes (recovery processes only).
    recovery_key_file: Path | None = None
    #: This worker's key (role "worker"): it signs the evidence the worker records, nothing else
    #: (execute workers; default ``keys_dir/worker.key``).
    worker_key_file: Path | None = None
    #: Public keys with key ids, roles, ``not_after`` and ``revoked`` (every process that verifies).
    keyring_file: Path | None = None
    #: The auditor's X25519 public key (``auditor.pub``): workers seal the evidence a contract's
    #: ``evidence_capture`` policy captures to it (default ``keys_dir/auditor.pub``).
    auditor_public_key_file: Path | None = None
    #: The auditor's X25519 private key (``auditor.key``): only the auditor's CLI and console hold it;
    #: an execute worker that can read it is refused in production.
    auditor_key_file: Path | None = None
    #: The signed authority policy (``proofline authority sign``): each action type's mode (read,
    #: simulate, propose, approved, autonomous), approvers required and autonomy bounds. Required in
    #: production; without it, development and test accept the controller's approval as before.
    authority_file: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _key_files_default_to_keys_dir(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("keys_dir"):
            for name, default in (("signing_key_file", "controller.key"), ("recovery_key_file", "recovery.key"),
                                  ("worker_key_file", "worker.key"),
                                  ("keyring_file", "keyring.json")):
                if not data.get(name):
                    data[name] = Path(str(data["keys_dir"])) / default
        return data
    #: How long a worker session may check tool contracts against the tool list it already has
    #: (seconds; 0 lists the tools on every action). The list is also listed again when the server
    #: says it changed, on a new session and when the HTTP connections it came over are gone.
    #: ``tool_list_max_age_seconds`` in the servers file sets it for one server.
    tool_list_max_age_seconds: float = Field(default=60.0, ge=0)
    # --- containment: conditions, outputs and budgets ---
    #: Largest tool result (bytes of text, binary and structured content) a worker reads. A server
    #: (``max_result_bytes`` in the servers file) or a contract may lower it, never raise it.
    max_result_bytes: int = Field(default=256 * 1024, gt=0)
    # --- containment: messages and deliveries ---
    #: A task message delivered this many times without reaching a recorded outcome (its worker
    #: process died each time) is moved to the ``dead_letter`` queue on the next delivery.
    max_unsettled_deliveries: int = 3
    #: A delivery whose pool process was killed from outside (SIGKILL or SIGTERM with no
    #: out-of-memory kill on the node while it ran: an operator, a chaos tool, a supervisor) is not
    #: counted against its message, up to this many per message; past it, every death counts.
    max_excused_deliveries: int = Field(default=20, ge=0)
    #: AMQP brokers only: a quorum queue dead-letters a message after this many failed deliveries
    #: (``x-delivery-limit``). The second line behind ``max_unsettled_deliveries``, which it must
    #: exceed: the guard acts first whenever it can count, the broker when it could not (docs/how-to/rabbitmq.md).
    broker_delivery_limit: int = Field(default=10, ge=1)
    #: AMQP brokers only: how long a broker dead letter the ledger could not record waits,
    #: unacknowledged, before the consumer's event loop requeues it (``worker/dead_letters.py``).
    dead_letter_retry_seconds: float = Field(default=1.0, gt=0)
    #: AMQP brokers only: how many nodes of a RabbitMQ cluster hold a replica of each quorum queue
    #: (``x-quorum-initial-group-size``), as every process must declare it. Unset: not declared, and
    #: RabbitMQ's own default applies (``quorum_cluster_size``, 3 on 3.10, at most the nodes that are
    #: in the cluster when the queue is declared).
    broker_quorum_group_size: int | None = Field(default=None, ge=1)
    #: AMQP brokers only: how long a publish that met a lost connection or a cluster without a
    #: queue leader keeps trying (the next node of the URL list at once, then every half second)
    #: before it raises ``broker_unavailable``. What the ledger recorded stays recorded either way.
    broker_publish_retry_seconds: float = Field(default=30.0, gt=0, le=600)

    @model_validator(mode="after")
    def _broker_limit_behind_the_guard(self) -> Settings:
        if self.broker_delivery_limit <= self.max_unsettled_deliveries:
            raise ValueError(f"broker_delivery_limit ({self.broker_delivery_limit}) must exceed "
                             f"max_unsettled_deliveries ({self.max_unsettled_deliveries}): the message guard "
                             "dead-letters with a ledger record first, the broker's limit is its backstop")
        return self

    #: Retries of one delivery (database away, unexpected error, target busy) before it is recorded
    #: as abandoned and left to the reconciler.
    task_retry_limit: int = 50
    #: A failed precondition read (or prepare) is tried again after the envelope's backoff doubled
    #: per retry of the delivery, with jitter, never longer than this.
    precheck_backoff_cap_seconds: float = Field(default=30.0, gt=0, le=600)
    #: The reconciler closes a still-published action this long after its deadline.
    deadline_grace_seconds: float = 60.0
    #: Prefork pool processes of ``proofline worker`` when ``--concurrency`` is not given: twice the
    #: processors, because a pool process spends about half an action waiting on the MCP servers and
    #: Postgres (docs/design/cost-benchmark.md).
    worker_concurrency: int = Field(default_factory=lambda: 2 * (os.cpu_count() or 1), ge=1)
    #: Pool processes are replaced after this many tasks, or once they hold this much memory (KiB).
    worker_max_tasks_per_child: int = 1000
    worker_max_memory_per_child_kb: int = 512 * 1024
    #: Stdio servers are started and kept by one session host per worker node (worker/session_host.py)
    #: and lent to its pool processes, so a pool process that is killed or replaced does not take its
    #: servers with it and its successor starts without launching any. Off: each pool process starts
    #: its own, as a worker without the host does.
    stdio_session_host: bool = True
    #: Idle servers the session host keeps started ahead of need, per stdio identity.
    stdio_session_spares: int = Field(default=1, ge=0, le=16)
    #: How long a new MCP session may take to open: the server started (a stdio server, sandboxed) and
    #: its initialization answered. A session not open by then is abandoned with its server, and the
    #: call is refused as ``mcp_unavailable`` with nothing sent. Raise it for servers slow to start
    #: (one fetched by ``npx`` or ``uvx`` at each start, or a machine whose cores are all busy).
    mcp_connect_timeout_seconds: float = Field(default=15.0, gt=0, le=600)
    # --- containment: tenant fairness and quotas ---
    #: The execute queue is split into this many tenant shards (``actions``, ``actions.1`` ...);
    #: every publisher and every execute worker must agree on it.
    tenant_shards: int = Field(default=8, ge=1, le=256)
    #: Actions of one tenant executing at once (0 = unlimited). One over it waits (``tenant_quota_wait``)
    #: and is delivered again shortly; it is never dropped.
    tenant_max_executing: int = Field(default=0, ge=0)
    #: Fair turns within an execute shard (worker/fairness.py): an action of a tenant that already has
    #: this many executing yields its turn (requeued at the shard's tail, ``tenant_fair_wait``) while
    #: another tenant with fewer executing waits on the same shard. 0 turns it off.
    tenant_fair_share: int = Field(default=1, ge=0)

    @property
    def servers_base_dir(self) -> Path:
        """What relative paths in the servers file are relative to: the file's own folder, except for
        the packaged file (inside the installed package, which nothing may write), whose paths resolve
        under ``state_dir``."""
        path = Path(self.servers_file).resolve()
        return Path(self.state_dir) if path == PACKAGED_SERVERS_FILE else path.parent

    @property
    def visibility_timeout(self) -> int:
        """Broker visibility timeout: longer than the longest absolute deadline, so Redis never redelivers a live task."""
        return int(self.max_deadline_seconds * 2 + 60)


def reveal(value: SecretStr | str | None) -> str | None:
    """The plain value of a secret setting, at the one place that uses it (a connection)."""
    return value.get_secret_value() if isinstance(value, SecretStr) else value


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
