"""A host's Prometheus metrics: one registry per host, read at scrape time.

Counters and histograms are kept where the events happen (sessions, the step
scheduler, migrations); gauges are read from the host when scraped. The host's
HTTP front serves them on ``/metrics`` (kvferry.http_front), so a Ray cluster's
host actors are scraped on their own addresses, like any other server.
"""

from __future__ import annotations

import gc
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)


class HostMetrics:
    def __init__(self, host: Any) -> None:
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("kvferry_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("kvferry_generated_tokens", "Tokens generated", registry=r)
        self.turns = Counter("kvferry_turns", "Replies finished, by reason", ["finish_reason"], registry=r)
        self.guest_traps = Counter("kvferry_guest_traps", "Guests that trapped or overran a budget", registry=r)
        self.migrations = Counter("kvferry_migrations", "Outgoing migrations, by outcome", ["outcome"], registry=r)
        self.expired = Counter("kvferry_sessions_expired", "Sessions closed after --session-ttl idle", registry=r)
        self.ttft = Histogram("kvferry_time_to_first_token_seconds", "Time to first token of a reply",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvferry_time_per_output_token_seconds", "Time between two tokens of a reply",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.pause = Histogram("kvferry_migration_pause_seconds", "A migration's pause (its last stage)",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.gc_pause = Histogram("kvferry_gc_pause_seconds", "Python garbage collections in the host's process "
                                  "(every thread waits for one), by generation", ["generation"],
                                  buckets=GC_BUCKETS, registry=r)
        for outcome in ("started", "committed", "failed"):
            self.migrations.labels(outcome)
        r.register(_HostGauges(host))


class _HostGauges:
    """Gauges read from the host when scraped."""

    def __init__(self, host: Any) -> None:
        self.host = host

    def collect(self):
        h = self.host
        adm = h.admission
        values = [
            ("kvferry_sessions", "Sessions held", len(h.sessions)),
            ("kvferry_sessions_active", "Replies generating (places in the batch taken)", len(adm.running)),
            ("kvferry_sessions_queued", "Replies waiting for a place in the batch", len(adm.queue)),
            ("kvferry_batch_size", "Rows of the last decode step", h.steps.last_rows),
            ("kvferry_kv_bytes", "KV cache bytes held by all sessions", h.kv_bytes()),
            ("kvferry_kv_budget_bytes", "KV cache bytes this host may hold (--max-kv-mb)", h.max_kv_bytes),
            ("kvferry_steps", "Forward passes run (a counter)", h.steps.stats["steps"]),
            ("kvferry_prefix_cache_bytes", "KV bytes of recent prompts kept for new sessions (--prefix-cache-mb)",
             h.prefix.bytes),
            ("kvferry_prefix_cache_hits", "New sessions that started from a kept prompt prefix (a counter)",
             h.prefix.stats["hits"]),
            ("kvferry_prefix_cache_reused_tokens", "Prompt tokens not prefilled thanks to kept prefixes (a counter)",
             h.prefix.stats["reused_tokens"]),
            ("kvferry_gc_frozen_objects", "Start-up objects the garbage collector skips (kvferry.collector)",
             gc.get_freeze_count()),
        ]
        if h.steps.bursting:  # kvferry.burst (a GPU host)
            values.append(("kvferry_burst_prompts", "Short prompt chunks prefilled as one batch into the shared rows "
                           "(a counter)", h.steps.stats["burst_chunks"]))
        if h.steps.prefiller is not None:  # serve --prefill-thread
            values.append(("kvferry_prefill_thread_tokens", "Prompt tokens prefilled on the prefill thread, "
                           "beside the decode steps (a counter)", h.steps.prefiller.stats["tokens"]))
        for name, doc, v in values:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(v))
            yield g

    def describe(self):
        return []
