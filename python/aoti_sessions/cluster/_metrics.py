"""The cluster's ``/metrics``: every replica's exposition text, each sample
labelled with its ``replica``, then the cluster's totals (the sum over
replicas of every sample, without the label), then the ingress's own."""

from __future__ import annotations

import re
from collections import OrderedDict

from ..serve._metrics import format_number

# name, {labels} (quoted values may hold '}'), value
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})? (\S+)$')
_FAMILY_SUFFIXES = ("_bucket", "_sum", "_count")


def _family(name: str, described: dict[str, list[str]]) -> str:
    if name in described:
        return name
    for suffix in _FAMILY_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in described:
            return name[: -len(suffix)]
    return name


def _with_label(labels: str | None, label: str) -> str:
    if not labels:
        return "{" + label + "}"
    return "{" + label + "," + labels[1:]


def merge(texts: dict[str, str]) -> str:
    """One exposition text of ``texts`` (replica id -> its ``/metrics``):
    per family, its comments, each replica's samples and the total."""
    described: dict[str, list[str]] = OrderedDict()  # family -> HELP/TYPE lines
    per_replica: dict[str, list[str]] = OrderedDict()  # family -> sample lines
    totals: dict[str, OrderedDict[str, float]] = OrderedDict()  # family -> series -> sum
    for replica, text in texts.items():
        label = f'replica="{replica}"'
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                lines = described.setdefault(family, [])
                if line not in lines:
                    lines.append(line)
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, labels, value = m.group(1), m.group(2), m.group(3)
            family = _family(name, described)
            per_replica.setdefault(family, []).append(f"{name}{_with_label(labels, label)} {value}")
            series = totals.setdefault(family, OrderedDict())
            key = name + (labels or "")
            series[key] = series.get(key, 0.0) + float(value)
    out: list[str] = []
    for family in list(described) + [f for f in per_replica if f not in described]:
        out.extend(described.get(family, []))
        out.extend(per_replica.get(family, []))
        for key, total in totals.get(family, {}).items():
            out.append(f"{key} {format_number(total)}")
    return "\n".join(out) + ("\n" if out else "")
