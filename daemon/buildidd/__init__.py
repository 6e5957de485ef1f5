"""buildidd: record every executable file mapping with the exact build-id."""

__version__ = "0.1.0"
