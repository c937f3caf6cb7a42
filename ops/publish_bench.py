"""What batching costs the controller: ``Client.publish`` one by one against ``Client.publish_many``.

``python -m ops.publish_bench [--actions 300] [--batch 50] [--json]`` creates a scratch ledger
database (``--admin-url``, default the local Postgres as ``postgres``), publishes the same kind of
envelope (``ticket.create``, bound to the checked-in pins: no tool server runs) both ways, and
reports per action: the ledger transactions (commits) that wrote it, counted exactly as the
distinct ``xmin`` of its ``published`` events (insert-only rows keep the id of the transaction
that wrote them; ``pg_stat_database`` lags and counts every session), and wall time as a ratio of
the one-by-one run. The broker is the
in-process ``memory://`` transport, so the figures are the ledger's and the controller's alone.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery

from ledger.migrate import upgrade
from proofline.client import Client
from proofline.keys import generate
from proofline.settings import Settings

TARGET = {"type": "ticket_queue", "id": "acme-ops"}


def _item(i: int) -> dict[str, Any]:
    return {"action_type": "ticket.create", "tenant": "acme", "target": TARGET,
            "arguments": {"tenant": "acme", "title": f"bench {i} {uuid.uuid4().hex[:8]}", "owner": "ops"}}


def _transactions(url: str, ids: list[str]) -> int:
    with psycopg.connect(url) as conn:
        return int(conn.execute("SELECT count(DISTINCT xmin::text) FROM ledger_events WHERE event = 'published' "
                                "AND action_id = ANY(%s)", (ids,)).fetchone()[0])


def run(actions: int, batch: int, admin_url: str) -> dict[str, Any]:
    name = f"pl_publish_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0]
    url = f"{base}/{name}"
    try:
        upgrade(url)
        keys = Path(tempfile.mkdtemp(prefix="publish-bench-keys-"))
        generate(keys, force=True, development=True)
        settings = Settings(database_url=url, keys_dir=keys)
        app = Celery("publish-bench", broker="memory://")
        figures: dict[str, Any] = {"actions": actions, "batch": batch}
        with Client(settings, app=app, database_url=url) as client:
            client.publish(**_item(-1))  # connections, contracts, keys and pins loaded before timing
            for mode in ("single", "batched"):
                started = time.perf_counter()
                if mode == "single":
                    ids = [client.publish(**_item(i)).action_id for i in range(actions)]
                else:
                    ids = [h.action_id for start in range(0, actions, batch)
                           for h in client.publish_many([_item(i) for i in range(start, min(actions, start + batch))])]
                elapsed = time.perf_counter() - started
                figures[f"{mode}_ms_per_action"] = round(elapsed * 1000 / actions, 3)
                figures[f"{mode}_commits_per_action"] = round(_transactions(url, ids) / actions, 3)
        figures["batched_time_ratio"] = round(figures["batched_ms_per_action"] / figures["single_ms_per_action"], 3)
        return figures
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actions", type=int, default=300)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    figures = run(args.actions, args.batch, args.admin_url)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for key, value in figures.items():
            print(f"{key:32} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
