"""The policy over requests a tool server sends its client mid-call (elicitation, sampling, roots).

Declared per server in the servers file and narrowed per action type by a contract; the worker
applies it (worker/server_requests.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ServerRequestPolicy(BaseModel):
    """How the worker answers what a server asks of it (``server_requests:`` in the servers file)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Only refusal: Proofline has no user to put an elicited question to.
    elicitation: Literal["refuse"] = "refuse"
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
        return self.model_copy(update={"roots": roots, "max_per_call": min(self.max_per_call, other.max_per_call)})
