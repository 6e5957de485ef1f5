"""The samples of a /metrics answer, read by prometheus_client's own parser (the text format 0.0.4)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str | bytes) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset of (label, value)): value} of every sample in text.

    Raises:
        ValueError: text is not valid Prometheus text (the parser's error).
    """
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str | bytes, name: str, **labels: str) -> float | None:
    """The value of the sample name with exactly these labels, or None when there is none."""
    return samples(text).get((name, frozenset(labels.items())))
