"""What bounding CEL evaluation costs, and what the static limits leave.

``python -m ops.cel_bench [--n 2000]`` measures, in one run, the cost per evaluation of a typical
contract precondition:

- in process, program cached by its text, as the baseline;
- in process, from the contract's set compiled once per contract digest;
- the same with the variables converted to CEL once per set (what the worker does: every
  condition of one stage evaluates against one ``Variables``);
- compiled at every evaluation (what caching saves);
- the static limit check alone (uncached), which every new expression pays once;
- an expression with a comprehension in process, and through the watchdog's helper process (what
  the runtime does for those: ``proofline/cel_watchdog.py``);
- a persistent evaluator subprocess over a multiprocessing pipe (pickle instead of JSON lines);
- a fresh process per evaluation (fork), the simplest watchdog;

and prints each as a ratio of the baseline. Then it times the costliest expressions the static
limits still admit (one comprehension over the longest list allowed, with string concatenation in
its body over a large input), so the residual bound is a measured number, not a guess.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any

from proofline.cel_limits import DEFAULT_LIMITS, check
from proofline.conditions import Variables, _compile, compiled_for, evaluate, evaluate_here

EXPR = "before.account.tenant == envelope.tenant && before.account.balance_cents >= args.amount_cents"
COMPREHENSION = "before.refunds.exists(r, r.id == args.refund_id && r.status == 'issued')"
VARIABLES = {"envelope": {"tenant": "acme"}, "args": {"amount_cents": 1500},
             "before": {"found": True, "account": {"tenant": "acme", "balance_cents": 100_000, "version": 3},
                        "refunds": [{"id": f"R-{i}", "status": "issued"} for i in range(5)]}}


def _per_call(fn, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n


def _serve(conn: Any) -> None:
    while True:
        message = conn.recv()
        if message is None:
            return
        source, variables = message
        conn.send(evaluate(source, variables))


def _fork_one(source: str, variables: dict[str, Any]) -> None:
    evaluate(source, variables)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--json", default=None)
    n = parser.parse_args().n
    evaluate(EXPR, VARIABLES)
    figures: dict[str, float] = {}
    figures["in_process_cached"] = _per_call(lambda: evaluate(EXPR, VARIABLES), n)
    # The worker evaluates a contract's expressions from its set compiled once per digest.
    compiled = compiled_for("cel-bench", lambda: [EXPR])
    figures["contract_digest_set"] = _per_call(lambda: evaluate(EXPR, VARIABLES, compiled), n)
    bound = Variables(VARIABLES)
    figures["digest_set_bound_variables"] = _per_call(lambda: evaluate(EXPR, bound, compiled), n)
    figures["compiled_every_time"] = _per_call(lambda: _compile(EXPR)[0].execute(VARIABLES), n)
    figures["static_check"] = _per_call(lambda: check(EXPR), n)
    comp_vars = {**VARIABLES, "args": {"refund_id": "R-4"}}
    figures["comprehension_in_process"] = _per_call(lambda: evaluate_here(COMPREHENSION, comp_vars), n)
    evaluate(COMPREHENSION, comp_vars)  # starts the watchdog's helper
    figures["comprehension_watchdog"] = _per_call(lambda: evaluate(COMPREHENSION, comp_vars), n)

    parent, child = mp.Pipe()
    server = mp.get_context("fork").Process(target=_serve, args=(child,), daemon=True)
    server.start()

    def round_trip() -> None:
        parent.send((EXPR, VARIABLES))
        parent.recv()

    round_trip()
    figures["persistent_subprocess"] = _per_call(round_trip, n)
    parent.send(None)
    server.join(5)

    ctx = mp.get_context("fork")

    def fork_one() -> None:
        p = ctx.Process(target=_fork_one, args=(EXPR, VARIABLES))
        p.start()
        p.join()

    figures["fork_per_call"] = _per_call(fork_one, max(20, n // 50))

    base = figures["in_process_cached"]
    print(f"{'evaluation':<24} {'µs/call':>10} {'× baseline':>11}")
    for name, seconds in figures.items():
        print(f"{name:<24} {seconds * 1e6:>10.1f} {seconds / base:>11.1f}")

    # The costliest shapes the limits admit: one comprehension over the longest list allowed,
    # evaluated in process here (through the watchdog the runtime stops them at its budget).
    items = list(range(DEFAULT_LIMITS.max_list_items))
    big = "x" * (200 * 1024)  # inside a 256 KiB envelope together with the list
    worst = {
        "exists over 1000 items, 20 string concatenations of 200 KiB each in the body":
            "args.items.exists(i, size(" + " + ".join(["args.s"] * 20) + ") < 0)",
    }
    residual = {}
    for label, expr in worst.items():
        check(expr)
        started = time.perf_counter()
        try:
            evaluate_here(expr, {"args": {"items": items, "s": big}})
        except Exception as exc:  # noqa: BLE001 - the figure is the time, whatever the verdict
            label += f" ({type(exc).__name__})"
        residual[label] = time.perf_counter() - started
        print(f"worst case: {label}: {residual[label]:.2f} s")
    if parser.parse_args().json:
        with open(parser.parse_args().json, "w") as fh:
            json.dump({"per_call_seconds": figures, "residual_seconds": residual}, fh, indent=2)


if __name__ == "__main__":
    main()
