"""``proofline ledger export``: settled actions, ledger events and evidence findings, one file per
kind, as JSON Lines or Parquet, for analysis outside Postgres.

The schema is stable and versioned (:data:`SCHEMA_VERSION`, every row carries it; documented in
docs/reference/export.md, and ``tests`` keep the page equal to :data:`KINDS`). Rows stream through
server-side cursors and are written in batches, so an export never holds the ledger in memory.
Only what the ledger stores is written: the redacted envelope copy, redacted results and evidence;
never the sealed message or its signature. Parquet needs ``pyarrow`` (``pip install proofline[export]``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from proofline.errors import ConfigurationError

SCHEMA_VERSION = 1
FORMATS = ("jsonl", "parquet")
#: Rows per Parquet row group (and per fetch from the server-side cursor).
BATCH = 2000

#: The events whose evidence is a finding about the system of record.
FINDING_EVENTS = ("evidence_read", "verification_finished", "evidence_signed")


@dataclass(frozen=True)
class Column:
    name: str
    #: "string", "int64", "timestamp" (UTC, microseconds) or "json" (a JSON text).
    type: str
    doc: str


@dataclass(frozen=True)
class Kind:
    name: str
    doc: str
    columns: tuple[Column, ...]
    #: SELECT ... with %(since)s / %(until)s bounds (NULL: unbounded), in a stable order.
    sql: str


def _c(name: str, type_: str, doc: str) -> Column:
    return Column(name, type_, doc)


_BOUND = "(%(since)s::timestamptz IS NULL OR {t} >= %(since)s) AND (%(until)s::timestamptz IS NULL OR {t} < %(until)s)"
_SETTLED = "('closed', 'cancelled', 'escalated')"

KINDS: tuple[Kind, ...] = (
    Kind("actions", "settled actions (closed, cancelled, escalated), bounded by updated_at", (
        _c("schema_version", "int64", "the export schema version"),
        _c("action_id", "string", "the action"), _c("run_id", "string", "its run"),
        _c("step", "int64", "its step in the run"), _c("tenant", "string", "tenant"),
        _c("action_type", "string", "contract action type"), _c("server", "string", "MCP server"),
        _c("tool", "string", "tool"), _c("kind", "string", "action, or compensation"),
        _c("parent_action_id", "string", "the action a compensation undoes"),
        _c("status", "string", "final status"), _c("outcome", "string", "outcome class"),
        _c("finding", "string", "verification finding"), _c("reason_code", "string", "reason code"),
        _c("retention_class", "string", "explicit retention class (null: the contract's)"),
        _c("published_at", "timestamp", "when published"), _c("updated_at", "timestamp", "when settled"),
        _c("deadline", "timestamp", "the envelope's deadline"),
        _c("ledger_seq", "int64", "events in its chain"), _c("ledger_head", "string", "its chain's head hash"),
        _c("envelope", "json", "the stored (redacted) envelope"), _c("result", "json", "the stored (redacted) result"),
    ), f"""SELECT action_id, run_id, step, tenant, action_type, server, tool, kind, parent_action_id,
              status::text, outcome::text, finding, reason_code, retention_class, published_at,
              updated_at, deadline, ledger_seq, ledger_head, envelope, result
         FROM actions WHERE status::text IN {_SETTLED} AND {_BOUND.format(t="updated_at")}
        ORDER BY updated_at, action_id"""),
    Kind("events", "every ledger event, bounded by its time", (
        _c("schema_version", "int64", "the export schema version"),
        _c("id", "int64", "the event's row id"), _c("chain", "string", "its chain (an action id, or a named chain)"),
        _c("seq", "int64", "its place in the chain"), _c("event", "string", "event name"),
        _c("actor", "string", "who appended it"), _c("at", "timestamp", "when"),
        _c("evidence", "json", "its (redacted) evidence"), _c("prev_hash", "string", "the previous event's hash"),
        _c("hash", "string", "its hash"),
    ), f"""SELECT id, action_id AS chain, seq, event, actor, at, evidence, prev_hash, hash
         FROM ledger_events WHERE {_BOUND.format(t="at")} ORDER BY id"""),
    Kind("findings", "evidence findings (" + ", ".join(FINDING_EVENTS) + "), bounded by their time", (
        _c("schema_version", "int64", "the export schema version"),
        _c("event_id", "int64", "the event's row id"), _c("action_id", "string", "the action"),
        _c("seq", "int64", "the event's place in the chain"), _c("event", "string", "event name"),
        _c("at", "timestamp", "when"), _c("actor", "string", "who read"),
        _c("finding", "string", "what the read showed"), _c("source", "string", "evidence source (null: primary)"),
        _c("tool", "string", "the read tool"), _c("reads", "int64", "reads made"),
        _c("failed_reads", "int64", "reads that failed"), _c("mcp_connection", "string", "the MCP session of the reads"),
        _c("evidence", "json", "the whole (redacted) evidence"),
    ), f"""SELECT id AS event_id, action_id, seq, event, at, actor,
              COALESCE(evidence->>'finding', evidence->'statement'->>'finding') AS finding,
              evidence->>'source' AS source, COALESCE(evidence->>'tool', evidence->>'read_tool') AS tool,
              CASE WHEN jsonb_typeof(evidence->'reads') = 'number' THEN (evidence->>'reads')::bigint END AS reads,
              CASE WHEN jsonb_typeof(evidence->'failed_reads') = 'number'
                   THEN (evidence->>'failed_reads')::bigint END AS failed_reads,
              evidence->>'mcp_connection' AS mcp_connection, evidence
         FROM ledger_events
        WHERE event IN ({", ".join(f"'{e}'" for e in FINDING_EVENTS)}) AND {_BOUND.format(t="at")}
        ORDER BY id"""),
)


def _value(column: Column, value: Any) -> Any:
    if value is None:
        return None
    if column.type == "json":
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return value


def rows(conn: Any, kind: Kind, since: datetime | None, until: datetime | None) -> Iterator[list[dict[str, Any]]]:
    """The kind's rows in batches, from a server-side cursor (one transaction: one snapshot)."""
    with conn.transaction(), conn.cursor(name=f"ledger_export_{kind.name}") as cur:
        cur.itersize = BATCH
        cur.execute(kind.sql, {"since": since, "until": until})
        while batch := cur.fetchmany(BATCH):
            yield [{c.name: SCHEMA_VERSION if c.name == "schema_version" else _value(c, r.get(c.name))
                    for c in kind.columns} for r in batch]


def _jsonl(path: Path, batches: Iterator[list[dict[str, Any]]]) -> int:
    n = 0
    with path.open("w", encoding="utf-8") as out:
        for batch in batches:
            for row in batch:
                out.write(json.dumps({k: v.isoformat() if isinstance(v, datetime) else v for k, v in row.items()},
                                     ensure_ascii=False, separators=(",", ":")) + "\n")
            n += len(batch)
    return n


def _arrow_schema(kind: Kind) -> Any:
    import pyarrow as pa

    types = {"string": pa.string(), "json": pa.string(), "int64": pa.int64(), "timestamp": pa.timestamp("us", tz="UTC")}
    return pa.schema([pa.field(c.name, types[c.type], nullable=c.name != "schema_version") for c in kind.columns],
                     metadata={"proofline.export.kind": kind.name, "proofline.export.schema_version": str(SCHEMA_VERSION)})


def _parquet(path: Path, kind: Kind, batches: Iterator[list[dict[str, Any]]]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema, n = _arrow_schema(kind), 0
    with pq.ParquetWriter(path, schema) as writer:
        for batch in batches:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            n += len(batch)
        if n == 0:
            writer.write_table(schema.empty_table())
    return n


def export(conn: Any, out: Path, fmt: str, since: datetime | None = None,
           until: datetime | None = None) -> dict[str, Any]:
    """Write one file per kind into ``out`` and a ``manifest.json``; returns the manifest."""
    if fmt not in FORMATS:
        raise ConfigurationError(f"export format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ConfigurationError("Parquet export needs pyarrow: pip install 'proofline[export]'") from None
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {}
    for kind in KINDS:
        path = out / f"{kind.name}.{fmt}"
        batches = rows(conn, kind, since, until)
        n = _jsonl(path, batches) if fmt == "jsonl" else _parquet(path, kind, batches)
        files[kind.name] = {"file": path.name, "rows": n}
    manifest = {"schema_version": SCHEMA_VERSION, "format": fmt, "since": since.isoformat() if since else None,
                "until": until.isoformat() if until else None, "files": files}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def schema_markdown() -> str:
    """The column tables of docs/reference/export.md (kept equal by a test)."""
    parts = []
    for kind in KINDS:
        parts.append(f"### `{kind.name}`\n\n{kind.doc[0].upper() + kind.doc[1:]}.\n\n| column | type | meaning |\n|---|---|---|")
        parts += [f"| `{c.name}` | {c.type} | {c.doc} |" for c in kind.columns]
        parts.append("")
    return "\n".join(parts)
