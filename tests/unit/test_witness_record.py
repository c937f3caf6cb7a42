"""The witness's record keeping, without a server: the key it reads is the one the runtime sends,
answers and cancels are matched to their call, and a line too long to parse is skipped, not held."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from proofline.envelope import arguments_hash
from proofline_kit.witness import WitnessLog
from proofline_kit.witness.record import (
    ACTION_META,
    FENCING_META,
    KEY_META,
    LineSplitter,
    Observer,
    RecordWriter,
)
from worker import calls


def test_the_witness_reads_the_meta_keys_the_runtime_writes() -> None:
    assert (KEY_META, ACTION_META, FENCING_META) == (
        calls.IDEMPOTENCY_META_KEY, calls.ACTION_META_KEY, calls.FENCING_META_KEY)


def request(rpc_id: int, key: str, arguments: dict) -> dict:
    return {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call",
            "params": {"name": "create_ticket", "arguments": arguments, "_meta": {KEY_META: key, "progressToken": rpc_id}}}


def test_answers_progress_and_cancels_are_matched_to_their_call(tmp_path: Path) -> None:
    log = tmp_path / "w.jsonl"
    writer = RecordWriter(log)
    one, two = Observer(writer, "sor", "http"), Observer(writer, "sor", "http")
    one.client(request(1, "k1", {"a": 1}))
    two.client(request(1, "k2", {"a": 2}))  # the same JSON-RPC id on another connection
    two.server({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": 1, "progress": 1}})
    two.server({"jsonrpc": "2.0", "id": 1, "result": {"isError": True, "content": []}})
    one.client({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}})
    one.server({"jsonrpc": "2.0", "id": 7, "result": {}})  # answers nothing we forwarded
    witness = WitnessLog(log)
    first, second = witness.calls()
    assert (first.idempotency_key, first.answered, first.cancelled) == ("k1", False, True)
    assert (second.idempotency_key, second.is_error, second.progress, second.cancelled) == ("k2", True, 1, False)
    assert first.arguments_sha256 == arguments_hash({"a": 1})


def test_a_cancel_from_another_connection_is_matched_only_when_unambiguous(tmp_path: Path) -> None:
    writer = RecordWriter(tmp_path / "w.jsonl")
    a, b, canceller = (Observer(writer, "sor", "http") for _ in range(3))
    b.open_calls = canceller.open_calls = a.open_calls
    a.client(request(5, "ka", {}))
    canceller.client({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 5}})
    b.client(request(5, "kb", {}))  # now two open calls share id 5: a cancel cannot say which
    canceller.client({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 5}})
    cancels = WitnessLog(tmp_path / "w.jsonl").cancels()
    assert [(c.get("idempotency_key"), c.get("matched", True)) for c in cancels] == [("ka", True), (None, False)]


@given(st.lists(st.binary(max_size=40).filter(lambda b: b"\n" not in b), min_size=1, max_size=8),
       st.integers(min_value=1, max_value=17))
def test_lines_come_out_whole_however_the_bytes_are_chunked(lines: list[bytes], size: int) -> None:
    data = b"".join(line + b"\n" for line in lines)
    splitter, out = LineSplitter(limit=30), []
    for i in range(0, len(data), size):
        out += splitter.feed(data[i:i + size])
    assert out == [line for line in lines if line.strip() and len(line) <= 30]
