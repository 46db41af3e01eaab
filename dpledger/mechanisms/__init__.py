"""mechanisms."""

__all__: list[str] = []
