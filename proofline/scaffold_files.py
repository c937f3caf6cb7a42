"""The texts ``proofline init`` writes (``proofline/scaffold.py`` decides where and with which mode).

Every path in them is absolute (the folder's own), so the systemd units, the compose file and
``proofline dev`` read the same files whatever their working directory.
"""

from __future__ import annotations

import getpass
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proofline.scaffold import Layout

SERVERS = """\
# The MCP servers the workers may call, by name (a contract names its server). Relative paths
# (cwd, sandbox paths) are relative to this file's folder.
#
# The entry below runs the system of record that ships with Proofline (proofline_kit.sor), so
# `proofline dev` works before you have written anything. Replace it with your own server:
#   transport   stdio (a program the worker starts, sandboxed by bubblewrap) or http (a URL)
#   command     the program and its arguments; "{python}" is the worker's own interpreter
#   env_allow   the only environment variables the server inherits from the worker
#   env         fixed variables for the server
#   cwd         its working folder
#   expected_version   the serverInfo.version it must report, or every action is refused
#   sandbox     what the sandboxed program may write (rw_paths) and read (ro_paths)
#   read_identity      how verification reads: the same server under a read-only identity
# After changing a server or its tools, pin them again: proofline contracts pin
servers:
  sor:
    transport: stdio
    command: ["{python}", "-m", "proofline_kit.sor", "--transport", "stdio"]
    env_allow: [SOR_DB]
    env: {SOR_ROLE: writer}
    cwd: var
    expected_version: "1.0.0"
    sandbox: {rw_paths: [var]}
    read_identity:
      env: {SOR_ROLE: reader}
      # Verification reads as another uid with the data bound read-only: it cannot write.
      sandbox: {uid: 65533, ro_paths: [var]}
"""

CONTRACT = """\
# A contract: what one action type does on one MCP tool, and how its effect is proven.
# This one opens a ticket on the server `sor` of servers.yaml. Copy it for each action type of
# your own server, then pin the server's tools: proofline contracts pin

# The name controllers publish (Client.publish("ticket.create", ...)) and the policy names.
action_type: ticket.create
# Raise it whenever you change this file: envelopes carry the version they were made for.
version: 1
# The server (a key of servers.yaml) and the tool the action calls.
server: sor
tool: create_ticket
# What the call does (create, update, delete, refund ...): shown to approvers and in the ledger.
operation: create
# The kind of object the envelope's target names ({"type": "ticket_queue", "id": ...}).
target_type: ticket_queue
# How the tool's answer is read: structured (structuredContent), json_text or pattern.
result: {mode: structured}
# Whether the server honours the idempotency key it is given (the runtime never relies on it).
downstream_honours_key: true
# A call that has not answered after this long is an unknown outcome, settled by verification.
timeout_seconds: 5
# The read before the call; its answer is `before` in the conditions below. Arguments are CEL
# over the envelope (envelope.*, args.*, target.*).
precondition_read:
  tool: find_ticket_by_key
  arguments: {idempotency_key: "envelope.idempotency_key"}
# Each must hold before the call; a failed one refuses the action with its reason, nothing called.
preconditions:
  - {name: no_ticket_for_this_key, expr: "!before.found", reason: already_exists}
  - {name: arguments_name_the_tenant, expr: "args.tenant == envelope.tenant", reason: tenant_mismatch}
# The proof: after the call the worker reads again (by default with the precondition read, through
# the server's read identity) until `expected` all hold, or `prohibited` or `absent` shows the
# action did something else or nothing.
verification:
  max_duration_seconds: 10
  poll_interval_seconds: 0.2
  expected:
    - "after.found"
    - "after.ticket.title == args.title && after.ticket.owner == args.owner"
    - "after.ticket.tenant == envelope.tenant"
  prohibited:
    - "after.found && after.ticket.tenant != envelope.tenant"
  absent: "!after.found"
# What the runtime does when a step fails: retry with the same key, reconcile an unknown outcome,
# hand a failed verification to an operator (add a compensation: block to undo it automatically).
recovery:
  transient_failure: retry_same_idempotency_key
  unknown_outcome: reconcile
  verification_failure: manual
# true when the effect cannot be undone (an approver must then accept that explicitly).
point_of_no_return: false
"""

POLICY = """\
# The authority policy: how far each action type may go without a person. Every deployment runs
# under a signed one (production refuses to start without it). After editing, sign it again:
#   proofline authority sign authority.yaml --key keys/approver/approver.key --out authority.json
# Rungs, lowest first: read, simulate, propose, approved, autonomous.
kind: proofline.authority/v1
# Raise it with every change: the ledger records which version authorized each action.
version: 1
# The rung of every action type not named below.
default_mode: approved
action_types:
  # Each ticket.create waits as `proposed` until an approver approves its plan:
  #   proofline approve ACTION_ID --key keys/approver/approver.key
  # When its record earns it, `proofline authority promote` moves it up a rung.
  ticket.create:
    mode: propose
    approvers_required: 1
"""


def servers_file() -> str:
    return SERVERS


def contract_template() -> str:
    return CONTRACT


def authority_policy() -> str:
    return POLICY


def env_file(layout: Layout) -> str:
    """Settings every process of the deployment shares; the private keys are not among them."""
    r = layout.root
    return f"""\
# Settings every Proofline process of this deployment reads (systemd: EnvironmentFile=; compose:
# env_file). `proofline dev` reads the paths below and replaces the service URLs with its own.
# Against real services, change the lines marked CHANGE (docs/tutorial/your-deployment.md).

# production refuses development keys, a missing authority policy and a combined worker.
PROOFLINE_ENVIRONMENT=production

# CHANGE: Postgres, one role per process (docs/concepts/database-roles.md). The execute worker,
# beat and the console's reads use these; recovery.env sets the recovery process's own URL.
PROOFLINE_DATABASE_URL=postgresql://proofline_worker:CHANGE_ME@127.0.0.1:5432/proofline
# CHANGE: a role that may run migrations (proofline migrate only).
PROOFLINE_ADMIN_DATABASE_URL=postgresql://postgres:CHANGE_ME@127.0.0.1:5432/proofline
# CHANGE: the role URLs of publishing (controller), operators' writes and every read.
PROOFLINE_CONTROLLER_DATABASE_URL=postgresql://proofline_controller:CHANGE_ME@127.0.0.1:5432/proofline
PROOFLINE_OPERATOR_DATABASE_URL=postgresql://proofline_operator:CHANGE_ME@127.0.0.1:5432/proofline
PROOFLINE_READER_DATABASE_URL=postgresql://proofline_reader:CHANGE_ME@127.0.0.1:5432/proofline
# CHANGE: the broker: redis://, or amqp:// for RabbitMQ.
PROOFLINE_BROKER_URL=redis://127.0.0.1:6379/0

# This folder's files.
PROOFLINE_SERVERS_FILE={layout.servers_file}
PROOFLINE_CONTRACTS_DIR={layout.contracts}
PROOFLINE_AUTHORITY_FILE={layout.authority_json}
# Public keys of every signer: read by every process.
PROOFLINE_KEYRING_FILE={layout.keyring}
# The auditor's public key: workers seal the evidence a contract captures to it (only the
# auditor's private key, keys/auditor/, opens it; docs/security/evidence-store.md).
PROOFLINE_AUDITOR_PUBLIC_KEY_FILE={layout.auditor_public}
# Seals the signed messages the ledger stores: workers and recovery need it.
PROOFLINE_SEAL_KEY_FILE={layout.key_file('seal')}
# What the processes write: checkpoints, beat's schedule, console users, the template server's data.
PROOFLINE_STATE_DIR={layout.var}
PROOFLINE_CHECKPOINT_DIR={layout.var / 'checkpoints'}
PROOFLINE_CONSOLE_USERS_FILE={layout.var / 'console-users.json'}
PROOFLINE_CONSOLE_HOST=127.0.0.1
PROOFLINE_CONSOLE_PORT=8470
# The template server's SQLite file (remove with the server from servers.yaml).
SOR_DB={r / 'var' / 'sor.sqlite3'}

# Held by one process each, never here:
#   PROOFLINE_WORKER_KEY_FILE                               -> worker.env (execute worker: signs its evidence)
#   PROOFLINE_RECOVERY_KEY_FILE, PROOFLINE_LEDGER_KEY_FILE  -> recovery.env (recovery worker)
#   PROOFLINE_SIGNING_KEY_FILE                              -> controller.env (your agent, proofline publish)
#   PROOFLINE_AUDITOR_KEY_FILE, PROOFLINE_AUDITOR_DATABASE_URL -> auditor.env (proofline evidence show)
#   the approver key ({layout.key_file('approver')})  -> stays with its approver
"""


def recovery_env(layout: Layout) -> str:
    return f"""\
# The recovery worker's own settings, read after .env: its database role, the recovery key that
# signs derived envelopes and the ledger key that signs checkpoints. No other process reads this.
# CHANGE: the recovery role's password.
PROOFLINE_DATABASE_URL=postgresql://proofline_recovery:CHANGE_ME@127.0.0.1:5432/proofline
PROOFLINE_RECOVERY_KEY_FILE={layout.key_file('recovery')}
PROOFLINE_LEDGER_KEY_FILE={layout.key_file('ledger')}
"""


def worker_env(layout: Layout) -> str:
    return f"""\
# The execute worker's own setting, read after .env: its worker key, which signs the evidence of
# every verdict (recovery acts only on signed evidence) and nothing else. No other process reads this.
PROOFLINE_WORKER_KEY_FILE={layout.key_file('worker')}
"""


def controller_env(layout: Layout) -> str:
    return f"""\
# The controller's own setting, read after .env by whatever publishes actions (your agent using
# proofline.Client, proofline publish): the key that signs its envelopes.
PROOFLINE_SIGNING_KEY_FILE={layout.key_file('controller')}
"""


def auditor_env(layout: Layout) -> str:
    return f"""\
# The auditor's own settings, read after .env by `proofline evidence show` (and by a console that
# serves the evidence page): the private key that opens captured evidence and the only database
# role that may read the evidence store. Keep this file and keys/auditor/ off every worker host.
PROOFLINE_AUDITOR_KEY_FILE={layout.key_file('auditor')}
# CHANGE: the auditor role's password.
PROOFLINE_AUDITOR_DATABASE_URL=postgresql://proofline_auditor:CHANGE_ME@127.0.0.1:5432/proofline
"""


#: Each unit's description, command line (after the ``proofline`` command) and extra env files.
UNIT_SPECS = {
    "worker": ("execute worker: runs actions, signs only its evidence", "worker --role execute", ("worker.env",)),
    "recovery": ("recovery worker: recovery decisions, the reconciler, ledger checkpoints",
                 "worker --role recovery --queues recovery,reconcile,checkpoint --concurrency 1", ("recovery.env",)),
    "beat": ("beat: the reconciler's and the checkpoints' timer", "beat --schedule {var}/beat-schedule", ()),
    "console": ("operator console", "console", ()),
    "exporter": ("ledger metrics endpoint", "exporter --port 9465", ()),
}


def systemd_unit(layout: Layout, unit: str) -> str:
    description, command, extra = UNIT_SPECS[unit]
    env_files = "".join(f"EnvironmentFile={layout.root / name}\n" for name in extra)
    return f"""\
# Install: sudo systemctl link {layout.root / 'systemd' / f'proofline-{unit}.service'}
#          sudo systemctl enable --now proofline-{unit}
# Run `proofline migrate` (with .env loaded) once before the first start.
[Unit]
Description=Proofline {description}
After=network-online.target postgresql.service redis-server.service rabbitmq-server.service
Wants=network-online.target

[Service]
Type=simple
User={getpass.getuser()}
WorkingDirectory={layout.root}
EnvironmentFile={layout.env_file}
{env_files}ExecStart={layout.proofline} {command.format(var=layout.var)}
# SIGTERM: the worker finishes or hands back what it holds; the ledger settles the rest.
KillSignal=SIGTERM
TimeoutStopSec=60
Restart=on-failure
RestartSec=2
NoNewPrivileges=yes

[Install]
WantedBy=multi-user.target
"""


def compose_file(layout: Layout) -> str:
    """The same five processes as the systemd units, in containers on the host's network (so the
    URLs of .env mean the same), each given only the files of the keys it may hold."""
    shared = [layout.servers_file, layout.contracts, layout.authority_json, layout.keyring, layout.auditor_public,
              layout.key_file("seal").parent, layout.var]
    services = []
    for unit in UNIT_SPECS:
        _, command, extra = UNIT_SPECS[unit]
        own = {"recovery": (layout.key_file("recovery").parent, layout.key_file("ledger").parent),
               "worker": (layout.key_file("worker").parent,)}.get(unit, ())
        mounts = [*shared, *own]
        volumes = "".join(f"      - {p}:{p}{':rw' if p == layout.var else ':ro'}\n" for p in mounts)
        env_files = "".join(f"      - {layout.root / name}\n" for name in (".env", *extra))
        argv = ", ".join(f'"{part}"' for part in ["proofline", *command.format(var=layout.var).split()])
        services.append(f"""\
  {unit}:
    <<: *proofline
    command: [{argv}]
    env_file:
{env_files}    volumes:
{volumes}""")
    return f"""\
# The deployment of this folder in containers: the same processes as systemd/ (worker, recovery,
# beat, console, exporter), the same .env, the same absolute paths (each mounted where .env says).
# The image is Proofline's (docker build -t proofline:dev . in its source); Postgres and the broker
# are the ones .env names, reached over the host's network.
#   docker compose run --rm worker proofline migrate   # once, with PROOFLINE_ADMIN_DATABASE_URL set
#   docker compose up -d
x-proofline: &proofline
  image: ${{PROOFLINE_IMAGE:-proofline:dev}}
  restart: unless-stopped
  network_mode: host
  # The folder's owner: the key files are 0600.
  user: "{os.getuid()}:{os.getgid()}"

services:
{''.join(services)}"""
