"""``python -m proofline_kit.sor``: run the system-of-record MCP server."""

from proofline_kit.sor.server import main

main()
