"""Proofline kit: the demo system of record, the fault proxy and the tools tests, soak and bench
use. The runtime packages (proofline, worker, ledger, recovery) never import it."""
