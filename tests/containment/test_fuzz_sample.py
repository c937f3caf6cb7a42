"""A small sample of the fuzz campaign (ops/fuzz.py runs the full one): damaged envelopes through
validation and refusal recording on a real Postgres, and damaged raw messages through a real Redis
and a real supervised worker. Every refusal must be recordable, every message must leave a record,
and the consumer must never die."""

from __future__ import annotations

from pathlib import Path

from ops.fuzz import broker_campaign, validation_campaign
from proofline.settings import Settings
from tests.conftest import create_database, drop_database


def test_damaged_envelopes_are_all_refused_with_a_record() -> None:
    admin, runtime_url = create_database("pl_fuzz")
    try:
        report = validation_campaign(400, seed=11, database_url=runtime_url, settings=Settings())
    finally:
        drop_database(admin)
    assert report["unrecordable"] == 0, report["failures"]
    assert report["refused_recorded"] + report["accepted"] == 400
    assert report["refusal_events_in_ledger"] == report["refused_recorded"]
    assert report["refused_recorded"] > 350 and report["through_wire"] > 100


def test_damaged_broker_messages_never_crash_the_consumer_or_vanish(tmp_path: Path) -> None:
    report = broker_campaign(80, seed=12, workdir=tmp_path)
    assert report["without_record"] == 0, report["missing_examples"]
    assert not report["consumer_replaced"] and report["worker_starts"] == 1 and report["workers_alive"]
    assert len(report["refusal_reasons"]) >= 5, report["refusal_reasons"]
