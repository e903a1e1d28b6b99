"""The ISA cap: one machine runs the paths of lower CPUs (PDSERVE_CPU_ISA), and bf16 works on any of them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from pdserve.kernels import cpu_isa


def test_levels_follow_the_cpu_flags_and_the_cap(monkeypatch):
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    assert cpu_isa.detected() == cpu_isa.level() == "avx2" and cpu_isa.march() == "native"
    assert cpu_isa.torch_env() == {}
    monkeypatch.setenv(cpu_isa.ENV, "avx512")  # a cap above the CPU changes nothing
    assert cpu_isa.level() == "avx2" and cpu_isa.torch_env() == {}
    monkeypatch.setenv(cpu_isa.ENV, "portable")
    assert cpu_isa.level() == "portable" and cpu_isa.march() == "x86-64"
    assert cpu_isa.torch_env() == {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    }
    monkeypatch.setattr(
        cpu_isa, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    )
    monkeypatch.setenv(cpu_isa.ENV, "AVX2")
    assert cpu_isa.detected() == "avx512" and cpu_isa.level() == "avx2" and cpu_isa.march() == "x86-64-v3"
    assert cpu_isa.torch_env() == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    monkeypatch.setenv(cpu_isa.ENV, "sse9")
    with pytest.raises(ValueError, match="portable, avx2, avx512"):
        cpu_isa.level()


_BF16_ENGINE = """
import sys
from pdserve.kernels import cpu_isa
cpu_isa.apply_cap()
import torch
from pdserve.engine import EngineConfig, EngineCore, SamplingParams
from pdserve.kernels.packed_linear import can_pack
cfg = EngineConfig(model=sys.argv[1], dtype="bfloat16", kv_cache_memory=8 << 20)
core = EngineCore(cfg)
out = core.generate([[1, 5, 9, 13, 17]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
print(torch.backends.cpu.get_cpu_capability(), can_pack(torch.zeros(4, 4, dtype=torch.bfloat16)), out[0])
"""


@pytest.mark.parametrize("level", ["avx2", "portable"])
def test_bfloat16_serves_under_every_cap(tiny_model_dir, level):
    """On a CPU without AVX-512, oneDNN cannot pack bf16 weights: the engine keeps plain linear layers for them
    instead of dying at start-up, and produces the same greedy tokens as the uncapped engine."""
    if cpu_isa.LEVELS.index(cpu_isa.detected()) < cpu_isa.LEVELS.index(level):
        pytest.skip(f"this CPU has no {level}")

    def run(cap: str | None) -> list[str]:
        capped = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
        env = {k: v for k, v in os.environ.items() if k not in capped}
        env.pop(cpu_isa.ENV, None)
        if cap:
            env[cpu_isa.ENV] = cap
        proc = subprocess.run(
            [sys.executable, "-c", _BF16_ENGINE, str(tiny_model_dir)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.split(maxsplit=2)

    capped = run(level)
    assert capped[0] == {"avx2": "AVX2", "portable": "DEFAULT"}[level] and capped[1] == "False"
    assert len(eval(capped[2])) == 6
    if cpu_isa.detected() == level:
        return
    uncapped = run(None)
    # the same model in bf16: greedy tokens may differ only where the kernels round differently; on this tiny
    # random model they do not
    assert capped[2] == uncapped[2], (capped, uncapped)


_LOAD_BOTH = """
import logging, sys, torch
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from pdserve.kernels import cpu_elementwise, cpu_paged_attention, quant_linear
cache = Path(sys.argv[1])
attention, elementwise, linear = cpu_paged_attention.load(cache), cpu_elementwise.load(cache), quant_linear.load(cache)
print("LOADED", attention is not None, elementwise is not None, linear is not None)
"""


def _load_both(env: dict, cache) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _LOAD_BOTH, str(cache)], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("level", ["avx2", "portable"])
def test_kernels_prebuilt_per_level_load_where_nothing_can_be_built(tmp_path, level):
    """A hardened container: no C compiler (or nowhere writable and executable to put a library). The libraries
    the image prebuilt for every level load instead, the one for this CPU's (capped) level."""
    from pdserve.kernels import c_build, cpu_elementwise, cpu_paged_attention, quant_linear

    if cpu_isa.detected() == "portable":
        pytest.skip("not an x86-64 CPU with AVX2")
    prebuilt = tmp_path / "prebuilt"
    c_build.prebuild([cpu_elementwise.SOURCE, cpu_paged_attention.SOURCE, quant_linear.SOURCE], prebuilt)
    env = {**os.environ, "CC": "/nonexistent/cc", c_build.PREBUILT_ENV: str(prebuilt), cpu_isa.ENV: level}
    out = _load_both(env, tmp_path / "cache")
    assert "LOADED True True True" in out.stdout, out.stdout + out.stderr
    assert f"loaded prebuilt for {level}" in out.stdout
    # without the prebuilt folder the same process stays on torch, and says so
    env[c_build.PREBUILT_ENV] = str(tmp_path / "none")
    out = _load_both(env, tmp_path / "cache")
    assert "LOADED False False False" in out.stdout and "stays on the torch path" in out.stdout


def test_a_noexec_tmp_falls_back_to_the_prebuilt_kernels(tmp_path):
    """The cache and the temp directory on `noexec` mounts (a container's tmpfs): a library compiles there but
    cannot be mapped; the prebuilt one loads."""
    from pdserve.kernels import c_build, cpu_elementwise, cpu_paged_attention, quant_linear

    if cpu_isa.detected() == "portable" or shutil.which("unshare") is None:
        pytest.skip("not an x86-64 CPU with AVX2, or no unshare (util-linux)")
    prebuilt = tmp_path / "prebuilt"
    c_build.prebuild([cpu_elementwise.SOURCE, cpu_paged_attention.SOURCE, quant_linear.SOURCE], prebuilt)
    noexec = tmp_path / "noexec"
    noexec.mkdir()
    script = (
        f"mount -t tmpfs -o noexec tmpfs {noexec} && TMPDIR={noexec} {sys.executable} -c '{_LOAD_BOTH}' {noexec}/cache"
    )
    probe = subprocess.run(
        ["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o noexec tmpfs {noexec}"], capture_output=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a noexec tmpfs here: {probe.stderr.decode().strip()}")
    env = {**os.environ, c_build.PREBUILT_ENV: str(prebuilt)}
    out = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=180
    )
    assert "LOADED True True True" in out.stdout, out.stdout + out.stderr
    assert "loaded prebuilt for" in out.stdout
