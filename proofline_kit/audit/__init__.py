"""The demo's second system: an audit log and monitoring view, separate from the system of record.

Its own store (its own SQLite file), its own processes: ``feed`` copies the system of record's
applied effects into that store after a declared delay (as an audit pipeline or a metrics scrape
would), and ``serve`` is a read-only MCP server over it (``python -m proofline_kit.audit``).
Verification reads it as an independent evidence source: what the system of record claims but
never applied never reaches it.
"""
