"""``python -m proofline_kit.audit feed|serve``: run the audit system's feed or its MCP server."""

from proofline_kit.audit.server import main

main()
