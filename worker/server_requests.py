"""Requests a server sends the worker in the middle of a call: elicitation, sampling and roots.

A tool server may ask its client to put a question to the user (``elicitation/create``), to run
the client's model (``sampling/createMessage``) or to list the client's roots (``roots/list``). On
the 2025-11-25 protocol these arrive as requests on the session; on 2026-07-28 they come embedded
in an ``InputRequiredResult`` that the SDK answers through the same callbacks and then re-sends the
call. Either way the answer is Proofline's, not the SDK's default, and each request is evidence on
the action whose call was in flight.

Proofline lends no model, so sampling is always refused with the protocol's error. Elicitation is
refused too, unless the servers file routes it to the approvers (``elicitation: approver``): then a
form question waits, within ``elicitation_wait_seconds``, for an answer an approver signed
(worker/elicitation_route.py). Roots are refused unless the servers file answers them with the
paths the identity's sandbox declares. Nothing is advertised that would be refused: the client's
capability announcement names only what the policy answers, so a well-behaved server never asks;
a server that asks anyway is refused and recorded all the same.

A server that floods requests is bounded like progress: the first ``max_per_call`` requests of an
action are recorded one event each, the rest are refused and counted in one summary event.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from mcp import types
from pydantic import BaseModel

from proofline.server_requests import ServerRequestPolicy
from worker.calls import restart_request_timeout

#: The ledger event of one server-initiated request.
EVENT = "server_request"
#: The ledger event that counts the requests past the bound (one per action and session).
SUPPRESSED_EVENT = "server_requests_suppressed"
#: The JSON-RPC error code Proofline answers a refused request with (the SDK's own refusals use it too).
REFUSED_CODE = types.INVALID_REQUEST
#: Key of the ``data`` the runtime's refusals carry.
REFUSAL_MARK = "proofline_refused"
#: How often a call waiting on an approver's answer restarts its request timeout.
HOLD_INTERVAL_SECONDS = 0.5
#: Longest message or prompt excerpt kept in a request's event.
EXCERPT_CHARS = 200

log = logging.getLogger(__name__)


def declared_roots(read_only: tuple[str, ...], writable: tuple[str, ...], base_dir: Path) -> list[types.Root]:
    """The sandbox's declared paths as roots, writable first, each once."""
    seen: dict[str, types.Root] = {}
    for kind, paths in (("writable", writable), ("read-only", read_only)):
        for raw in paths:
            path = (base_dir / raw).resolve()
            seen.setdefault(str(path), types.Root(uri=path.as_uri(), name=f"{kind}: {path.name or path}"))
    return list(seen.values())


def _size(value: Any) -> int:
    try:
        return len(json.dumps(value.model_dump(mode="json", by_alias=True, exclude_none=True)
                              if isinstance(value, BaseModel) else value, default=str))
    except (TypeError, ValueError):
        return -1


def _excerpt(text: str | None) -> str:
    return (text or "")[:EXCERPT_CHARS]


class RequestGate:
    """The callbacks one session is built with, and the count that bounds them.

    ``policy`` reads the policy in force at the moment of the request (the server's, narrowed by the
    contract of the action in flight); ``note`` receives each event's name, body and the action id
    whose call was in flight (the session registry keeps them for the ledger); ``roots`` are the
    sandbox's declared paths."""

    def __init__(self, server: str, role: str, configured: ServerRequestPolicy,
                 policy: Callable[[], ServerRequestPolicy],
                 note: Callable[[str, dict[str, Any], str | None], None], roots: list[types.Root],
                 route: Any = None) -> None:
        self.server, self.role = server, role
        #: Asks approvers (worker/elicitation_route.py ``ApproverRoute``) when the policy says so.
        self._route = route
        self.configured = configured
        self.policy = policy
        self._note = note
        self._roots = roots
        self._lock = threading.Lock()
        #: Requests seen per action id while this session served it (bounded by the policy).
        self.seen: dict[str | None, int] = {}

    @property
    def advertised(self) -> frozenset[str]:
        """The client capabilities this session announces: only what the servers file answers (a
        contract that narrows it refuses a request it announced, and records it like any other)."""
        return frozenset({*(["roots"] if self.configured.roots == "sandbox" else []),
                          *(["elicitation"] if self.configured.elicitation == "approver" and self._route else [])})

    def _record(self, action_id: str | None, method: str, request_id: Any, answer: dict[str, Any],
                **detail: Any) -> None:
        policy = self.policy()
        with self._lock:
            count = self.seen[action_id] = self.seen.get(action_id, 0) + 1
        if count > policy.max_per_call:
            return  # counted; the summary event says how many (take_suppressed)
        self._note(EVENT, {"server": self.server, "role": self.role, "method": method,
                           "request_id": None if request_id is None else str(request_id),
                           "answer": answer, **detail}, action_id)

    def _below_bound(self, action_id: str | None) -> bool:
        with self._lock:
            return self.seen.get(action_id, 0) < self.policy().max_per_call

    def take_suppressed(self, limit: int) -> dict[str | None, int]:
        """Per action, how many requests went past the bound since the last take (then forgotten)."""
        with self._lock:
            over = {aid: n - limit for aid, n in self.seen.items() if n > limit}
            self.seen.clear()
        return over

    def _refusal(self, method: str) -> types.ErrorData:
        # The mark lets the classifier tell the runtime's own refusal (raised client-side when a
        # 2026-07-28 round is refused, after the server saw the call) from a server's refusal.
        return types.ErrorData(code=REFUSED_CODE, message=f"{method} refused by the runtime's policy",
                               data={REFUSAL_MARK: method})

    def callbacks(self, action_id: Callable[[], str | None]) -> dict[str, Any]:
        """``mcp.Client`` keyword arguments: the three callbacks, each recording before it answers."""

        async def elicitation(ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult | types.ErrorData:
            method = "elicitation/create"
            aid, policy = action_id(), self.policy()
            mode = getattr(params, "mode", None) or "form"
            detail = {"size": _size(params), "message": _excerpt(getattr(params, "message", None)), "mode": mode}
            # Only a form question of an action in flight, within the bound, reaches a human.
            if policy.elicitation == "approver" and self._route is not None and aid is not None and mode == "form" \
                    and self._below_bound(aid):
                request_id = None if ctx.request_id is None else str(ctx.request_id)
                async with anyio.create_task_group() as waiting:
                    # The call's request timeout is the server's silence; here the runtime is the one
                    # answering, so it holds the timeout open (the absolute deadline still applies).
                    waiting.start_soon(_hold_request_timeout, aid)
                    try:
                        got = await anyio.to_thread.run_sync(lambda: self._route.ask(
                            action_id=aid, server=self.server, role=self.role, message=getattr(params, "message", ""),
                            schema=getattr(params, "requested_schema", None),
                            wait_seconds=policy.elicitation_wait_seconds, request_id=request_id),
                            abandon_on_cancel=True)
                    except Exception as exc:  # noqa: BLE001 - no ledger to ask through: the server hears cancel
                        log.warning("elicitation could not be put to approvers: %s", type(exc).__name__,
                                    extra={"event": "elicitation_unavailable", "action_id": aid})
                        got = {"action": "cancel", "routed": "approver", "refused": "elicitation_unavailable",
                               "detail": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    waiting.cancel_scope.cancel()
                content = got.pop("content", None)
                self._record(aid, method, ctx.request_id, got, **detail)  # the content stays on its own chain
                return types.ElicitResult(action=got["action"], content=content)
            self._record(aid, method, ctx.request_id, {"refused": REFUSED_CODE}, **detail)
            return self._refusal(method)

        async def sampling(ctx: Any, params: types.CreateMessageRequestParams) -> types.ErrorData:
            method = "sampling/createMessage"
            self._record(action_id(), method, ctx.request_id, {"refused": REFUSED_CODE}, size=_size(params),
                         messages=len(params.messages), max_tokens=params.max_tokens,
                         system_prompt=_excerpt(params.system_prompt))
            return self._refusal(method)

        async def roots(ctx: Any) -> types.ListRootsResult | types.ErrorData:
            method = "roots/list"
            if self.policy().roots == "sandbox":
                self._record(action_id(), method, ctx.request_id, {"roots": [str(r.uri) for r in self._roots]}, size=0)
                return types.ListRootsResult(roots=self._roots)
            self._record(action_id(), method, ctx.request_id, {"refused": REFUSED_CODE}, size=0)
            return self._refusal(method)

        return {"elicitation_callback": elicitation, "sampling_callback": sampling, "list_roots_callback": roots}


async def _hold_request_timeout(action_id: str) -> None:
    while True:
        restart_request_timeout(action_id)
        await anyio.sleep(HOLD_INTERVAL_SECONDS)


def refused_by_runtime(error: BaseException) -> bool:
    """Whether ``error`` is the SDK giving back one of the runtime's own refusals."""
    data = getattr(getattr(error, "error", None), "data", None)
    return isinstance(data, dict) and REFUSAL_MARK in data


def limit_capabilities(session: Any, advertised: frozenset[str]) -> None:
    """Make ``session`` (an un-entered ``ClientSession``) announce only ``advertised`` among
    sampling, elicitation and roots, although it holds a callback for each: the SDK announces a
    capability for every callback it is given, and a refusal must not be announced as support."""
    build = session._build_capabilities

    def capabilities(version: str) -> types.ClientCapabilities:
        caps = build(version)
        return caps.model_copy(update={k: None for k in ("sampling", "elicitation", "roots") if k not in advertised})

    session._build_capabilities = capabilities
