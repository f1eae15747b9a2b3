"""The cluster's ``/metrics``: every replica's exposition text, each sample
labelled with its ``replica``, then the cluster's totals (the sum over
replicas of every sample, without the label), then the ingress's own."""

from __future__ import annotations

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ..serve.interface import Sample, exposition, samples_of, summed


def merge(texts: dict[str, str]) -> str:
    """One exposition text of ``texts`` (replica id -> its ``/metrics``):
    per family, each replica's samples and the total."""
    families: dict[str, Metric] = {}  # (as first seen: its help and type)
    labelled: dict[str, list[Sample]] = {}
    plain: dict[str, list[list[Sample]]] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, family)
            samples = samples_of(family)
            labelled.setdefault(family.name, []).extend(
                (name, tuple(sorted((*labels, ("replica", replica)))), value) for name, labels, value in samples)
            plain.setdefault(family.name, []).append(samples)
    # (The replicas' series carry the label: summed with the totals, they stay apart from them, and first.)
    return exposition(summed(family, [labelled[name], *plain[name]]) for name, family in families.items())
