"""Pydantic shapes of the structured tool results: they become each tool's published ``outputSchema``."""

from __future__ import annotations

from pydantic import BaseModel


class TicketCreated(BaseModel):
    ticket_id: str
    status: str
    version: int
    deduplicated: bool


class TicketClosed(BaseModel):
    ticket_id: str
    status: str
    version: int


class OperationAccepted(BaseModel):
    operation_id: str
    state: str


class RefundReversed(BaseModel):
    refund_id: str
    status: str
    deduplicated: bool


class Ticket(BaseModel):
    id: str
    tenant: str
    title: str
    owner: str
    status: str
    version: int
    idempotency_key: str | None = None
    priority: str | None = None
    created_at: float


class TicketLookup(BaseModel):
    found: bool
    ticket: Ticket | None = None


class Operation(BaseModel):
    id: str
    kind: str
    service: str
    tenant: str
    state: str
    started_at: float
    ready_at: float
    idempotency_key: str | None = None
    expires_at: float | None = None


class OperationLookup(BaseModel):
    found: bool
    operation: Operation | None = None
    #: Set when the record existed and passed its time to live (it is no longer served).
    expired_at: float | None = None


class Account(BaseModel):
    id: str
    tenant: str
    balance_cents: int
    version: int


class Refund(BaseModel):
    id: str
    account: str
    tenant: str
    amount_cents: int
    reason: str
    status: str
    idempotency_key: str | None = None
    reversal_key: str | None = None
    created_at: float


class AccountLookup(BaseModel):
    found: bool
    account: Account | None = None
    refunds: list[Refund] = []


class RefundLookup(BaseModel):
    found: bool
    refund: Refund | None = None
    refunds: list[Refund] = []


class PlannedChange(BaseModel):
    field: str
    before: str | int | None = None
    after: str | int | None = None


class Plan(BaseModel):
    """What a write would change now (the answer of a ``preview_*`` prepare tool)."""

    plan_id: str
    tool: str
    target: str
    target_version: int | None = None
    applicable: bool
    refusal: str | None = None
    changes: list[PlannedChange] = []
