"""The engine: what prefill and decode share. Its facade, importable from here:

- `EngineConfig` (the knobs) and `SamplingParams` (a request's sampling, validated by the engine's own rules);
- `EngineCore`: one model, KV pool and scheduler with one `step()`; requests in (`add`, `reserve` + `land` for KV
  computed elsewhere, `abort`), a typed `stats()` snapshot, the prefix cache's changes (`subscribe_cache`);
- `EngineLoop`: serves a core from asyncio, its forwards on one model thread.

Names load on first use, so `pdserve.engine.config` stays importable without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "EngineConfig": "config",
    "SamplingParams": "sampling_params",
    "InvalidParameter": "errors",
    "EngineCore": "engine_core",
    "EngineStats": "engine_core",
    "StepOutput": "engine_core",
    "EngineLoop": "engine_loop",
    "EngineStopped": "errors",
    "PoolExhausted": "errors",
    "SamplingError": "errors",
    "Sequence": "sequence",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
