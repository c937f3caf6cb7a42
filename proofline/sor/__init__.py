"""A small system of record behind an MCP server: the downstream Proofline acts on and verifies.

``proofline.sor.store`` is the Python API over the SQLite file (tests seed, arm faults and count
effects through it); ``proofline.sor.server`` is the MCP server (``python -m proofline.sor``).
"""
