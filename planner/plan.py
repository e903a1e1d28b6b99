"""Which deployment serves a workload best: simulate each candidate, score it on goodput, recommend one.

Goodput is what DistServe and vLLM's benchmark call it: requests per second that met both SLOs (TTFT and TPOT),
over the run's duration. Each candidate is also searched for the highest arrival rate at which `attainment`
(default 90%) of requests still meet both SLOs: the headroom that breaks ties between candidates that all keep
up with the offered rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.planner.profile import Profile
from pdserve.planner.simulator import Deployment, Outcome, Simulation
from pdserve.planner.workload import Request, scaled


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met(self, o: Outcome) -> bool:
        return o.ttft <= self.ttft_s and o.tpot <= self.tpot_s


@dataclass
class Prediction:
    deployment: str
    prefill: int
    decode: int
    goodput: float  # requests/s meeting both SLOs
    attainment: float  # fraction meeting both
    throughput: float  # requests/s finished
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    max_rate: float = 0.0  # highest rate (requests/s) at which `attainment` of requests meet both SLOs
    curve: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment)


def percentiles(values: Sequence[float], points: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {f"p{p}": 0.0 for p in points}
    return {f"p{p}": ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in points}


def score(outcomes: Sequence[Outcome], slo: SLO) -> tuple[float, float, float]:
    """(goodput, attainment, throughput) of one simulated or measured run."""
    start = min(o.request.arrival for o in outcomes)
    duration = max(o.finish for o in outcomes) - start
    good = sum(slo.met(o) for o in outcomes)
    return good / duration, good / len(outcomes), len(outcomes) / duration


def predict(profile: Profile, deployment: Deployment, requests: list[Request], slo: SLO) -> Prediction:
    outcomes = Simulation(profile, deployment, requests).run()
    goodput, attainment, throughput = score(outcomes, slo)
    return Prediction(
        deployment.label,
        deployment.prefill,
        deployment.decode,
        goodput,
        attainment,
        throughput,
        percentiles([o.ttft for o in outcomes]),
        percentiles([o.tpot for o in outcomes if o.request.output > 1]),
    )


def max_rate(
    profile: Profile, deployment: Deployment, requests: list[Request], slo: SLO, target: float = 0.9
) -> tuple[float, list[tuple[float, float]]]:
    """The highest rate at which `target` of `requests` meet both SLOs (the same requests, time-scaled), found by
    bisection on the speed-up; and the (rate, attainment) points it visited."""
    base = (len(requests) - 1) / max(requests[-1].arrival - requests[0].arrival, 1e-9)
    points: list[tuple[float, float]] = []

    def attained(factor: float) -> float:
        outcomes = Simulation(profile, deployment, scaled(requests, factor)).run()
        a = sum(slo.met(o) for o in outcomes) / len(outcomes)
        points.append((base * factor, a))
        return a

    lo, hi = 0.0, 1.0
    while attained(hi) >= target and hi < 1e6:
        lo, hi = hi, hi * 2
    if lo == 0.0:
        lo = hi / 2
        while attained(lo) < target and lo > 1e-6:
            hi, lo = lo, lo / 2
        if lo <= 1e-6:
            return 0.0, sorted(points)
    for _ in range(8):
        mid = (lo + hi) / 2
        if attained(mid) >= target:
            lo = mid
        else:
            hi = mid
    return base * lo, sorted(points)


def candidates(workers: int, local_prefill_max_tokens: int = 0) -> list[Deployment]:
    """Colocated on every worker, and each split of the workers into prefill and decode."""
    out = [Deployment(0, workers)]
    out += [Deployment(p, workers - p, local_prefill_max_tokens) for p in range(1, workers)]
    return out


def plan(
    profile: Profile, workers: int, requests: list[Request], slo: SLO, local_prefill_max_tokens: int = 0
) -> list[Prediction]:
    """Every candidate's prediction, best first: goodput at the offered rate, then the rate it could take."""
    out = []
    for dep in candidates(workers, local_prefill_max_tokens):
        p = predict(profile, dep, requests, slo)
        p.max_rate, p.curve = max_rate(profile, dep, requests, slo)
        out.append(p)
    out.sort(key=lambda p: (round(p.goodput, 6), p.max_rate), reverse=True)
    return out


def table(predictions: Sequence[Prediction], slo: SLO) -> str:
    lines = [
        f"{'deployment':<24} {'goodput/s':>9} {'SLO met':>8} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8} "
        f"{'max rate':>9}   SLOs: TTFT <= {slo.ttft_s * 1000:.0f} ms, TPOT <= {slo.tpot_s * 1000:.0f} ms"
    ]
    for i, p in enumerate(predictions):
        lines.append(
            f"{p.deployment:<24} {p.goodput:>9.2f} {p.attainment:>8.0%} {p.ttft_s['p50'] * 1000:>7.0f}ms "
            f"{p.ttft_s['p99'] * 1000:>6.0f}ms {p.tpot_s['p50'] * 1000:>7.1f}ms {p.tpot_s['p99'] * 1000:>6.1f}ms "
            f"{p.max_rate:>7.2f}/s" + ("   <- recommended" if i == 0 else "")
        )
    return "\n".join(lines)


def as_json(predictions: Sequence[Prediction], slo: SLO, profile: Profile, workload: dict) -> dict:
    return {
        "recommended": predictions[0].deployment if predictions else None,
        "slo": asdict(slo),
        "profile": {"model": profile.model, "device": profile.device, "machine": profile.machine},
        "workload": workload,
        "candidates": [asdict(p) for p in predictions],
    }


def plot(predictions: Sequence[Prediction], slo: SLO, path: Path, top: int = 4) -> None:
    """SLO attainment against arrival rate for the best candidates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in predictions[:top]:
        rates, attained = zip(*p.curve) if p.curve else ((), ())
        ax.plot(rates, [a * 100 for a in attained], marker="o", label=p.deployment)
    ax.axhline(90, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("requests meeting both SLOs (%)")
    ax.set_title(f"predicted SLO attainment (TTFT <= {slo.ttft_s * 1000:.0f} ms, TPOT <= {slo.tpot_s * 1000:.0f} ms)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
