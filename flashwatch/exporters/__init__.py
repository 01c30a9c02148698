"""Exporters: where a monitored step's snapshot goes (Prometheus, JSONL, console)."""
