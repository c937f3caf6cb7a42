"""The Python API of the system of record: one import for seeding, faults, effects and every operation.

All functions take the database path first (``None`` means env ``SOR_DB``, else
``./var/sor.sqlite3``). Mutations run in ``BEGIN IMMEDIATE`` transactions that also append an
``effects`` row; only ``create_ticket`` and ``reverse_refund`` honour the idempotency key, the
others record it but apply again on every call, as many real enterprise APIs do. Refusals raise
``Refused`` (``reason`` like ``version_conflict``) and apply nothing.
"""

from __future__ import annotations

from proofline_kit.sor.core import (
    Refused,
    cancellations,
    count_effects,
    effects,
    phantom_id,
    record_cancellation,
)
from proofline_kit.sor.db import connect, init_db, resolve_path
from proofline_kit.sor.faults import (
    OPERATION_TTL,
    READ_LAG,
    READ_OUTAGE,
    Fault,
    clear_faults,
    contract_variant,
    list_faults,
    set_contract_variant,
    set_fault,
    set_operation_ttl,
    set_read_outage,
    set_replica_position,
    take_fault,
)
from proofline_kit.sor.refunds import (
    find_refund_by_key,
    get_account,
    issue_refund,
    preview_refund,
    reverse_refund,
)
from proofline_kit.sor.seed import bump_version, put_account, put_service, put_ticket, reset_db, seed_demo
from proofline_kit.sor.services import get_operation, get_service, restart_service
from proofline_kit.sor.tickets import (
    close_ticket,
    create_ticket,
    find_ticket_by_key,
    get_ticket,
    preview_close_ticket,
)

__all__ = [
    # database
    "connect",
    "init_db",
    "resolve_path",
    # seeding and test set-up
    "seed_demo",
    "reset_db",
    "put_ticket",
    "put_service",
    "put_account",
    "bump_version",
    # faults
    "READ_OUTAGE",
    "READ_LAG",
    "OPERATION_TTL",
    "Fault",
    "set_fault",
    "clear_faults",
    "set_read_outage",
    "set_replica_position",
    "set_operation_ttl",
    "set_contract_variant",
    "contract_variant",
    "take_fault",
    "list_faults",
    # effects (ground truth)
    "effects",
    "count_effects",
    "phantom_id",
    "record_cancellation",
    "cancellations",
    # operations
    "Refused",
    "create_ticket",
    "close_ticket",
    "get_ticket",
    "find_ticket_by_key",
    "restart_service",
    "get_service",
    "get_operation",
    "issue_refund",
    "reverse_refund",
    "get_account",
    "find_refund_by_key",
    # prepare tools (read-only plans)
    "preview_close_ticket",
    "preview_refund",
]
