"""What the service counts: requests by status, sentences, tokens, latency percentiles; in Prometheus' text format."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by the nearest-rank method (0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q * len(ordered) + 0.5)) - 1))
    return ordered[k]


class Metrics:
    """Counters since the start and the latencies of the last ``window`` translate requests."""

    QUANTILES = (0.5, 0.95, 0.99)

    def __init__(self, window: int = 2000):
        self.started = time.monotonic()
        self.status: Counter[int] = Counter()
        self.latencies: deque[float] = deque(maxlen=window)
        self.sentences = 0
        self.source_tokens = 0
        self._lock = threading.Lock()

    def request(self, status: int, seconds: float | None = None, sentences: int = 0) -> None:
        """A request answered with ``status``; ``seconds`` for a translation, ``sentences`` it translated."""
        with self._lock:
            self.status[status] += 1
            if seconds is not None:
                self.latencies.append(seconds)
            self.sentences += sentences

    def count_tokens(self, source_tokens: int) -> None:
        with self._lock:
            self.source_tokens += source_tokens

    def snapshot(self, queued: int, batches) -> dict:
        with self._lock:
            lat = list(self.latencies)
            status = dict(self.status)
            sentences, source_tokens = self.sentences, self.source_tokens
        up = time.monotonic() - self.started
        return {
            "uptime_seconds": round(up, 3),
            "requests": sum(status.values()),
            "requests_by_status": {str(k): v for k, v in sorted(status.items())},
            "sentences": sentences,
            "source_tokens": source_tokens,
            "target_tokens": batches.target_tokens,
            "batches": batches.batches,
            "mean_batch_sentences": round(batches.sentences / batches.batches, 2) if batches.batches else 0.0,
            "search_steps": batches.steps,
            "search_step_sentences": batches.step_sentences,
            "mean_step_sentences": round(batches.step_sentences / batches.steps, 2) if batches.steps else 0.0,
            "decoding_busy_seconds": round(batches.busy_seconds, 3),
            "target_tokens_per_second": round(batches.target_tokens / up, 2) if up > 0 else 0.0,
            "queue_sentences": queued,
            "latency_seconds": {f"p{int(q * 100)}": round(percentile(lat, q), 4) for q in self.QUANTILES},
        }

    @classmethod
    def prometheus(cls, snap: dict) -> str:
        """The snapshot in Prometheus' text exposition format."""
        out = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]):
            out.append(f"# HELP attnmt_{name} {help_text}")
            out.append(f"# TYPE attnmt_{name} {kind}")
            out.extend(f"attnmt_{name}{labels} {value}" for labels, value in samples)

        metric("requests_total", "counter", "HTTP requests answered, by status.",
               [(f'{{status="{k}"}}', v) for k, v in snap["requests_by_status"].items()] or [("", 0)])
        metric("sentences_total", "counter", "Sentences translated.", [("", snap["sentences"])])
        metric("source_tokens_total", "counter", "Source tokens translated.", [("", snap["source_tokens"])])
        metric("target_tokens_total", "counter", "Target tokens written.", [("", snap["target_tokens"])])
        metric("batches_total", "counter", "Static batches searched, or groups of sentences that joined the running "
               "search (continuous batching).", [("", snap["batches"])])
        metric("search_steps_total", "counter", "Steps of the running search (continuous batching).",
               [("", snap["search_steps"])])
        metric("decoding_busy_seconds_total", "counter", "Seconds the decoding thread spent translating.",
               [("", snap["decoding_busy_seconds"])])
        metric("target_tokens_per_second", "gauge", "Target tokens written per second since the start.",
               [("", snap["target_tokens_per_second"])])
        metric("queue_sentences", "gauge", "Sentences waiting to be translated.", [("", snap["queue_sentences"])])
        lat = snap["latency_seconds"]
        metric("request_latency_seconds", "summary", "Latency of the recent translate requests.",
               [(f'{{quantile="{q}"}}', lat[f"p{int(q * 100)}"]) for q in cls.QUANTILES])
        metric("uptime_seconds", "gauge", "Seconds since the service started.", [("", snap["uptime_seconds"])])
        return "\n".join(out) + "\n"
