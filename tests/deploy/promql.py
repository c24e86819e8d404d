"""A small PromQL reader for the dashboard test: the metric names and label names an expression uses.

Not a parser: enough of PromQL's lexical shape to find every series selector (`name{matchers}` or a bare
name), every label matcher, and every label list (`by`, `without`, `on`, `ignoring`, `group_left`,
`group_right`), and to tell them from functions, aggregations, keywords, durations and numbers. A name it
does not know followed by `(` is reported as an unknown function, so a typo cannot pass as a metric.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

FUNCTIONS = frozenset({
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "count_over_time", "day_of_month", "day_of_week", "delta", "deriv", "exp", "floor", "histogram_quantile",
    "holt_winters", "idelta", "increase", "irate", "label_join", "label_replace", "last_over_time", "ln", "log2",
    "log10", "max_over_time", "min_over_time", "predict_linear", "quantile_over_time", "rate", "resets", "round",
    "scalar", "sgn", "sort", "sort_desc", "sqrt", "stddev_over_time", "sum_over_time", "time", "timestamp",
    "vector",
})
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                          "bottomk", "topk", "quantile"})
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                      "unless", "offset", "inf", "nan"})
# Grafana's variables, replaced by something PromQL would accept before reading.
GRAFANA_VARIABLES = re.compile(r"\$__(rate_interval|interval|range)|\$\{__(rate_interval|interval|range)\}")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^{}]*)\}")
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*")\s*,?')
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"(?<![A-Za-z0-9_:.])\d+(\.\d+)?([eE][+-]?\d+)?")


class PromQLError(ValueError):
    pass


@dataclass
class Usage:
    """What one expression reads: metric -> {label: [literal values of `=` matchers]}, and label-list names."""

    metrics: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    grouping: set[str] = field(default_factory=set)


def extract(expr: str) -> Usage:
    usage = Usage()
    text = GRAFANA_VARIABLES.sub("5m", expr)
    depth = 0
    for char in _STRING.sub('""', text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            break
    if depth != 0:
        raise PromQLError(f"unbalanced parentheses in {expr!r}")

    def selector(match: re.Match[str]) -> str:
        name, body = match.group(1), match.group(2)
        if name is None or name in KEYWORDS:
            raise PromQLError(f"selector without a metric name in {expr!r}")
        labels = usage.metrics.setdefault(name, {})
        rest = _MATCHER.sub(lambda m: _matcher(labels, m), body)
        if rest.strip():
            raise PromQLError(f"unreadable matchers {rest!r} in {expr!r}")
        return f" {name} "

    text = _SELECTOR.sub(selector, text)
    # Function arguments that are strings (label_replace) name no metric; none of ours uses them.
    if _STRING.search(text):
        raise PromQLError(f"string literal outside a selector in {expr!r}: not supported by this reader")
    text = _RANGE.sub(" ", text)

    def label_list(match: re.Match[str]) -> str:
        usage.grouping.update(n.strip() for n in match.group(2).split(",") if n.strip())
        return " "

    text = _LABEL_LIST.sub(label_list, text)
    text = _NUMBER.sub(" ", text)
    for match in _IDENT.finditer(text):
        name = match.group(0)
        called = text[match.end():].lstrip().startswith("(")
        if called:
            if name not in FUNCTIONS and name not in AGGREGATIONS:
                raise PromQLError(f"unknown function {name}() in {expr!r}")
        elif name.lower() not in KEYWORDS:
            usage.metrics.setdefault(name, {})
    if "{" in text or "}" in text:
        raise PromQLError(f"unbalanced braces in {expr!r}")
    return usage


def _matcher(labels: dict[str, list[str]], match: re.Match[str]) -> str:
    name, op, quoted = match.groups()
    values = labels.setdefault(name, [])
    if op == "=":
        values.append(quoted[1:-1])
    return ""


def label_values_query(query: str) -> tuple[str, str]:
    """A Grafana `label_values(selector, label)` variable query: (the selector expression, the label)."""
    match = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", query)
    if match is None:
        raise PromQLError(f"not a label_values() query: {query!r}")
    return match.group(1), match.group(2)
