"""The Celery worker: validates envelopes, holds leases, calls MCP tools, classifies outcomes."""
