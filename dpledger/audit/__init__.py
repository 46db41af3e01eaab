"""audit."""

__all__: list[str] = []
