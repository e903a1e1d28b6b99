"""The `pdserve` command as a user runs it: one-line errors, the stack's life cycle, and its children's."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cli.main import build_parser
from tests.stack import free_port, service_env, wait_serving

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*PDSERVE, *argv], env=service_env(), capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "converting the model" not in line]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_parser_knows_every_service():
    p = build_parser()
    assert p.parse_args(["decode", "--port", "1", "--kv-transport", "tcp"]).kv_transport == "tcp"
    assert p.parse_args(["prefill", "--kv-cache-memory", "2G"]).kv_cache_memory == 2 << 30
    assert p.parse_args(["gateway", "--prefill", "a:1", "--decode", "b:2"]).decode == "b:2"
    assert p.parse_args(["up", "--decode-workers", "2"]).decode_workers == 2
    with pytest.raises(SystemExit):
        p.parse_args(["decode", "--kv-transport", "carrier-pigeon"])


def test_flags_are_never_abbreviated_and_log_level_goes_anywhere():
    p = build_parser()
    for argv in (["up", "--colocate"], ["generate", "hi", "--max-token", "3"], ["--log-lev", "INFO", "up"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    assert p.parse_args(["up", "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert p.parse_args(["--log-level", "ERROR", "up"]).log_level == "ERROR"
    assert p.parse_args(["up"]).log_level == os.environ.get("PDSERVE_LOG_LEVEL", "INFO")


def test_version():
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("pdserve ")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["up", "--model", "/nonexistent"], "/nonexistent"),
        (["up", "--kv-cache-memory", "1K"], "kv_cache_memory"),
        (["decode", "--kv-cache-memory", "1K"], "kv_cache_memory"),
        (["up", "--kv-cache-memory", "lots"], "not a size"),
        (["gateway", "--decode", ""], "--decode"),
        (["up", "--kv-cache-memory", "1T"], "memory free here"),
        (["up", "--max-model-len", "0"], "--max-model-len must be >= 1"),
        (["generate", "--local", "--max-tokens", "0", "hi"], "max_tokens"),
        (["gateway", "--decode", "x:1", "--migration-limit", "-1"], "--migration-limit: -1 is negative"),
        (["decode", "--drain-grace", "soon"], "--drain-grace: 'soon' is not a number of seconds"),
    ],
)
def test_bad_configuration_is_one_line_before_anything_starts(argv, needle):
    proc = run(*argv)
    if any(
        w in needle for w in ("not a size", "is negative", "not a number")
    ):  # argparse's own usage error: exit 2, usage plus one error line
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
        return
    assert_one_line_error(proc, needle)


def test_client_commands_without_a_stack_say_what_to_do():
    dead = f"127.0.0.1:{free_port()}"
    assert_one_line_error(run("generate", "hi", "--address", dead), "pdserve up")
    proc = run("bench", "--address", dead, "--num-requests", "2", "--num-warmups", "0")
    assert proc.returncode == 1 and "no request succeeded" in proc.stderr and "Traceback" not in proc.stderr


def test_a_second_server_on_a_busy_port_fails_in_one_line():
    port = free_port()
    first = subprocess.Popen(
        [
            *PDSERVE,
            "gateway",
            "--port",
            str(port),
            "--decode",
            f"127.0.0.1:{free_port()}",
            "--ready-timeout",
            "0",
            "--metrics-port",
            "-1",
        ],
        env=service_env(),
    )
    try:
        wait_serving(f"127.0.0.1:{port}", first)
        second = run(
            "gateway",
            "--port",
            str(port),
            "--decode",
            f"127.0.0.1:{free_port()}",
            "--ready-timeout",
            "0",
            "--metrics-port",
            "-1",
        )
        assert_one_line_error(second, f"127.0.0.1:{port}")
        with socket.socket() as s:  # the port still belongs to the first server alone
            assert s.connect_ex(("127.0.0.1", port)) == 0
        assert first.poll() is None
    finally:
        first.terminate()
        first.wait(30)


def test_up_refuses_busy_ports_before_starting_anything():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run("up", "--port", str(free_port()), "--prefill-port", str(port), "--metrics-port", "-1")
    assert_one_line_error(proc, f"127.0.0.1:{port}")


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_decode_on_a_busy_kv_port_fails_naming_it(transport):
    """--kv-port is honoured (Kubernetes names it as a containerPort): a busy one ends the worker, saying so."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run(
            "--log-level",
            "ERROR",
            "decode",
            "--port",
            str(free_port()),
            "--metrics-port",
            "-1",
            "--kv-transport",
            transport,
            "--kv-port",
            str(port),
            "--kv-cache-memory",
            "64M",
            timeout=300,
        )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("pdserve decode: error:") and str(port) in lines[-1], proc.stderr[-3000:]


@pytest.mark.slow
def test_up_answers_a_prompt_and_stops_cleanly():
    """What README's `make run` does, on free ports: the stack starts, answers, and every process exits."""
    ports = [str(free_port()) for _ in range(3)]
    proc = run(
        "--log-level",
        "WARNING",
        "up",
        "--port",
        ports[0],
        "--metrics-port",
        "-1",
        "--prefill-port",
        ports[1],
        "--decode-port",
        ports[2],
        "--prompt",
        "Say hello.",
        "--exit-after-prompt",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pdserve is up" in proc.stdout
    answer = proc.stdout.split("pdserve is up", 1)[1].split("\n", 1)[1]
    assert answer.strip(), proc.stdout
    assert "first answer" in proc.stderr


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [
            p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read().lower()
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _start_up(*extra: str) -> tuple[subprocess.Popen, dict[str, int]]:
    ports = {"gateway": free_port(), "prefill": free_port(2), "decode": free_port(2)}
    proc = subprocess.Popen(
        [
            *PDSERVE,
            "--log-level",
            "WARNING",
            "up",
            "--port",
            str(ports["gateway"]),
            "--prefill-port",
            str(ports["prefill"]),
            "--decode-port",
            str(ports["decode"]),
            "--kv-cache-memory",
            "128M",
            "--metrics-port",
            "-1",
            *extra,
        ],
        env=service_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if line.startswith("serving"):
            break
    assert proc.poll() is None, "pdserve up exited during start-up"
    return proc, ports


@pytest.mark.slow
def test_up_with_two_workers_per_role_spreads_requests():
    from pdserve.client import Client
    from tests.stack import Stack

    proc, ports = _start_up("--prefill-workers", "2", "--decode-workers", "2", "--local-prefill-max-tokens", "0")
    try:
        p0, d0 = ports["prefill"], ports["decode"]
        stack = Stack(
            f"127.0.0.1:{ports['gateway']}",
            [f"127.0.0.1:{p0}", f"127.0.0.1:{p0 + 1}"],
            [f"127.0.0.1:{d0}", f"127.0.0.1:{d0 + 1}"],
        )

        async def requests():
            async with Client(stack.gateway) as client:
                return await asyncio.gather(
                    *(
                        client.complete(prompt=f"Tell me about number {i}", max_tokens=8, temperature=0.0)
                        for i in range(12)
                    )
                )

        assert len(asyncio.run(requests())) == 12
        assert all(stack.stats(a, "decode").requests_total > 0 for a in stack.decode)
        assert all(stack.stats(a, "prefill").requests_total > 0 for a in stack.prefill)
        stack.wait_idle()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_children_die_with_up(how):
    """However `pdserve up` ends, the services it started end too and free their ports."""
    proc, ports = _start_up("--colocated")
    children = _children(proc.pid)
    assert len(children) == 2  # the colocated worker and the gateway
    proc.send_signal(how)
    proc.wait(90)
    assert _wait_gone(children, 60) == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports["gateway"]))


def test_a_child_asks_to_die_with_its_parent_itself_and_not_for_its_own_children():
    """`up` starts its children with no preexec_fn (Python then vforks and runs no fork handler, gRPC's included);
    each child requests PR_SET_PDEATHSIG itself, and ends at once if the parent that asked is already gone."""
    from pdserve.cli.parent import PARENT_PID, child_env

    code = "from pdserve.cli.parent import die_with_parent; import os; die_with_parent(); print(os.environ.get(%r))"
    argv = [sys.executable, "-c", code % PARENT_PID]
    ok = subprocess.run(argv, env=child_env(None), capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == "None", ok.stderr
    orphan = subprocess.run(argv, env={**os.environ, PARENT_PID: "1"}, capture_output=True, text=True, timeout=60)
    assert orphan.returncode == -signal.SIGTERM and orphan.stdout == ""


@pytest.mark.slow
def test_up_with_tls_and_an_api_key_answers_a_prompt(tmp_path):
    from tests.certs import make_pki

    pki = make_pki(tmp_path, ["service"])
    ports = [str(free_port()) for _ in range(3)]
    proc = run(
        "--log-level",
        "WARNING",
        "up",
        "--colocated",
        "--port",
        ports[0],
        "--decode-port",
        ports[2],
        "--metrics-port",
        "-1",
        "--tls-cert",
        pki["service"][0],
        "--tls-key",
        pki["service"][1],
        "--tls-ca",
        pki["ca"][0],
        "--api-key",
        "sesame",
        "--prompt",
        "Say hello.",
        "--exit-after-prompt",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("pdserve is up", 1)[1].split("\n", 1)[1].strip()


def test_a_mistyped_flag_or_command_gets_the_closest_ones():
    proc = run("up", "--colocate")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "pdserve up: error: unrecognized arguments: --colocate (did you mean --colocated?)" in proc.stderr
    assert "usage: pdserve up" in proc.stderr  # the subcommand's usage, not the top level's
    proc = run("upp")
    assert proc.returncode == 2 and "did you mean up?" in proc.stderr


def test_help_is_quick_and_every_flag_explains_itself():
    start = time.perf_counter()
    proc = run("up", "--help")
    assert proc.returncode == 0
    assert time.perf_counter() - start < 5  # ~0.3 s here; torch is not imported to build the parser
    parser = build_parser()
    for name, sub in parser.commands.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"pdserve {name} {action.option_strings[0]} has no help text"
    assert "(default: 512M)" in " ".join(proc.stdout.split())


def test_a_bad_cpu_isa_cap_is_one_line():
    proc = subprocess.run(
        [*PDSERVE, "generate", "--local", "hi"],
        env={**service_env(), "PDSERVE_CPU_ISA": "sse9"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(proc, "PDSERVE_CPU_ISA='sse9'")


def test_ports_in_time_wait_do_not_count_as_taken():
    """A stack stopped a moment ago leaves its ports in TIME_WAIT; starting again on them must work."""
    from pdserve.cli.errors import CLIError
    from pdserve.cli.up import _check_ports_free

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC, uvicorn and http.server do
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end of the connection goes to TIME_WAIT
    client.close()
    server.close()
    _check_ports_free("127.0.0.1", [("gateway", port)])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(CLIError, match="--http-port"):
            _check_ports_free("127.0.0.1", [("gateway", busy.getsockname()[1])])


def test_usable_cpus_follow_the_cgroup_quota(tmp_path):
    """cgroup v2 and v1 quotas, the process's own cgroup before the mount's root, 'max' as unlimited."""
    from pdserve.cli.services import cpu_quota

    proc = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    (v2 / "pods" / "a").mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (v2 / "pods" / "a" / "cpu.max").write_text("150000 100000\n")
    proc.write_text("0::/pods/a\n")
    assert cpu_quota(v2, proc) == 1.5
    proc.write_text("0::/\n")
    assert cpu_quota(v2, proc) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "docker" / "x").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "docker" / "x" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu,cpuacct" / "docker" / "x" / "cpu.cfs_period_us").write_text("100000\n")
    proc.write_text("4:cpu,cpuacct:/docker/x\n3:memory:/docker/x\n")
    assert cpu_quota(v1, proc) == 0.5
    (v1 / "cpu,cpuacct" / "docker" / "x" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(v1, proc) is None


def test_a_worker_in_a_cpu_limited_cgroup_starts_that_many_threads(tmp_path):
    """A real start under a 0.5-CPU quota: one torch thread, and the log says why (threads beyond the quota only
    get throttled)."""
    group = Path("/sys/fs/cgroup/cpu") / f"pdserve-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("50000")
    except OSError as e:
        pytest.skip(f"cannot make a cgroup v1 cpu group here: {e}")
    try:
        port = free_port()

        def enter() -> None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "colocated",
                "--port",
                str(port),
                "--metrics-port",
                "-1",
                "--kv-cache-memory",
                "64M",
            ],
            env={**service_env(), "PDSERVE_LOG_LEVEL": "INFO"},
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=enter,
        )
        try:
            lines = []
            deadline = time.monotonic() + 120
            assert proc.stderr is not None
            while time.monotonic() < deadline:
                line = proc.stderr.readline()
                if not line:
                    break
                lines.append(line)
                if "torch threads:" in line:
                    break
            said = next((ln for ln in lines if "torch threads:" in ln), "")
            assert "torch threads: 1 (the cgroup's CPU quota of 0.5 CPUs" in said, "".join(lines[-20:])
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@pytest.mark.parametrize(
    "level, flags, kernels, checkpoint, want",
    [
        ("avx2", {"avx2", "fma", "f16c"}, True, "float32", "bfloat16"),  # the C kernels' bf16 decode
        ("avx2", {"avx2", "fma", "f16c"}, True, "bfloat16", "bfloat16"),
        ("avx2", {"avx2", "fma", "f16c"}, False, "bfloat16", "float32"),  # oneDNN alone would crawl in bf16
        ("avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, False, "bfloat16", "bfloat16"),  # oneDNN's
        ("avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, False, "float16", "float32"),  # no AVX512-FP16
        ("avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_fp16"}, False, "float16", "float16"),
        ("avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, True, "float16", "bfloat16"),
        ("portable", set(), False, "float32", "float32"),
    ],
)
def test_dtype_auto_is_what_runs_fastest_on_this_cpu(tmp_path, monkeypatch, level, flags, kernels, checkpoint, want):
    from pdserve.cli import services
    from pdserve.kernels import c_build, cpu_isa

    (tmp_path / "config.json").write_text(f'{{"torch_dtype": "{checkpoint}"}}')
    monkeypatch.setattr(cpu_isa, "level", lambda: level)
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: flags)
    monkeypatch.setattr(c_build, "_compiler", lambda: ("/usr/bin/cc" if kernels else None, "cc"))
    monkeypatch.delenv(c_build.PREBUILT_ENV, raising=False)
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))  # no prebuilt kernels there
    assert services.model_and_dtype(str(tmp_path), "auto", "cpu")[1] == want
    assert services.model_and_dtype(str(tmp_path), "float32", "cpu")[1] == "float32", "an explicit dtype is kept"
    assert services.model_and_dtype(str(tmp_path), "auto", "cuda")[1] == checkpoint, "a GPU takes the checkpoint's"


def test_every_flag_is_declared_once_by_its_service_configuration():
    """Each service command's flags are exactly its configuration's options (plus the logging flags every command
    shares), each declared once, and the configuration the flags build is frozen and typed."""
    import dataclasses

    from pdserve.config import COMMANDS
    from pdserve.flags import from_args, leaf_fields

    parser = build_parser()
    for name, (config, _) in COMMANDS.items():
        sub = parser.commands[name]
        dests = [a.dest for a in sub._actions if a.dest not in ("help", "log_level", "log_format")]
        fields = leaf_fields(config)
        assert len(fields) == len(set(fields)), f"{name}: an option in two groups"
        assert sorted(dests) == sorted(fields), name
        cfg = from_args(config, parser.parse_args([name]))
        assert isinstance(cfg, config) and dataclasses.fields(cfg)[0].name == "server"
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.server = None  # type: ignore[misc]


def test_up_renders_each_child_from_its_configuration():
    """`pdserve up`'s children are given argument lists their own parsers read back into the configuration `up`
    meant: same flags, same values, and the API key never on argv."""
    from pdserve.cli.up import plan_stack
    from pdserve.config import COMMANDS, StackConfig
    from pdserve.flags import from_args

    parser = build_parser()
    argv = ["up", "--prefill-workers", "2", "--api-key", "sekrit", "--routing", "load", "--threads", "1"]
    plan = plan_stack(from_args(StackConfig, parser.parse_args(argv)))
    for child in [*plan.workers, plan.gateway]:
        assert "sekrit" not in child.argv
        command = child.argv[0]
        cfg = from_args(COMMANDS[command][0], parser.parse_args(child.argv))
        assert f"{cfg.server.host}:{cfg.server.port}" == child.address
        if command == "gateway":
            assert cfg.routing.routing == "load" and cfg.prefill.prefill.count(",") == 1
            assert plan.gateway.env is not None and plan.gateway.env["PDSERVE_API_KEY"] == "sekrit"
        else:
            assert cfg.engine.threads == 1
