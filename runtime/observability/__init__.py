"""Logs, traces, OpenTelemetry metrics and progress: what every layer reports through."""
