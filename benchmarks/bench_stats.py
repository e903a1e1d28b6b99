"""What a load run measured, with the definitions `vllm bench serve` uses, so figures compare across engines.

Per request: TTFT is send -> first streamed token; E2E latency is send -> last token; ITL is every gap between
consecutive streamed chunks; TPOT is (E2E - TTFT) / (output tokens - 1), defined for requests with at least two
output tokens. Throughputs divide by the wall time of the measured run. Goodput counts requests that met every
SLO given (`ttft`, `tpot`, `e2el`, in milliseconds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    success: bool = False
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


@dataclass
class Summary:
    mean: float
    median: float
    std: float
    percentiles: dict[str, float]


@dataclass
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2el_ms: Summary
    max_concurrent_requests: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(values_s: list[float], percentiles: list[float]) -> Summary:
    """Mean/median/std/percentiles in milliseconds (numpy's linear interpolation, as vLLM)."""
    import numpy as np  # here: `pdserve --help` and every service's start-up import this module's callers

    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        return Summary(0.0, 0.0, 0.0, {_pname(p): 0.0 for p in percentiles})
    return Summary(
        float(ms.mean()),
        float(np.median(ms)),
        float(ms.std()),
        {_pname(p): float(np.percentile(ms, p)) for p in percentiles},
    )


def _pname(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"goodput SLO {item!r}: use KEY:MS with KEY in {', '.join(SLO_KEYS)}")
        ms = float(value)
        if ms < 0:
            raise ValueError(f"goodput SLO {item!r} must not be negative")
        slos[key] = ms
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    if "ttft" in slos and r.ttft * 1000 > slos["ttft"]:
        return False
    if "tpot" in slos and r.tpot is not None and r.tpot * 1000 > slos["tpot"]:
        return False
    if "e2el" in slos and r.latency * 1000 > slos["e2el"]:
        return False
    return True


def compute_metrics(
    results: list[RequestResult],
    duration_s: float,
    percentiles: Sequence[float] = (99,),
    slos: dict[str, float] | None = None,
    max_concurrent: int = 0,
) -> BenchMetrics:
    ok = [r for r in results if r.success]
    inputs = sum(r.prompt_len for r in ok)
    outputs = sum(r.output_len for r in ok)
    duration_s = max(duration_s, 1e-9)
    good = sum(1 for r in ok if meets_slos(r, slos)) if slos else None
    return BenchMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=inputs,
        total_output_tokens=outputs,
        request_throughput=len(ok) / duration_s,
        output_throughput=outputs / duration_s,
        total_token_throughput=(inputs + outputs) / duration_s,
        request_goodput=good / duration_s if good is not None else None,
        ttft_ms=summarize([r.ttft for r in ok], list(percentiles)),
        tpot_ms=summarize([r.tpot for r in ok if r.tpot is not None], list(percentiles)),
        itl_ms=summarize([gap for r in ok for gap in r.itl], list(percentiles)),
        e2el_ms=summarize([r.latency for r in ok], list(percentiles)),
        max_concurrent_requests=max_concurrent,
    )


def format_table(m: BenchMetrics, title: str = "Serving Benchmark Result") -> str:
    """The same rows, in the same order, as `vllm bench serve` prints."""
    rows: list[tuple[str, str]] = [
        ("Successful requests:", f"{m.completed}"),
        ("Failed requests:", f"{m.failed}"),
        ("Maximum request concurrency:", f"{m.max_concurrent_requests}"),
        ("Benchmark duration (s):", f"{m.duration_s:.2f}"),
        ("Total input tokens:", f"{m.total_input_tokens}"),
        ("Total generated tokens:", f"{m.total_output_tokens}"),
        ("Request throughput (req/s):", f"{m.request_throughput:.2f}"),
    ]
    if m.request_goodput is not None:
        rows.append(("Request goodput (req/s):", f"{m.request_goodput:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{m.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{m.total_token_throughput:.2f}"),
    ]
    lines = [f"{'=' * 18} {title} {'=' * max(0, 30 - len(title))}"]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    for name, label, s in (
        ("ttft_ms", "Time to First Token", m.ttft_ms),
        ("tpot_ms", "Time per Output Token (excl. 1st token)", m.tpot_ms),
        ("itl_ms", "Inter-token Latency", m.itl_ms),
        ("e2el_ms", "End-to-end Latency", m.e2el_ms),
    ):
        short = name.split("_")[0].upper()
        lines.append(f"{'-' * 15}{label}{'-' * max(0, 35 - len(label))}")
        lines.append(f"{f'Mean {short} (ms):':<40}{s.mean:<10.2f}")
        lines.append(f"{f'Median {short} (ms):':<40}{s.median:<10.2f}")
        for p, v in s.percentiles.items():
            lines.append(f"{f'P{p[1:]} {short} (ms):':<40}{v:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
