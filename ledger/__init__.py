"""The execution ledger: insert-only, hash-chained events and the state they project."""
