"""A span exporter writing one JSON object per finished span to a file per process
(``<dir>/spans-<pid>.jsonl``): traces on a host without a collector, and in tests."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_record(span: ReadableSpan, pid: int | None = None) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent else None,
        "kind": span.kind.name, "start": span.start_time, "end": span.end_time,
        "status": span.status.status_code.name, "attributes": dict(span.attributes or ()),
        "events": [{"name": e.name, "attributes": dict(e.attributes or ())} for e in span.events],
        "service": (span.resource.attributes or {}).get("service.name"), "pid": pid or os.getpid(),
    }


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._out: Any = None
        self._pid = 0

    def _file(self) -> Any:
        # Named by the process that writes: a forked pool process opens its own.
        if self._out is None or self._pid != os.getpid():
            self.directory.mkdir(parents=True, exist_ok=True)
            self._out = open(self.directory / f"spans-{os.getpid()}.jsonl", "a", encoding="utf-8")  # noqa: SIM115
            self._pid = os.getpid()
        return self._out

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        out = self._file()
        pid = self._pid
        out.write("".join(json.dumps(span_record(span, pid), default=str) + "\n" for span in spans))
        out.flush()  # a reader (or a crash) sees every finished span
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._out is not None and self._pid == os.getpid():
            self._out.close()
        self._out = None
