"""Proofline as an MCP server: agents call governed action types as tools (``proofline gateway``)."""
