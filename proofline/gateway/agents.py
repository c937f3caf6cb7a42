"""Who may call the gateway: agents, each a bearer credential bound to an identity and a tenant.

The agents file (``PROOFLINE_GATEWAY_AGENTS_FILE`` or ``proofline gateway --agents``) is YAML::

    agents:
      ops-assistant:
        token_sha256: 9f2c...          # sha256 of the bearer token; the token itself is never stored
        workload_identity: agent:ops-assistant
        requester: alice@example.com   # the person accountable for what this agent does
        tenant: acme                   # every action it publishes is this tenant's, whatever it asks
        action_types: [ticket.create, ticket.close]

``proofline gateway token NAME`` makes a token and prints the line to paste. A token maps to exactly
one agent; the comparison is constant-time over the digests.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proofline.errors import ConfigurationError


class Agent(BaseModel):
    """One agent the gateway serves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = ""
    token_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    workload_identity: str = Field(min_length=1, max_length=200)
    requester: str = Field(min_length=1, max_length=200)
    tenant: str = Field(min_length=1, max_length=200)
    action_types: tuple[str, ...] = Field(min_length=1)


def agent_slug(name: str) -> str:
    """The agent's name as it appears in its action ids (``gw-<slug>-...``)."""
    return "".join(c if c.isalnum() else "-" for c in name)[:40]


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> tuple[str, str]:
    """A fresh bearer token and its digest (the token is shown once, the digest is stored)."""
    token = f"plg_{secrets.token_urlsafe(32)}"
    return token, token_digest(token)


def load_agents(path: Path) -> dict[str, Agent]:
    path = Path(path)
    try:
        return _load(path, path.stat().st_mtime_ns)
    except FileNotFoundError:
        raise ConfigurationError(f"gateway agents file {path} does not exist", file=str(path)) from None


@lru_cache(maxsize=4)
def _load(path: Path, stamp: int) -> dict[str, Agent]:
    # Keyed on the modification time: an agent added or revoked is seen without a restart.
    try:
        raw = yaml.safe_load(path.read_text()) or {}
        agents = {name: Agent(name=name, **spec) for name, spec in (raw.get("agents") or {}).items()}
    except (yaml.YAMLError, ValidationError, TypeError, AttributeError) as exc:
        raise ConfigurationError(f"gateway agents file {path}: {exc}"[:800], file=str(path)) from None
    # Action ids carry the agent's slug and prove ownership of an action: no two agents may share one.
    slugs = [agent_slug(a.name) for a in agents.values()]
    if len(set(slugs)) != len(slugs):
        raise ConfigurationError(f"gateway agents file {path}: two agent names differ only in punctuation",
                                 file=str(path))
    digests = [a.token_sha256 for a in agents.values()]
    if len(set(digests)) != len(digests):
        raise ConfigurationError(f"gateway agents file {path}: two agents share a token", file=str(path))
    return agents


def authenticate(agents: dict[str, Agent], authorization: str | None) -> Agent | None:
    """The agent whose token the ``Authorization: Bearer`` header carries, or None."""
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    digest = token_digest(authorization[7:].strip())
    found = None
    for agent in agents.values():  # every digest is compared: the time does not say which matched
        if hmac.compare_digest(agent.token_sha256, digest):
            found = agent
    return found
