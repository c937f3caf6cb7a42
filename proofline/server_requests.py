"""The policy over requests a tool server sends its client mid-call (elicitation, sampling, roots).

Declared per server in the servers file and narrowed per action type by a contract; the worker
applies it (worker/server_requests.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ServerRequestPolicy(BaseModel):
    """How the worker answers what a server asks of it (``server_requests:`` in the servers file)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: ``approver`` puts a form question to the approvers (``proofline elicitations``) and holds the
    #: call open for at most ``elicitation_wait_seconds``; nobody answering in time is ``cancel``.
    elicitation: Literal["refuse", "approver"] = "refuse"
    #: How long a call waits for an approver's answer (keep it below the tool's call timeout).
    elicitation_wait_seconds: float = Field(120.0, gt=0, le=3600)
    #: Only refusal: Proofline lends no model to a tool server.
    sampling: Literal["refuse"] = "refuse"
    #: ``sandbox`` answers with the paths the identity's sandbox declares (``file://`` URIs).
    roots: Literal["refuse", "sandbox"] = "refuse"
    #: Requests recorded one by one per action; past it they are refused and only counted.
    max_per_call: int = Field(16, ge=0, le=10_000)

    def narrowed(self, other: ServerRequestPolicy | None) -> ServerRequestPolicy:
        """The stricter of the two: a contract may refuse what its server would answer, never the reverse."""
        if other is None:
            return self
        roots = "refuse" if "refuse" in (self.roots, other.roots) else "sandbox"
        elicitation = "refuse" if "refuse" in (self.elicitation, other.elicitation) else "approver"
        return self.model_copy(update={"roots": roots, "max_per_call": min(self.max_per_call, other.max_per_call),
                                       "elicitation": elicitation,
                                       "elicitation_wait_seconds": min(self.elicitation_wait_seconds,
                                                                       other.elicitation_wait_seconds)})
