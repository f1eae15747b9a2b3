"""The server's metrics, written in Prometheus' text exposition format (0.0.4)
by hand: counters, gauges and histograms are a few lines each, not worth a
dependency."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import EngineProcessError, SessionClosedError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: token latencies of a CPU model are milliseconds, of a GPU one less.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

Labels = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    pairs = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        pairs.append(extra)
    return "{" + ",".join(pairs) + "}" if pairs else ""


def format_number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if float(value).is_integer() else repr(float(value))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> Labels:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def state(self) -> Any:
        """What this process counted, to sum with other front ends' (None: a
        figure read from the engine or the registry, the same from every one)."""
        return None

    def samples(self, others: Sequence[Any] = ()) -> Iterable[str]:
        """Its lines; ``others``: other front ends' :meth:`state`, summed in."""
        raise NotImplementedError

    def render(self, others: Sequence[Any] = ()) -> str:
        head = f"# HELP {self.name} {self.help}\n# TYPE {self.name} {self.kind}\n"
        return head + "".join(line + "\n" for line in self.samples(others))


class Counter(_Metric):
    """A count that only goes up; its name ends in ``_total``."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, labels)
        self._values: dict[Labels, float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot go down ({amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def state(self) -> dict[Labels, float]:
        with self._lock:
            return dict(self._values)

    def samples(self, others: Sequence[Any] = ()) -> Iterable[str]:
        values = self.state()
        for other in others:
            for key, value in other.items():
                values[key] = values.get(key, 0.0) + value
        return [f"{self.name}{_labels(self.label_names, k)} {format_number(v)}" for k, v in sorted(values.items())]


class Gauge(_Metric):
    """A value read when scraped, from a function returning {label values: value}
    (or one number for a gauge without labels). ``kind="counter"`` for a count
    kept elsewhere (the engine's evictions)."""

    def __init__(self, name: str, help: str, read: Callable[[], float | dict[Labels, float]],
                 labels: Sequence[str] = (), kind: str = "gauge", *, summed: bool = False) -> None:
        super().__init__(name, help, labels)
        self._read = read
        self.kind = kind
        self.summed = summed  # a figure of this process's (its generations running): front ends' add up

    def state(self) -> float | None:
        value = self._read() if self.summed else None
        return float(value) if isinstance(value, (int, float)) else None

    def samples(self, others: Sequence[Any] = ()) -> Iterable[str]:
        values = self._read()
        if self.summed and isinstance(values, (int, float)):
            values = values + sum(others)
        items = sorted(values.items()) if isinstance(values, dict) else [((), values)]
        return [f"{self.name}{_labels(self.label_names, k)} {format_number(v)}" for k, v in items]


class Histogram(_Metric):
    """Observations counted into cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        super().__init__(name, help)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Counts ``value`` ``times`` times (tokens that arrived together, each at the mean gap)."""
        i = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        with self._lock:
            self._counts[i] += times
            self._sum += value * times

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def state(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self._counts), self._sum

    def samples(self, others: Sequence[Any] = ()) -> Iterable[str]:
        counts, total = self.state()
        for other_counts, other_sum in others:
            counts = [a + b for a, b in zip(counts, other_counts)]
            total += other_sum
        lines, running = [], 0
        for bound, n in zip((*self.buckets, math.inf), counts):
            running += n
            lines.append(f'{self.name}_bucket{{le="{format_number(bound)}"}} {running}')
        lines += [f"{self.name}_sum {format_number(total)}", f"{self.name}_count {running}"]
        return lines


class Registry:
    """The metrics of one server, rendered in the order they were added."""

    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> None:
        if any(m.name == metric.name for m in self._metrics):
            raise ValueError(f"metric {metric.name} added twice")
        self._metrics.append(metric)

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        metric = Counter(name, help, labels)
        self.add(metric)
        return metric

    def histogram(self, name: str, help: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        metric = Histogram(name, help, buckets)
        self.add(metric)
        return metric

    def gauge(self, name: str, help: str, read: Callable[[], float | dict[Labels, float]],
              labels: Sequence[str] = (), kind: str = "gauge", *, summed: bool = False) -> Gauge:
        metric = Gauge(name, help, read, labels, kind, summed=summed)
        self.add(metric)
        return metric

    def snapshot(self) -> dict[str, Any]:
        """What this process counted, by metric (to sum into another front end's render)."""
        return {m.name: state for m in self._metrics if (state := m.state()) is not None}

    def render(self, others: Sequence[dict[str, Any]] = ()) -> str:
        """The exposition text, other front ends' :meth:`snapshot` summed in."""
        return "".join(m.render([o[m.name] for o in others if m.name in o]) for m in self._metrics)


class ServerMetrics:
    """What ``/metrics`` shows: request and token counts kept by the server,
    latencies, and the engine's own figures read at scrape time."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]], named_sessions: Callable[[], int],
                 throwaway_sessions: Callable[[], int], prefix: str = "aoti_sessions") -> None:
        self.registry = r = Registry()
        p = prefix + "_"
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
                          ("graph_replays", "Runs served by replaying a CUDA graph.")):
            r.gauge(f"{p}{key}_total", help, read(key), kind="counter")
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

    def snapshot(self) -> dict[str, Any]:
        """This front end's counts (serve/_shared.py: a scrape of another sums them in)."""
        return self.registry.snapshot()

    def render(self, others: Sequence[dict[str, Any]] = ()) -> str:
        return self.registry.render(others)
