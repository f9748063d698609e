"""Prometheus metrics through ``ray.serve.metrics`` (they reach the Ray dashboard and
any Prometheus that scrapes Ray's metrics endpoint).

What vLLM also measures carries vLLM's names, as Ray Serve LLM exports vLLM's own
(``vllm:`` becomes ``vllm_``: Ray's metric names take no colon; Ray's exporter adds its
``ray_`` prefix), so dashboards built for vLLM on Ray read them: the load
(``vllm_num_requests_running``, ``vllm_num_requests_waiting``,
``vllm_kv_cache_usage_perc``), the latencies (``vllm_time_to_first_token_seconds``,
``vllm_inter_token_latency_seconds``, ``vllm_e2e_request_latency_seconds``), the
speculative counters (``spec_decode_num_drafts``, ``spec_decode_num_draft_tokens``,
``spec_decode_num_accepted_tokens``, ``spec_decode_num_accepted_tokens_per_pos``) and the
prefix cache's (``prefix_cache_queries``, ``prefix_cache_hits``: prompt tokens looked up,
and found cached). What vLLM has no name for is ``specserve_*``. Every metric is tagged
with the proposer mode where one applies, and Serve adds the deployment, replica and
application tags.
"""
from __future__ import annotations

from collections import defaultdict

from ray.serve import metrics

from specserve.engine.sched.metrics import RoundMetrics

DRAFT_LENGTH_BUCKETS = [0.5 + k for k in range(16)]  # one bucket per whole draft count 0..16
LATENCY_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48]
MODE = ("mode",)
FAULT_TAGS = ("kind", "mode")


def recovered_faults_counter() -> metrics.Counter:
    """Failures the scheduler or a worker recovered from (the request went on, maybe
    without drafts): ``kind`` as in ``RoundMetrics.fault``. Exported on the first one."""
    return metrics.Counter("specserve_recovered_faults", "failures recovered from without failing a request, by "
                           "kind (proposer_failed, proposer_timeout, propose_batch_failed, ledger_release_failed)",
                           tag_keys=FAULT_TAGS)


class ServeWorkerMetrics(RoundMetrics):
    """What a worker replica reports: the faults it recovers from (a failing batched
    proposal retried one sequence at a time), counted in the process and in Prometheus."""

    def __init__(self) -> None:
        super().__init__()
        self.recovered_faults = recovered_faults_counter()

    def fault(self, kind: str, mode: str = "") -> None:
        super().fault(kind, mode)
        self.recovered_faults.inc(1, {"kind": kind, "mode": mode})


class ServeRoundMetrics(RoundMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.recovered_faults = recovered_faults_counter()
        self.drafting_rounds = metrics.Counter(
            "spec_decode_num_drafts", "verify rounds that checked at least one draft token", tag_keys=MODE)
        self.num_draft_tokens = metrics.Counter(
            "spec_decode_num_draft_tokens", "draft tokens proposed and verified", tag_keys=MODE)
        self.num_accepted_tokens = metrics.Counter(
            "spec_decode_num_accepted_tokens", "draft tokens the target accepted", tag_keys=MODE)
        self.accepted_per_pos = metrics.Counter(
            "spec_decode_num_accepted_tokens_per_pos", "accepted draft tokens by draft position (0-based)",
            tag_keys=("mode", "position"))
        self.wasted_draft_tokens = metrics.Counter(
            "specserve_wasted_draft_tokens", "draft tokens the target rejected (work thrown away)", tag_keys=MODE)
        self.verify_rounds = metrics.Counter(
            "specserve_verify_rounds", "target verify passes per sequence (denominator of tau)", tag_keys=MODE)
        self.committed_tokens = metrics.Counter(
            "specserve_round_committed_tokens", "tokens committed by verify rounds (numerator of tau)",
            tag_keys=MODE)
        self.draft_latency = metrics.Histogram(
            "specserve_draft_latency_s", "one proposer call for a batch of sequences, as the router waits for it",
            boundaries=LATENCY_BUCKETS_S, tag_keys=MODE)
        self.verify_latency = metrics.Histogram(
            "specserve_verify_latency_s", "one target call (prefills + batched verify), as the router waits for it",
            boundaries=LATENCY_BUCKETS_S)
        self.round_latency = metrics.Histogram(
            "specserve_round_latency_s", "one tick: every active sequence of a lane advanced by one round",
            boundaries=LATENCY_BUCKETS_S)
        self.ttft = metrics.Histogram(
            "vllm_time_to_first_token_seconds", "request arrival to first committed token", boundaries=LATENCY_BUCKETS_S,
            tag_keys=MODE)
        self.itl = metrics.Histogram(
            "vllm_inter_token_latency_seconds", "gap between successive committed tokens of a request",
            boundaries=LATENCY_BUCKETS_S, tag_keys=MODE)
        self.e2e = metrics.Histogram(
            "vllm_e2e_request_latency_seconds", "request arrival to its last token", boundaries=LATENCY_BUCKETS_S,
            tag_keys=MODE)
        self.draft_length_histogram = metrics.Histogram(
            "specserve_draft_length", "drafts adaptive speculation chose for one sequence's round (0 = a plain "
            "target round)", boundaries=DRAFT_LENGTH_BUCKETS, tag_keys=MODE)
        self._draft_lengths: list[tuple[str, int]] = []  # of the tick in progress
        self.requests = metrics.Counter(
            "specserve_requests", "finished requests by outcome", tag_keys=("mode", "outcome"))
        self.running = metrics.Gauge("vllm_num_requests_running", "sequences being decoded")
        self.waiting = metrics.Gauge("vllm_num_requests_waiting", "sequences waiting for KV to be admitted")
        self.kv_usage = metrics.Gauge("vllm_kv_cache_usage_perc", "fraction of KV blocks reserved (1 = full)")
        self.kv_used = metrics.Gauge("specserve_kv_blocks_used", "KV blocks reserved by running sequences")
        self.kv_free = metrics.Gauge("specserve_kv_blocks_free", "KV blocks free for admission")
        self.kv_cached = metrics.Gauge("specserve_kv_blocks_cached", "KV blocks no sequence holds that keep a cached "
                                       "prefix (counted in the free blocks: reused last)")
        self.cache_queries = metrics.Counter(
            "prefix_cache_queries", "prompt tokens looked up in the prefix cache at admission (vLLM's name)")
        self.cache_hits = metrics.Counter(
            "prefix_cache_hits", "prompt tokens found in the prefix cache: their KV is shared, not computed (vLLM)")
        self.draft_lookups = metrics.Counter(
            "specserve_draft_lookups", "lookups of a model-free proposer (prompt lookup, suffix) for a round's drafts",
            tag_keys=MODE)
        self.draft_lookup_hits = metrics.Counter(
            "specserve_draft_lookup_hits", "lookups that found drafts (hit rate: this over specserve_draft_lookups)",
            tag_keys=MODE)
        self._pending: defaultdict[tuple, int] = defaultdict(int)  # counts of the tick in progress

    # -- RoundMetrics ------------------------------------------------------------------------
    def draft_call(self, mode: str, seconds: float) -> None:
        self.draft_latency.observe(seconds, {"mode": mode})

    def verify_call(self, seconds: float) -> None:
        self.verify_latency.observe(seconds)

    def tick(self, seconds: float, active: int) -> None:
        """Flush the tick's round counts: one increment per series per tick, not per
        sequence-round (recording a metric costs tens of microseconds of router CPU)."""
        self.round_latency.observe(seconds)
        self.running.set(active)
        pending, self._pending = self._pending, defaultdict(int)
        for (counter, tags), value in pending.items():
            if value:
                counter.inc(value, dict(tags))
        lengths, self._draft_lengths = self._draft_lengths, []
        for mode, num_drafts in lengths:
            self.draft_length_histogram.observe(num_drafts, {"mode": mode})

    def draft_length(self, mode: str, num_drafts: int) -> None:
        self._draft_lengths.append((mode, num_drafts))  # observed at the tick's flush

    def draft_lookup(self, mode: str, found: bool) -> None:
        tags = (("mode", mode),)
        self._pending[(self.draft_lookups, tags)] += 1
        self._pending[(self.draft_lookup_hits, tags)] += found

    def verify_round(self, mode: str, num_drafts: int, accepted: int, committed: int) -> None:
        tags = (("mode", mode),)
        add = self._pending
        add[(self.verify_rounds, tags)] += 1
        add[(self.committed_tokens, tags)] += committed
        if num_drafts == 0:
            return
        add[(self.drafting_rounds, tags)] += 1
        add[(self.num_draft_tokens, tags)] += num_drafts
        add[(self.num_accepted_tokens, tags)] += accepted
        add[(self.wasted_draft_tokens, tags)] += num_drafts - accepted
        for position in range(accepted):
            add[(self.accepted_per_pos, (("mode", mode), ("position", str(position))))] += 1

    def prefix_cache(self, queried: int, hit: int) -> None:
        """Counted at once: once per request, not per round."""
        super().prefix_cache(queried, hit)
        if queried:
            self.cache_queries.inc(queried)
        if hit:
            self.cache_hits.inc(hit)

    def fault(self, kind: str, mode: str = "") -> None:
        """Counted at once (faults are rare; a dashboard should see them without a tick)."""
        super().fault(kind, mode)
        self.recovered_faults.inc(1, {"kind": kind, "mode": mode})

    # -- per request -------------------------------------------------------------------------
    def request_done(self, mode: str, outcome: str, stamps: list[float], arrived: float) -> None:
        tags = {"mode": mode}
        self.requests.inc(1, {"mode": mode, "outcome": outcome})
        if not stamps:
            return
        self.ttft.observe(stamps[0] - arrived, tags)
        for previous, current in zip(stamps, stamps[1:]):
            self.itl.observe(current - previous, tags)
        self.e2e.observe(stamps[-1] - arrived, tags)

    def load(self, running: int, waiting: int) -> None:
        """Kept current between ticks too (an idle router ticks no more)."""
        self.running.set(running)
        self.waiting.set(waiting)

    def kv(self, usage: dict) -> None:
        self.kv_usage.set(usage["reserved_blocks"] / usage["total_blocks"] if usage["total_blocks"] else 0.0)
        self.kv_used.set(usage["reserved_blocks"])
        self.kv_free.set(usage["free_blocks"])
        self.kv_cached.set(usage["cached_blocks"])
