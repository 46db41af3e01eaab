"""accountants."""

__all__: list[str] = []
