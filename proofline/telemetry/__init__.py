"""Telemetry: metrics (Prometheus), traces (OpenTelemetry), structured logs. Nothing here changes
what the runtime decides; everything here can be switched off."""
