"""The server's metrics, kept and written by ``prometheus_client``.

Two kinds: counts this process keeps (requests, tokens, latencies, the
generations it runs: prometheus_client's Counter, Histogram and Gauge), and
figures read when scraped (the engine's and the session registry's, the same
from every front end). A server with several front ends (serve/_shared.py)
shows the sums over all of them from any one: each front end's counts
(:meth:`Registry.snapshot`, plain tuples that cross processes) are added
to this one's, sample by sample, when it is scraped (:meth:`Registry.render`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..errors import EngineProcessError, SessionClosedError

# The text exposition format generate_latest writes.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: token latencies of a CPU model are milliseconds, of a GPU one less.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

Labels = tuple[str, ...]
# One sample: its name, its labels (sorted pairs), its value.
Sample = tuple[str, tuple[tuple[str, str], ...], float]
# What a process counted: each family's samples, by family name.
Snapshot = dict[str, list[Sample]]


def samples_of(family: Metric) -> list[Sample]:
    # (prometheus_client's _created samples, the time a series began, are left out: a sum has no such time.)
    return [(s.name, tuple(sorted(s.labels.items())), float(s.value)) for s in family.samples
            if not s.name.endswith("_created")]


def summed(family: Metric, samples: Iterable[Iterable[Sample]]) -> Metric:
    """``family`` with each of ``samples``' values added to its sample of the
    same name and labels (a series only they have is added as it is)."""
    totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for group in samples:
        for name, labels, value in group:
            totals[(name, labels)] = totals.get((name, labels), 0.0) + value
    out = Metric(family.name, family.documentation, family.type)
    for (name, labels), value in totals.items():
        out.add_sample(name, dict(labels), value)
    return out


class _Figure:
    """A value read when scraped: a number, or {label values: number}."""

    def __init__(self, name: str, help: str, read: Callable[[], float | dict[Labels, float]],
                 labels: Sequence[str], kind: str) -> None:
        if kind not in ("gauge", "counter"):
            raise ValueError(f"{name}: a figure is a gauge or a counter, not {kind!r}")
        self.name, self.help, self.read, self.labels, self.kind = name, help, read, tuple(labels), kind

    def family(self) -> Metric:
        values = self.read()
        items = sorted(values.items()) if isinstance(values, dict) else [((), values)]
        family = (CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily)(
            self.name, self.help, labels=self.labels)
        for key, value in items:
            family.add_metric(list(key), float(value))
        return family


class Registry:
    """One server's metrics, written in the order they were added: the
    counts this process keeps first, then the figures read when scraped."""

    def __init__(self) -> None:
        self._own = CollectorRegistry()
        self._figures: list[_Figure] = []
        self._names: set[str] = set()

    def _named(self, name: str) -> str:
        if name in self._names:
            raise ValueError(f"metric {name} added twice")
        self._names.add(name)
        return name

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        """A count this process keeps (its name ends in ``_total``)."""
        return Counter(self._named(name), help, labels, registry=self._own)

    def histogram(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(self._named(name), help, buckets=buckets, registry=self._own)

    def gauge(self, name: str, help: str, read: Callable[[], float | dict[Labels, float]],
              labels: Sequence[str] = (), kind: str = "gauge", *, summed: bool = False) -> None:
        """A value read when scraped, from a function returning {label values:
        value} (or one number without labels): the engine's or the
        registry's, the same from every front end. ``kind="counter"`` for a
        count kept elsewhere (the engine's evictions). ``summed``: a figure
        of this process's own (the generations it runs), added up over front ends."""
        self._named(name)
        if summed:
            if labels or kind != "gauge":
                raise ValueError(f"{name}: a summed figure is a gauge without labels")
            Gauge(name, help, registry=self._own).set_function(lambda: float(read()))  # type: ignore[arg-type]
            return
        self._figures.append(_Figure(name, help, read, labels, kind))

    def snapshot(self) -> Snapshot:
        """What this process counted, by metric (to sum into another front end's render)."""
        return {family.name: samples_of(family) for family in self._own.collect()}

    def collect(self, others: Sequence[Snapshot] = ()) -> Iterator[Metric]:
        """The metric families, ``others``' counts summed in."""
        for family in self._own.collect():
            yield summed(family, [samples_of(family), *(o.get(family.name, []) for o in others)])
        for figure in self._figures:
            yield figure.family()

    def render(self, others: Sequence[Snapshot] = ()) -> str:
        """The exposition text, other front ends' :meth:`snapshot` summed in."""
        return exposition(self.collect(others))


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def exposition(families: Iterable[Metric]) -> str:
    """``families`` in the text exposition format (CONTENT_TYPE)."""
    return generate_latest(_Families(families)).decode()


def total(snapshots: Iterable[Snapshot], family: str, sample: str | None = None) -> float:
    """The sum over ``snapshots`` of ``family``'s samples (named ``sample``
    only, if given: a counter's ``NAME_total``), over every label."""
    return sum(value for s in snapshots for name, _, value in s.get(family, [])
               if sample is None or name == sample)


class ServerMetrics:
    """What ``/metrics`` shows: request and token counts kept by the server,
    latencies, and the engine's own figures read at scrape time."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]], named_sessions: Callable[[], int],
                 throwaway_sessions: Callable[[], int], prefix: str = "aoti_sessions") -> None:
        self.registry = r = Registry()
        self.prefix = p = prefix + "_"
        self.requests = r.counter(p + "requests_total", "HTTP requests answered, by endpoint (route) and status.",
                                  ("endpoint", "status"))
        self.prompt_tokens = r.counter(p + "prompt_tokens_total", "Prompt tokens of generation requests.")
        self.prefilled_tokens = r.counter(
            p + "prefilled_tokens_total",
            "Prompt tokens run through the model; the rest were already in the session's cache.")
        self.cached_tokens = r.counter(p + "cached_prompt_tokens_total",
                                       "Prompt tokens reused from the session's cache (not prefilled).")
        self.generated_tokens = r.counter(p + "generated_tokens_total", "Tokens generated.")
        self.cancelled = r.counter(p + "cancelled_generations_total",
                                   "Generations stopped because the client went away.")
        self.active = 0
        r.gauge(p + "active_generations", "Generations running now.", lambda: float(self.active), summed=True)
        self.ttft = r.histogram(p + "time_to_first_token_seconds",
                                "From a generation request's arrival to its first generated token.")
        self.itl = r.histogram(p + "inter_token_latency_seconds", "Between consecutive generated tokens.")
        # Where the time to first token goes: before the generation joins the
        # step loop, and after.
        self.time_to_start = r.histogram(
            p + "time_to_start_seconds",
            "From a generation request's arrival to its generation joining the step loop (parsing, the chat "
            "template and tokenizing, waiting for its session, starting).")
        self.start_to_first_token = r.histogram(
            p + "start_to_first_token_seconds",
            "From a generation joining the step loop to its first token (waiting for a step, prefill, sampling).")
        stats: dict[str, Any] = {}

        def read(key: str) -> Callable[[], float]:
            return lambda: float(stats.get(key, 0))

        up = [1.0]

        def refresh() -> dict[Labels, float]:
            try:
                fresh = engine_stats()
            except (EngineProcessError, SessionClosedError):  # its last figures stand, engine_up says so
                up[0] = 0.0
            else:
                up[0] = 1.0
                stats.clear()
                stats.update(fresh)
            return {("resident",): float(stats.get("resident_sessions", 0)),
                    ("offloaded",): float(stats.get("offloaded_sessions", 0))}

        # Read first: it refreshes the engine's figures the gauges below show.
        r.gauge(p + "sessions", "Sessions open in the engine, by where their state is.", refresh, ("state",))
        r.gauge(p + "engine_up", "1 while the engine answered this scrape, 0 while it does not (an engine process "
                "dead or unresponsive: the engine's figures here are its last).", lambda: up[0])
        r.gauge(p + "named_sessions", "Sessions of the server with an id.", lambda: float(named_sessions()))
        r.gauge(p + "throwaway_sessions", "Sessions of requests that named none, alive now.",
                lambda: float(throwaway_sessions()))
        r.gauge(p + "session_device_bytes", "Bytes of session state on the device.", read("device_bytes"))
        r.gauge(p + "session_host_bytes", "Bytes of session state offloaded to host memory.", read("host_bytes"))
        for key, help in (("evictions", "Sessions offloaded to host memory to make room."),
                          ("idle_offloads", "Sessions offloaded after being idle."),
                          ("restores", "Offloaded sessions brought back to the device."),
                          ("sessions_created", "Sessions created by the engine."),
                          ("graph_captures", "CUDA graphs captured (a shape's second run; each a pause of its "
                                             "step)."),
                          ("graph_replays", "Runs served by replaying a CUDA graph."),
                          ("prefix_cache_hits", "Sessions of requests without a session id that started from the "
                                                "prefix cache (llm/runtime/_prefix.py)."),
                          ("prefix_cache_tokens", "Prompt tokens those sessions took from the prefix cache."),
                          ("prefix_cache_evictions", "Prefix cache sessions dropped for its bounds."),
                          ("discards", "Prefix cache sessions the engine closed to make room (or idle).")):
            r.gauge(f"{p}{key}_total", help, read(key), kind="counter")
        r.gauge(p + "prefix_cache_entries", "Sessions the prefix cache keeps now.", read("prefix_cache_entries"))
        # The step loop's (docs/batching.md): with steps, the rows a step
        # decodes; with the seconds, what bounds it (the device or the host).
        for key, help in (("steps", "Steps of the step loop (a batched decode and prefill chunks each)."),
                          ("decode_rows", "Rows of the step loop's batched decode calls (one token each)."),
                          ("prefill_calls", "Prefill calls of the step loop."),
                          ("prefill_rows", "Sessions' chunks fed by the step loop's prefill calls.")):
            r.gauge(f"{p}{key}_total", help, read(key), kind="counter")
        r.gauge(p + "step_seconds_total",
                "The step loop's time by phase: queueing a step (the host's work, while the device computes the "
                "step before), waiting for the step before to end, reading its tokens and handing them out (with "
                "their text: the server's callback makes it on the step loop's thread).",
                lambda: {(phase,): float(stats.get(f"step_{phase}_seconds", 0.0))
                         for phase in ("wait", "queue", "text")}, ("phase",), kind="counter")
        r.gauge(p + "step_engine_seconds_total",
                "Of the step loop's queueing time, the part spent in the engine's calls (the model's inputs "
                "made and its work launched).", read("step_engine_seconds"), kind="counter")
        r.gauge(p + "step_queue_cpu_seconds_total",
                "Of the step loop's queueing time, its thread's CPU time (the rest it waited: for the "
                "process's other threads, which share its GIL, or for a lock).", read("step_queue_cpu_seconds"),
                kind="counter")
        r.gauge(p + "batch_seconds_total",
                "Time the C++ core spent in batched runs (their rows' bookkeeping, pages, inputs and launches), "
                "without the GIL.", read("batch_seconds"), kind="counter")

    def token_gaps(self, gap: float, count: int) -> None:
        """``count`` tokens that arrived together, each ``gap`` seconds after the one before (the mean gap)."""
        for _ in range(count):
            self.itl.observe(gap)

    def snapshot(self) -> Snapshot:
        """This front end's counts (serve/_shared.py: a scrape of another sums them in)."""
        return self.registry.snapshot()

    def render(self, others: Sequence[Snapshot] = ()) -> str:
        return self.registry.render(others)


def count_registry(metrics: ServerMetrics, registry: Any) -> None:
    """The session registry's counters (serve/_sessions.py's figures) among
    ``metrics``' gauges, read when /metrics is."""
    counters: tuple[tuple[str, str, Callable[[], float]], ...] = (
            ("sessions_expired_total", "Named sessions parked (saved with persistence on, then closed) after their TTL.",
             lambda: registry.figure("expired")),
            ("sessions_unparked_total", "Parked sessions brought back by a request naming them.",
             lambda: registry.figure("unparked")),
            ("sessions_parked_for_room_total", "Idle sessions parked (saved with persistence on, then closed) to make "
             "room for another: a stored response's, or with persistence any named one.",
             lambda: registry.figure("parked_for_room")),
            ("session_park_failures_total", "Parks that failed (a full disk): the session stays in memory, or is "
             "lost when the server stops.", lambda: registry.figure("park_failures")),
            ("checkpoints_total", "Checkpoint writes of named sessions (with checkpoints on).",
             lambda: registry.figure("checkpoints")),
            ("checkpoint_failures_total", "Checkpoint writes that failed (logged).",
             lambda: registry.figure("checkpoint_failures")),
            ("checkpoint_seconds_total", "Seconds spent writing checkpoints, off the request path.",
             lambda: registry.figure("checkpoint_seconds")),
            ("checkpoint_wait_seconds_total", "Seconds requests waited for their session's checkpoint write.",
             lambda: registry.figure("checkpoint_wait_seconds")),
            ("sessions_superseded_total", "Session copies dropped because another server changed their checkpoint.",
             lambda: registry.figure("superseded")))
    for name, what, read in counters:
        metrics.registry.gauge(f"aoti_sessions_{name}", what, read, kind="counter")
