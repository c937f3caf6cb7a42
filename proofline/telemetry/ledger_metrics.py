"""The exporter's metrics, computed from Postgres at each scrape: the ledger's own count of every
event counter (``proofline_ledger_<name>_total``, the same table the workers count from), gauges
of what is open now (stuck actions, queue age, unknown outcomes, expired leases, irreversible
actions awaiting review), cancellation-to-containment latency, and the broker's queue depths.

Every number here agrees with the ledger by construction; the workers' counters agree with these
when every write went through a worker that has been up since the ledger began (restarts reset a
worker's counters, never the ledger's). Each scrape reads the whole event table once, filtered
to the counted events: scrape it every 30 s or slower on a large ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import psycopg
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from psycopg.rows import dict_row

from proofline.shards import REDIS_PRIORITY_SUFFIXES
from proofline.telemetry.events import COUNTED_EVENTS, COUNTERS, EventCounter, bounded_sql, tenant_sql

log = logging.getLogger(__name__)

#: Statuses an action can wait or stick in; the age of the oldest one in each is exported.
OPEN_STATUSES = ("pending", "published", "proposed", "executing", "verifying", "recovery", "escalated")
CANCEL_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 900, 3600)
#: Queues that are not sharded by tenant; ``actions`` and ``verify`` are expanded to their shards.
PLAIN_QUEUES = ("compensate", "recovery", "reconcile", "checkpoint")
#: Brokers whose queue depths the exporter reads: Redis (list lengths) and AMQP (queue.declare, passive).
_READABLE_BROKERS = ("redis://", "rediss://", "amqp://", "amqps://", "pyamqp://")


def _counter_sql(counter: EventCounter) -> str:
    labels = [bounded_sql("e.action_type"), tenant_sql("e.tenant")]
    if counter.irreversible:
        labels.append("CASE WHEN e.irreversible = 'true' THEN 'true' ELSE 'false' END")
    labels += [p.sql() for p in counter.labels]
    events = ", ".join(f"'{name}'" for name in counter.events)
    where = " AND ".join([f"e.event IN ({events})", *(c.sql() for c in counter.when)])
    return (f"SELECT '{counter.name}' AS counter, ARRAY[{', '.join(labels)}] AS labels, count(*) AS n "
            f"FROM ev e WHERE {where} GROUP BY 2")


#: One statement, one scan of the counted events: every counter's totals by label set.
COUNTERS_SQL = (
    "WITH ev AS MATERIALIZED (SELECT l.event, l.evidence, a.action_type, a.tenant, "
    "a.envelope->>'irreversible' AS irreversible "
    "FROM ledger_events l LEFT JOIN actions a ON a.action_id = l.action_id WHERE l.event = ANY(%(events)s))\n"
    + "\nUNION ALL\n".join(_counter_sql(c) for c in COUNTERS)
)

ACTIONS_SQL = f"""SELECT action_type, {tenant_sql("tenant")} AS tenant, status::text AS status,
  coalesce(outcome::text, 'none') AS outcome, count(*) AS n
FROM actions GROUP BY 1, 2, 3, 4"""

OPEN_SQL = """SELECT status::text AS status, extract(epoch FROM clock_timestamp() - min(updated_at)) AS age
FROM actions WHERE status::text = ANY(%(open)s) GROUP BY 1"""

#: Open actions needing attention, by tenant: escalated (irreversible or not), outcome unknown.
ATTENTION_SQL = f"""SELECT {tenant_sql("tenant")} AS tenant,
  count(*) FILTER (WHERE status = 'escalated' AND envelope->>'irreversible' = 'true') AS review_irreversible,
  count(*) FILTER (WHERE status = 'escalated') AS review_all,
  count(*) FILTER (WHERE outcome = 'unknown_outcome' AND status NOT IN ('closed', 'cancelled')) AS unknown_open
FROM actions WHERE status = 'escalated' OR (outcome = 'unknown_outcome' AND status NOT IN ('closed', 'cancelled'))
GROUP BY 1"""

LEASES_SQL = """SELECT count(*) AS leases_expired FROM leases
WHERE released_at IS NULL AND expires_at < clock_timestamp()"""

CANCEL_SQL = """SELECT extract(epoch FROM updated_at - cancel_requested_at) AS seconds FROM actions
WHERE cancel_requested_at IS NOT NULL AND status IN ('cancelled', 'closed', 'escalated')"""


class LedgerCollector:
    """A prometheus_client collector reading the ledger (as a read-only role) at each scrape."""

    def __init__(self, database_url: str, broker_url: str | None = None, queues: list[str] | None = None,
                 tenants: frozenset[str] = frozenset()) -> None:
        self.database_url = database_url
        #: The tenants labelled by name (``PROOFLINE_TELEMETRY_TENANTS``); the others are "other".
        self.tenants = sorted(tenants)
        self.broker_url = broker_url if broker_url and broker_url.startswith(_READABLE_BROKERS) else None
        self.queues = queues or []
        self._conn: psycopg.Connection[dict[str, Any]] | None = None

    def _connection(self) -> psycopg.Connection[dict[str, Any]]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = psycopg.connect(self.database_url, autocommit=True, row_factory=dict_row,
                                         application_name="proofline-exporter", connect_timeout=10)
        return self._conn

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("proofline_ledger_up", "Whether the last scrape read the ledger")
        try:
            families = list(self._ledger_families())
        except psycopg.Error as exc:
            log.warning("ledger not readable: %s", type(exc).__name__, extra={"event": "exporter_ledger_error"})
            self._conn = None
            families = []
        up.add_metric([], 1.0 if families else 0.0)
        yield up
        yield from families
        if self.broker_url:
            yield from self._queue_families()

    def _ledger_families(self) -> Iterator[Any]:
        conn = self._connection()
        with conn.cursor() as cur:
            cur.execute(COUNTERS_SQL, {"events": sorted(COUNTED_EVENTS), "tenants": self.tenants})
            totals = list(cur.fetchall())
            cur.execute(ACTIONS_SQL, {"tenants": self.tenants})
            actions = list(cur.fetchall())
            cur.execute(OPEN_SQL, {"open": list(OPEN_STATUSES)})
            ages = {r["status"]: float(r["age"]) for r in cur.fetchall()}
            cur.execute(ATTENTION_SQL, {"tenants": self.tenants})
            attention = list(cur.fetchall())
            cur.execute(LEASES_SQL)
            leases = cur.fetchone()
            cur.execute(CANCEL_SQL)
            cancels = [float(r["seconds"]) for r in cur.fetchall()]
        for counter in COUNTERS:
            family = CounterMetricFamily(f"proofline_ledger_{counter.name}", f"{counter.doc} (from the ledger)",
                                         labels=list(counter.label_names))
            for row in totals:
                if row["counter"] == counter.name:
                    family.add_metric(list(row["labels"]), float(row["n"]))
            yield family
        by_status = GaugeMetricFamily("proofline_ledger_actions", "Actions by type, tenant, status and outcome",
                                      labels=["action_type", "tenant", "status", "outcome"])
        for row in actions:
            by_status.add_metric([row["action_type"], row["tenant"], row["status"], row["outcome"]], float(row["n"]))
        yield by_status
        oldest = GaugeMetricFamily("proofline_ledger_oldest_seconds", "Age of the oldest action in each open "
                                   "status since its last change (0 when none)", labels=["status"])
        for status in OPEN_STATUSES:
            oldest.add_metric([status], ages.get(status, 0.0))
        yield oldest
        review = GaugeMetricFamily("proofline_ledger_awaiting_review", "Escalated actions waiting for an operator",
                                   labels=["irreversible", "tenant"])
        unknown = GaugeMetricFamily("proofline_ledger_unknown_outcome_open", "Actions whose outcome is unknown and "
                                    "not yet settled", labels=["tenant"])
        # Zero series are exported for every tenant (a rule comparing with 0 sees the 0, not nothing).
        counts = {t: (0, 0, 0) for t in [*self.tenants, "other"]}
        counts.update({r["tenant"]: (r["review_irreversible"], r["review_all"], r["unknown_open"]) for r in attention})
        for tenant, (irreversible, every, open_) in counts.items():
            review.add_metric(["true", tenant], float(irreversible))
            review.add_metric(["false", tenant], float(every - irreversible))
            unknown.add_metric([tenant], float(open_))
        yield review
        yield unknown
        yield GaugeMetricFamily("proofline_ledger_leases_expired", "Leases past their expiry and not released",
                                value=float(leases["leases_expired"]))
        yield _histogram("proofline_ledger_cancellation_containment_seconds", "From a cancellation request to a "
                         "known final state", cancels, CANCEL_BUCKETS)

    def _queue_families(self) -> Iterator[Any]:
        depth = GaugeMetricFamily("proofline_queue_depth", "Messages waiting in each broker queue",
                                  labels=["queue"])
        try:
            lengths = self._amqp_lengths() if "amqp" in self.broker_url.split("://", 1)[0] else self._redis_lengths()
        except Exception as exc:  # noqa: BLE001 - an unreadable broker leaves the gauge out, never the scrape
            log.warning("broker not readable: %s", type(exc).__name__, extra={"event": "exporter_broker_error"})
            return
        for queue, length in zip(self.queues, lengths, strict=True):
            depth.add_metric([queue], float(length))
        yield depth

    def _redis_lengths(self) -> list[int]:
        import redis

        client = redis.Redis.from_url(self.broker_url, socket_timeout=5)
        try:
            with client.pipeline(transaction=False) as pipe:
                for queue in self.queues:
                    for suffix in REDIS_PRIORITY_SUFFIXES:
                        pipe.llen(queue + suffix)
                raw = pipe.execute()
        finally:
            client.close()
        step = len(REDIS_PRIORITY_SUFFIXES)
        return [sum(raw[i * step:(i + 1) * step]) for i in range(len(self.queues))]

    def _amqp_lengths(self) -> list[int]:
        """Ready messages per queue (a passive declare); a queue no worker declared yet holds none."""
        from kombu import Connection

        from worker.queue_depth import amqp_ready

        with Connection(self.broker_url, connect_timeout=5) as conn:
            ready = amqp_ready(conn, self.queues)
        return [ready[queue] for queue in self.queues]


def _histogram(name: str, doc: str, values: list[float], buckets: tuple[float, ...]) -> HistogramMetricFamily:
    cumulative = [(str(b), float(sum(1 for v in values if v <= b))) for b in buckets]
    cumulative.append(("+Inf", float(len(values))))
    return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=sum(values))
