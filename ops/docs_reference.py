"""Reference pages of the documentation site, rendered from the code so that they cannot drift.

The MkDocs hook (``docs/hooks/reference.py``) replaces a marker line ``<!-- reference: NAME -->`` in
a page with ``render(NAME)`` at build time:

- ``cli``: every ``proofline`` command's ``--help``, from the Click group itself;
- ``settings``: every field of ``proofline.settings.Settings`` (environment variable, default, the
  ``#:`` comment above it), and the ``PROOFLINE_*`` variables runtime code reads outside it;
- ``reason-codes``: every error class of ``proofline.errors`` (the package) with its stable code;
- ``alerts``: every rule of ``ops/prometheus/alerts.yml``, linked to its runbook.

The JSON Schemas of the contract file and of the servers file are generated from the pydantic models
(``proofline/contracts.py``, ``worker/servers.py``, ``worker/sandbox.py``) and kept in
``docs/reference/schemas/``; ``python -m ops.docs_reference schemas`` writes them again, and a test
fails when the committed files differ from the models.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_DIR = ROOT / "docs" / "reference" / "schemas"
MARKER = re.compile(r"^<!-- reference: ([a-z-]+) -->$", re.M)


# --- the CLI ---------------------------------------------------------------------------------


def _commands(group: click.Group, path: list[str]) -> list[tuple[list[str], click.Command]]:
    found: list[tuple[list[str], click.Command]] = []
    for name in sorted(group.commands):
        command = group.commands[name]
        found.append((path + [name], command))
        if isinstance(command, click.Group):
            found += _commands(command, path + [name])
    return found


def render_cli() -> str:
    """One section per command, holding the help text Click prints for it."""
    from proofline.cli import main

    out = []
    for path, command in _commands(main, []):
        with click.Context(command, info_name=" ".join(["proofline", *path])) as ctx:
            text = command.get_help(ctx)
        out += [f"### `proofline {' '.join(path)}`", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(out)


# --- settings --------------------------------------------------------------------------------


def _field_comments(cls: type) -> dict[str, str]:
    """The ``#:`` comment lines directly above each annotated field of a class, joined."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    comments = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, row = [], node.lineno - 2
            while row >= 0 and lines[row].strip().startswith("#:"):
                above.insert(0, lines[row].strip()[2:].strip())
                row -= 1
            comments[node.target.id] = " ".join(above)
    return comments


def _default(name: str, field) -> str:
    """The default as a reader would write it: no machine's paths, factories described."""
    from pydantic import SecretStr

    from proofline import settings as s

    described = {"state_dir": "`$XDG_STATE_HOME/proofline/install-<hash>`, else `~/.local/state/proofline/install-<hash>` (one folder per installed copy)",
                 "worker_concurrency": "twice the processors", "worker_id": "`<node name or host>:<pid>`",
                 "accepted_policy_versions": "`[5]`"}
    if name in described:
        return described[name]
    value = field.default
    if value is None:
        return "–"
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, Path):
        for base, shown in ((s.PACKAGED_CONTRACTS_DIR.parent.parent, "proofline"),):
            if value.is_relative_to(base):
                return f"the package's `{shown}/{value.relative_to(base).as_posix()}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str) and not value:
        return "–"
    return f"`{value}`"


def _cell(text: str) -> str:
    text = re.sub(r"``([^`]+)``", r"`\1`", text).replace("|", "\\|")
    return text or "–"


def _outside_settings(fields: set[str]) -> dict[str, list[str]]:
    """``PROOFLINE_*`` names runtime code reads without the settings object, with where."""
    seen: dict[str, list[str]] = {}
    for package in ("proofline", "worker", "ledger", "recovery"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            for name in set(re.findall(r"[\"'](PROOFLINE_[A-Z0-9_]+)[\"']", path.read_text())):
                if name[len("PROOFLINE_"):].lower() not in fields:
                    seen.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    return seen


def render_settings() -> str:
    from proofline.settings import Settings

    comments = _field_comments(Settings)
    lines = ["| environment variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        env = f"`PROOFLINE_{name.upper()}`"
        lines.append(f"| {env} | {_cell(_default(name, field))} | {_cell(comments.get(name, ''))} |")
    lines += ["", "Read directly by the module named, not through the settings object:", "",
              "| environment variable | read in |", "|---|---|"]
    for name, where in sorted(_outside_settings(set(Settings.model_fields)).items()):
        lines.append(f"| `{name}` | {', '.join(f'`{w}`' for w in where)} |")
    return "\n".join(lines) + "\n"


# --- reason codes ----------------------------------------------------------------------------


def render_reason_codes() -> str:
    from proofline import errors

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, errors.ProoflineError)
               and (c.__module__ == errors.__name__ or c.__module__.startswith(errors.__name__ + "."))]
    classes.sort(key=lambda c: c.code)
    lines = ["| code | error class (kind of) | retried | what it means |", "|---|---|---|---|"]
    for cls in classes:
        parent = cls.__mro__[1].__name__ if cls is not errors.ProoflineError else "–"
        doc = " ".join((cls.__doc__ or "").split())
        retried = "yes" if cls.retryable else "no"
        lines.append(f"| `{cls.code}` | `{cls.__name__}` ({parent}) | {retried} | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


# --- alerts ----------------------------------------------------------------------------------


ALERTS_FILE = ROOT / "ops" / "prometheus" / "alerts.yml"


def alert_rules() -> list[dict]:
    import yaml

    groups = yaml.safe_load(ALERTS_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def render_alerts() -> str:
    """Every rule of ops/prometheus/alerts.yml: name (linked to its runbook), severity, how long it
    must hold, and its summary."""
    lines = ["| alert | severity | for | fires when |", "|---|---|---|---|"]
    for rule in alert_rules():
        name = rule["alert"]
        summary = rule.get("annotations", {}).get("summary", "")
        lines.append(f"| [{name}](#{name.lower()}) | {rule.get('labels', {}).get('severity', '–')} | "
                     f"{rule.get('for', '–')} | {_cell(summary)} |")
    return "\n".join(lines) + "\n"


RENDERERS = {"cli": render_cli, "settings": render_settings, "reason-codes": render_reason_codes,
             "alerts": render_alerts}


def render(name: str) -> str:
    if name not in RENDERERS:
        raise KeyError(f"no reference named {name!r}; known: {', '.join(sorted(RENDERERS))}")
    return RENDERERS[name]()


def expand(markdown: str) -> str:
    """A page's markdown with every reference marker replaced by what it names."""
    return MARKER.sub(lambda m: render(m.group(1)), markdown)


# --- JSON Schemas ----------------------------------------------------------------------------


def contract_schema() -> dict:
    from proofline.contracts import Contract

    schema = Contract.model_json_schema(mode="validation")
    schema["properties"].pop("digest", None)  # filled in by the loader, never written in a file
    schema["title"] = "Proofline action contract"
    schema["description"] = "One YAML file per action type in PROOFLINE_CONTRACTS_DIR (proofline/contracts.py)."
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def servers_schema() -> dict:
    """The file as ``worker/servers.py::load_servers`` reads it: a server is an endpoint (the write
    identity) plus ``expected_version``, ``max_result_bytes`` and a required ``read_identity``, an
    endpoint whose fields all default to the writer's."""
    from proofline.server_requests import ServerRequestPolicy
    from worker.servers import Endpoint

    endpoint = Endpoint.model_json_schema(mode="validation", ref_template="#/$defs/{model}")
    defs = endpoint.pop("$defs", {})
    defs["ServerRequestPolicy"] = ServerRequestPolicy.model_json_schema(mode="validation")
    defs["Endpoint"] = endpoint
    read = {"type": "object", "description": "The read-only identity verification uses: the writer's fields "
            "unless given here, never its credentials, its writable paths bound read-only.",
            "properties": endpoint["properties"], "additionalProperties": False}
    server = {"type": "object", "additionalProperties": False,
              "required": [*endpoint.get("required", []), "read_identity"],
              "properties": {**endpoint["properties"],
                             "expected_version": {"type": "string", "description": "The server version approvals "
                                                  "expect; a live server reporting another is refused."},
                             "max_result_bytes": {"type": "integer", "exclusiveMinimum": 0,
                                                  "description": "Largest result this server may return (bytes); "
                                                  "lowers the settings' limit, never raises it."},
                             "tool_list_max_age_seconds": {"type": "number", "minimum": 0,
                                                           "description": "How long a worker session reuses "
                                                           "this server's tool list (seconds; 0: list on every "
                                                           "action); default: the setting."},
                             "server_requests": {"$ref": "#/$defs/ServerRequestPolicy"},
                             "read_identity": read}}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "Proofline servers file",
            "description": "PROOFLINE_SERVERS_FILE (worker/servers.py). String values may name environment "
            "variables as ${NAME}; $$ is a literal $.",
            "type": "object", "required": ["servers"], "additionalProperties": False,
            "properties": {"servers": {"type": "object", "additionalProperties": {"$ref": "#/$defs/Server"}},
                           "import_mcp_json": {"type": "array", "items": {"type": "string"},
                                               "description": "MCP client files (an mcpServers object) whose "
                                               "servers are added, converted as `proofline servers import` "
                                               "does; this file's own entries of the same name win."}},
            "$defs": {**defs, "Server": server}}


def authority_schema() -> dict:
    """The authority policy a person writes (before ``proofline authority sign``)."""
    from proofline.authority import AuthorityPolicy

    schema = AuthorityPolicy.model_json_schema(mode="validation")
    schema["title"] = "Proofline authority policy"
    schema["description"] = "The YAML an approver signs with `proofline authority sign` (proofline/authority.py)."
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


SCHEMAS = {"contract.schema.json": contract_schema, "servers.schema.json": servers_schema,
           "authority.schema.json": authority_schema}


def schema_text(name: str) -> str:
    return json.dumps(SCHEMAS[name](), indent=2, sort_keys=True) + "\n"


def write_schemas() -> list[Path]:
    SCHEMA_DIR.mkdir(parents=True, exist_ok=True)
    written = []
    for name in SCHEMAS:
        path = SCHEMA_DIR / name
        path.write_text(schema_text(name))
        written.append(path)
    return written


if __name__ == "__main__":
    if sys.argv[1:] == ["schemas"]:
        for path in write_schemas():
            print(path.relative_to(ROOT))
    elif len(sys.argv) == 2 and sys.argv[1] in RENDERERS:
        print(render(sys.argv[1]))
    else:
        sys.exit(f"usage: python -m ops.docs_reference schemas | {' | '.join(RENDERERS)}")
