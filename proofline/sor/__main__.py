"""``python -m proofline.sor``: run the system-of-record MCP server."""

from proofline.sor.server import main

main()
