# One image for every Proofline process: workers, beat, Flower, migrations, the demo MCP server.
# The product is installed from its built wheel (not editable, no source tree in the runtime image),
# so nothing depends on the current directory: docker-compose.yml names every path it uses.

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proofline ./proofline
COPY worker ./worker
COPY ledger ./ledger
COPY recovery ./recovery
COPY proofline_kit ./proofline_kit
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# bubblewrap sandboxes stdio tool servers (worker/sandbox.py); sh (dash) applies their rlimits.
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap strace && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/proofline-*.whl && rm -rf /wheels
# Configuration outside the package, at the paths docker-compose.yml sets (PROOFLINE_CONTRACTS_DIR,
# PROOFLINE_SERVERS_FILE): the demo's contracts and the compose servers file. Mount your own over them.
COPY proofline/defaults/contracts /etc/proofline/contracts
COPY ops/servers.compose.yaml /etc/proofline/servers.yaml
# Sets the SCRAM password of each database role after migrations (the compose `migrate` service).
COPY ops/role_password.py /opt/proofline/role_password.py
# /var/lib/proofline: PROOFLINE_STATE_DIR (beat's schedule, default checkpoints). /keys/*: mount
# points for the key volumes, owned by the runtime user and closed to others.
RUN useradd --create-home --uid 10001 proofline && mkdir -p /data /var/lib/proofline /checkpoints \
    /keys/master /keys/controller /keys/recovery /keys/worker \
    && chown -R proofline /data /var/lib/proofline /checkpoints /keys \
    && chmod 700 /keys/master /keys/controller /keys/recovery /keys/worker
USER proofline
WORKDIR /var/lib/proofline
