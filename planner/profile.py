"""A profile: what `pdserve profile` measured on one machine and model, as the simulator reads it.

Plain JSON, so a profile recorded on hardware this machine does not have (a GPU host) plans as well as one taken
here. The step cost is the fitted model (`cost.py`); the measured steps travel with it, so a reader can check
the fit.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.planner.cost import StepCost

VERSION = 1


@dataclass
class Profile:
    model: str
    step: StepCost
    kv_bytes_per_token: int  # K and V of one token, every layer
    kv_capacity_tokens: int  # tokens a worker's KV pool holds
    num_layers: int
    transfer_latency_s: float  # one transfer's fixed cost (handshake reused: begin, acks)
    transfer_bytes_per_s: float
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 1
    machine: str = ""  # what it ran on (CPU flags, GPU name)
    date: str = ""
    steps: list[dict] = field(default_factory=list)  # measured: {"chunks", "contexts", "seconds"}
    fit_error: dict[str, float] = field(default_factory=dict)  # relative error of the fit over `steps`

    def transfer_s(self, tokens: int) -> float:
        """Seconds to move `tokens` tokens of KV from a prefill to a decode worker, all of it."""
        return self.transfer_latency_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def save(self, path: Path) -> None:
        d = asdict(self)
        d["step"] = self.step.to_dict()
        path.write_text(json.dumps({"version": VERSION, **d}, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Profile:
        d = json.loads(Path(path).read_text())
        if d.pop("version", None) != VERSION:
            raise ValueError(f"{path}: not a version-{VERSION} pdserve profile")
        d["step"] = StepCost.from_dict(d["step"])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})
