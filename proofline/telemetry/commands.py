"""``proofline exporter``: the ledger-derived metrics endpoint (one per deployment)."""

from __future__ import annotations

import signal
import threading

import click

from proofline.settings import get_settings, reveal


@click.command()
@click.option("--port", default=9465, show_default=True, help="port of the /metrics endpoint")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
def exporter(port: int, host: str) -> None:
    """Serve metrics computed from the ledger (counts of every event counter, open-action gauges,
    queue depths) so dashboards and alerts agree with the record. Connects as the reader role
    (PROOFLINE_READER_DATABASE_URL) when set, else PROOFLINE_DATABASE_URL."""
    from proofline.cli import role_queues
    from proofline.telemetry.ledger_metrics import LedgerCollector
    from proofline.telemetry.serve import serve_registry

    settings = get_settings()
    url = reveal(settings.reader_database_url or settings.database_url)
    queues = [*role_queues("all", settings.tenant_shards).split(","), "checkpoint"]
    collector = LedgerCollector(url, reveal(settings.broker_url), queues, settings.metric_tenants)
    server, thread = serve_registry(port, host, collector)
    click.echo(f"proofline exporter: serving http://{host}:{port}/metrics", err=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    thread.join(5)
