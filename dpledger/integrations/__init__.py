"""Integrations with the tools people already train with (optional extras)."""

__all__: list[str] = []
