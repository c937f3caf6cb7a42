# One image for every Proofline process: workers, beat, Flower, migrations, the demo MCP server.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
# bubblewrap sandboxes stdio tool servers (worker/sandbox.py); sh (dash) applies their rlimits;
# strace audits what the sandbox denies them (worker/sandbox_audit.py).
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap strace && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md celeryconfig.py servers.yaml ./
COPY proofline ./proofline
COPY worker ./worker
COPY ledger ./ledger
COPY recovery ./recovery
COPY contracts ./contracts
COPY schemas ./schemas
COPY ops ./ops
# /keys/*: mount points for the key volumes, owned by the runtime user and closed to others.
RUN pip install --no-cache-dir . && useradd --create-home --uid 10001 proofline && mkdir -p /data /app/var \
    /keys/master /keys/controller /keys/recovery /keys/worker \
    && chown -R proofline /data /app/var /keys && chmod 700 /keys/master /keys/controller /keys/recovery /keys/worker
USER proofline
