"""A small system of record behind an MCP server: the downstream Proofline acts on and verifies.

``proofline_kit.sor.store`` is the Python API over the SQLite file (tests seed, arm faults and count
effects through it); ``proofline_kit.sor.server`` is the MCP server (``python -m proofline_kit.sor``).
"""
