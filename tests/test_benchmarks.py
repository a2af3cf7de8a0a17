"""The benchmark still runs end to end and prints its ratios (read, never asserted: the
suite asserts no speed or latency). Tiny sizes; wrk and nginx are installed by the script
when missing, and the test skips only when that is impossible outside CI."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import REDIS_DB, REDIS_HOST, REDIS_PORT, require_service

RUN = Path(__file__).parent.parent / "benchmarks" / "run.py"


def script(
    path: Path, *args: str, timeout: int = 300, tmp: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """One benchmark script, run as a user runs it, with this interpreter (`tmp`: its
    TMPDIR, where it makes its working directory)."""
    return subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "TMPDIR": str(tmp)} if tmp else None,
    )


def skip_without_tools(result: subprocess.CompletedProcess[str]) -> None:
    """Exit status 3: wrk or nginx missing and not installable (a skip only outside CI)."""
    if result.returncode == 3 and not os.environ.get("CI"):
        pytest.skip(result.stderr.strip())


ARMS = (
    "floor (bare ASGI + aiohttp)",
    "serve, healthy",
    "serve, every request fails over",
    "serve, tracing on (OTLP sink)",
    "serve, budget on SQLite ledger",
    # --engines
    "serve, healthy, httpx engine",
    "serve, fails over, httpx engine",
    # --workers 2 (Redis state)
    "serve, healthy, Redis state",
    "serve --workers 2, Redis state",
)


@pytest.mark.slow
def test_benchmark_runs_every_arm_and_prints_the_ratios() -> None:
    require_service("Redis", REDIS_HOST, REDIS_PORT)  # the --workers arms share breakers
    result = script(
        RUN,
        *("--quick", "--engines", "--workers", "2"),
        *("--redis", f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}"),
    )
    skip_without_tools(result)
    if result.returncode != 0:
        # Exit status 1: an arm answered non-2xx (e.g. failover broke); the table says
        # which. Otherwise the traceback and each server's last log lines (stderr) say why.
        pytest.fail(
            f"exit status {result.returncode}\n--- stderr:\n{result.stderr[-8000:]}"
            f"\n--- stdout:\n{result.stdout[-3000:]}",
            pytrace=False,
        )
    rows = {}
    for line in result.stdout.splitlines():
        for arm in ARMS:
            if line.startswith(arm + " "):
                rows[arm] = line
    assert set(rows) == set(ARMS), result.stdout
    for arm, row in rows.items():
        # req/s, then throughput and p99, each relative to the floor (then the target, if
        # any). A ratio is printed to two decimals: an arm starved on a busy machine (the
        # httpx engine failing over, beside other tests) prints 0.00x, so the arm's own
        # req/s is what must be above zero.
        cells = re.match(
            r".+?\s(\d+)\s+[\d.]+\s+[\d.]+\s+\d+\s+(\d+\.\d\d)x\s+(\d+\.\d\d)x(\s|$)", row
        )
        assert cells is not None, row
        assert int(cells.group(1)) > 0, row
        ratios = [cells.group(2), cells.group(3)]
        assert float(ratios[1]) > 0, row
        if arm.startswith("floor"):
            assert ratios == ["1.00", "1.00"], row
    assert re.search(r"serve - floor [+-]\d+\.\d\d ms", result.stdout)
    assert "20 SSE streams" in result.stdout
    assert re.search(r"OTLP span exports received by the sink", result.stdout)
    assert result.stdout.count(" added ") == 4  # floor and serve: large stream, many streams
    assert "serve: long run" in result.stdout
    assert re.search(r"^gateway build: fallback-mw \S+ \(.+\)$", result.stdout, re.M)
    assert re.search(r"^pinned: (each server under test on CPU \d+|nothing)", result.stdout, re.M)
    assert re.search(
        r"^load average: \d+\.\d at the start, \d+\.\d at the end$", result.stdout, re.M
    )
    for arm in ARMS[1:]:  # each gateway arm's CPU per request over the floor's, by round
        assert re.search(
            rf"^  {re.escape(arm)} +\d+\.\d\d  median \d+\.\d\dx \(\d+\.\d\d\)", result.stdout, re.M
        ), result.stdout


@pytest.mark.parametrize(("mode", "floors"), [("each", 4), ("once", 1)])
def test_each_arm_is_measured_beside_a_floor_window_of_its_own(mode: str, floors: int) -> None:
    # One floor window a round stood for every arm: on a machine that drifts within a
    # round, an arm's ratio moved with how far its window was from the floor's.
    result = script(RUN, "--quick", "--no-memory", "--floor", mode)
    skip_without_tools(result)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    windows = re.findall(r"^  round 1 (\S+) ", result.stdout, re.M)
    assert windows.count("floor") == floors, windows
    assert sorted(set(windows) - {"floor"}) == ["budget", "failover", "healthy", "tracing"]
    if mode == "each":  # a floor window next to every arm's
        for index, name in enumerate(windows):
            if name != "floor":
                assert "floor" in windows[max(index - 1, 0) : index + 2 : 2], windows
    beside = "beside it" if mode == "each" else "in the same round"
    assert f"x the floor's window {beside}" in result.stdout


PLACE = """
import os, shutil, sys, tempfile
from pathlib import Path
if sys.argv[3] == "one":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
sys.path.insert(0, sys.argv[1])
import procs
print(procs.pin(sys.argv[2]))
tree = procs.Tree(Path(tempfile.mkdtemp()))
try:
    floor = procs.start_floor(tree, "http://127.0.0.1:9")
    print(sorted(os.sched_getaffinity(floor.pid)), sorted(os.sched_getaffinity(0)))
    print(sorted(procs.server_cpus(2)))
finally:
    tree.close()
    shutil.rmtree(tree.workdir)
"""


ASK = """
import sys
sys.path.insert(0, sys.argv[1])
import clients
try:
    status, _, body = clients.post(sys.argv[2])
    print(status, body.decode())
except RuntimeError as exc:
    print("failed:", exc)
"""


@pytest.mark.parametrize("silent", [1, 2])
def test_a_post_that_ends_without_an_answer_is_said_and_asked_once_more(silent: int) -> None:
    """The benchmark's own requests (the probe of each arm, the memory warm-ups): a
    connection a server ends without an answer is said on stderr and asked once more;
    a second one fails the run with the URL, never a bare traceback."""
    ended: list[int] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def serve() -> None:
            for number in range(2):
                connection, _ = server.accept()
                with connection:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        data += connection.recv(65536)
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
                    while len(body) < length:  # all of it read: the close is a FIN, not a reset
                        body += connection.recv(65536)
                    if number < silent:
                        ended.append(number)
                        continue
                    connection.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                    )

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        result = subprocess.run(
            [sys.executable, "-c", ASK, str(RUN.parent), url],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        thread.join(timeout=10)
    assert result.returncode == 0, result.stderr
    assert f"benchmark: POST {url}: the connection ended without an answer" in result.stderr
    assert "asked once more" in result.stderr
    assert ended == list(range(silent))
    if silent == 1:
        assert result.stdout.strip() == "200 ok"
    else:
        assert result.stdout.startswith(f"failed: POST {url}: the connection ended without")
        assert "twice" in result.stdout


@pytest.mark.parametrize("mode", ["split", "none"])
def test_pin_puts_the_server_under_test_on_a_core_of_its_own(mode: str) -> None:
    """--pin split (the default of run.py and ab.py): the floor and each one-process
    `serve` on the last CPU, the benchmark (so wrk, nginx and its clients) on the others,
    several workers on every CPU; --pin none, or one CPU to run on, pins nothing."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to split")

    def place(cpus: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", PLACE, str(RUN.parent), mode, cpus],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    said = place("all")
    assert said.returncode == 0, said.stderr[-3000:]
    header, placed, workers = said.stdout.splitlines()[-3:]
    if mode == "split":
        assert header.startswith(f"pinned: each server under test on CPU {cpus[-1]}; "), header
        assert placed == f"{[cpus[-1]]} {cpus[:-1]}"
        assert workers == str(cpus)
    else:
        assert header.startswith("pinned: nothing (--pin none)"), header
        assert placed == f"{cpus} {cpus}"
    one = place("one")
    assert one.returncode == 0, one.stderr[-3000:]
    if mode == "split":
        assert f"pinned: nothing (only CPU {cpus[0]} to run on)" in one.stdout
    assert f"{[cpus[0]]} {[cpus[0]]}" in one.stdout


@pytest.mark.parametrize("benchmark", ["run.py", "ab.py"])
def test_pin_takes_split_or_none(benchmark: str) -> None:
    result = script(RUN.parent / benchmark, "--pin", "cores", timeout=60)
    assert result.returncode == 2
    assert "--pin: invalid choice: 'cores' (choose from 'split', 'none')" in result.stderr


LAYERS = Path(__file__).parent.parent / "benchmarks" / "layers.py"
LAYER_ROWS = (
    "resolver",
    "+ guard, no budget (memory ledger)",
    "+ guard, budget on the memory ledger",
    "+ guard, budget on the SQLite ledger",
    "+ injector",
    "+ walker, healthy (whole gateway)",
    "+ walker, every request fails over",
    "+ walker, every request hedged",
    "+ walker, budget on the SQLite ledger",
    "+ request log line (INFO, to a file)",
    "+ Redis state (breakers, capacity counts)",
    "+ OTel SDK (batch spans, OTLP encoding; metrics)",
    "bare proxy through the gateway's engine seam",
    "whole gateway, real aiohttp engine to nginx",
)


def test_layer_benchmark_runs_every_row_and_prints_its_cost() -> None:
    """benchmarks/layers.py drives requests through each stack (it checks every response's
    status and x-gateway-provider, and that hedges fired and spans were exported) and
    prints CPU per request, what each layer adds and its budget; with --nginx also the
    bare in-process proxy, that proxy through the gateway's engine seam and the gateway on
    its real engine, through real sockets."""
    require_service("Redis", REDIS_HOST, REDIS_PORT)  # the Redis-state row
    result = script(
        LAYERS,
        *("--requests", "40", "--rounds", "1", "--warmup", "5"),
        *("--redis", f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}", "--nginx"),
    )
    skip_without_tools(result)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    bare = re.search(
        r"^bare aiohttp proxy to nginx \(in-process floor\)\s+(\d+\.\d)\s*$", result.stdout, re.M
    )
    assert bare is not None and float(bare.group(1)) > 0, result.stdout
    rows = {}
    for line in result.stdout.splitlines():
        for label in LAYER_ROWS:
            if line.startswith(label + " "):
                rows[label] = line
    assert set(rows) == set(LAYER_ROWS), result.stdout
    for row in rows.values():
        cells = re.match(r".+?\s+(\d+\.\d)\s+([+-]\d+\.\d)\s+(\d+)\s+(met|OVER) \(over ", row)
        assert cells is not None, row
        assert float(cells.group(1)) > 0, row


def test_layer_benchmark_refuses_an_unknown_row() -> None:
    result = script(LAYERS, "--only", "nonsense", timeout=60)
    assert result.returncode == 2
    assert "nonsense" in result.stderr


AB = Path(__file__).parent.parent / "benchmarks" / "ab.py"


@pytest.mark.slow
def test_ab_benchmark_serves_both_trees_side_by_side(tmp_path: Path) -> None:
    """benchmarks/ab.py runs `serve` from another tree (here: this one) beside this
    checkout's and the floor, and prints CPU per request for each arm (the budget arm:
    each tree on a SQLite ledger of its own; the Redis arm: each under a key prefix of its
    own); it removes its working directory (it left one per run, with nginx's files and
    every server's log and ledger)."""
    src = Path(__file__).parent.parent / "src"
    arms = "healthy,failover,budget,redis"
    result = script(
        AB, str(src), "--rounds", "1", "--duration", "1", "--arms", arms,
        "--redis", f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}", tmp=tmp_path,
    )  # fmt: skip
    skip_without_tools(result)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    for arm in (
        "floor", "healthy (base)", "healthy (this)", "failover (base)", "failover (this)",
        "budget (base)", "budget (this)", "redis (base)", "redis (this)",
    ):  # fmt: skip
        line = next((x for x in result.stdout.splitlines() if x.startswith(arm + " ")), "")
        cells = re.match(r".+ CPU us/req \[(\d+)\] median \d+ \((\d+\.\d\d)x floor\)", line)
        assert cells is not None and int(cells.group(1)) > 0, result.stdout
        if arm != "floor":  # and its multiple of the floor's in each round
            assert re.search(r", x floor by round \d+\.\d\d$", line), line
    assert re.search(r"^pinned: .+; load average \d+\.\d+$", result.stdout, re.M)
    assert "gateway builds: base fallback-mw 0.1.0 (pure Python); this " in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_ab_benchmark_compiled_refuses_a_tree_it_cannot_compile(tmp_path: Path) -> None:
    """--build compiled builds each tree's compiled copy with that tree's own
    scripts/compile.py: a tree without one is refused before anything starts."""
    (tmp_path / "src" / "fallback_mw").mkdir(parents=True)
    (tmp_path / "src" / "fallback_mw" / "__init__.py").write_text("")
    result = script(AB, str(tmp_path / "src"), "--build", "compiled", timeout=60)
    assert result.returncode == 2, result.stderr
    assert "no scripts/compile.py beside it to build a compiled copy" in result.stderr


def test_ab_benchmark_refuses_a_tree_without_the_package(tmp_path: Path) -> None:
    result = script(AB, str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert "holds no fallback_mw package" in result.stderr


def test_ab_benchmark_refuses_an_unknown_arm() -> None:
    src = Path(__file__).parent.parent / "src"
    result = script(AB, str(src), "--arms", "healthy,tracing", timeout=60)
    assert result.returncode == 2
    assert "--arms takes names from healthy, failover, budget, redis" in result.stderr


INSTRUCTIONS = RUN.parent / "instructions.py"


@pytest.mark.parametrize("what", [["serve"], ["layers", "healthy"]])
def test_instruction_count_refuses_a_tree_without_the_package(
    tmp_path: Path, what: list[str]
) -> None:
    result = script(INSTRUCTIONS, *what, "--base", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert "holds no fallback_mw package" in result.stderr


THIS_TREE = """
import sys
sys.path.insert(0, sys.argv[1])
import instructions
print(instructions.this_tree())
"""


@pytest.mark.parametrize("pythonpath", [None, "/elsewhere/build/compiled"])
def test_instruction_count_counts_this_checkout_not_the_installed_one(
    pythonpath: str | None,
) -> None:
    """The "this" tree is the checkout the script is in (a helper's clone run on another checkout's
    virtual environment counted that one's editable install, with PYTHONPATH emptied), or
    the PYTHONPATH given (a compiled copy)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    result = subprocess.run(
        [sys.executable, "-c", THIS_TREE, str(INSTRUCTIONS.parent)],
        capture_output=True, text=True, timeout=60, check=True, env=env,
    )  # fmt: skip
    expected = pythonpath or str(INSTRUCTIONS.parent.parent / "src")
    assert result.stdout.strip() == expected


def test_instruction_count_refuses_a_port_base_without_room() -> None:
    result = script(INSTRUCTIONS, "serve", "--port-base", "65530", timeout=60)
    assert result.returncode == 2
    assert "65530 leaves no room for 10 ports below 65536" in result.stderr


def test_instruction_count_of_serve_takes_arms_and_refuses_an_unknown_one() -> None:
    """`serve --arms` picks the arms (`budget`: run.py's SQLite-ledger arm, `tracing` its
    OTLP-exporting one, which it had none of); a name it does not know is refused before
    anything starts."""
    result = script(INSTRUCTIONS, "serve", "--arms", "healthy,hedged", timeout=60)
    assert result.returncode == 2
    assert "takes names from healthy, failover, budget, tracing" in result.stderr


def test_instruction_count_of_layers_takes_a_port_base_too() -> None:
    """The real-engine rows start nginx: `layers --port-base` keeps it in an allotted range
    (it took ephemeral ports), refused as `serve`'s is when the range has no room."""
    result = script(INSTRUCTIONS, "layers", "engine", "--port-base", "65530", timeout=60)
    assert result.returncode == 2
    assert "65530 leaves no room for 10 ports below 65536" in result.stderr


def _free_window_below_the_ephemeral_range(size: int) -> int:
    """A first port of `size` free ports under 32768: the kernel hands out ports from
    32768 up to every socket bound to port 0 and to every outgoing connection, so a window
    there (where the test once took it, from a port-0 bind) was taken under the parallel
    suite's load between the script's check of a port and its server's bind."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(24_000, 32_000 - size)
        try:
            for port in range(base, base + size):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise AssertionError("no 10 free ports in 24000..32000")


@pytest.mark.slow
def test_instruction_count_serves_on_the_ports_it_was_given() -> None:
    """`serve` bound ephemeral ports, so two people (or two CI jobs) on one machine could
    not keep it inside their allotted ranges, and gave its servers a fixed 300 s to start
    under callgrind. `--port-base` keeps every server in PORT .. PORT+9 (a taken port
    passed over) and `--start-timeout` is the operator's."""
    base = _free_window_below_the_ephemeral_range(10)
    result = script(
        INSTRUCTIONS, "serve", "--requests", "10", "--port-base", str(base),
        "--start-timeout", "900", timeout=1500,
    )  # fmt: skip
    skip_without_tools(result)
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"on ports \[([0-9, ]+)\]", result.stdout)
    assert found is not None, result.stdout
    ports = [int(port) for port in found.group(1).split(",")]
    assert len(ports) == 5 and all(base <= port < base + 10 for port in ports), ports
    for arm in ("floor", "healthy (this)", "failover (this)"):
        assert re.search(rf"{re.escape(arm)} +[0-9]+k", result.stdout), result.stdout


SYSCALLS = RUN.parent / "syscalls.py"


def test_syscall_benchmark_splits_cpu_and_counts_calls_per_arm(tmp_path: Path) -> None:
    """benchmarks/syscalls.py prints, for the floor and serve (healthy, failing over),
    user and system CPU per request and the system calls per request by kind (perf's
    counters), and removes its working directory."""
    result = script(SYSCALLS, "--duration", "1", "--top", "5", tmp=tmp_path)
    skip_without_tools(result)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    for arm in ("floor", "healthy", "failover"):
        split = re.search(rf"^  {arm} +\d+ +(\d+\.\d) +(\d+\.\d) +\d+\.\d ", result.stdout, re.M)
        assert split is not None and float(split.group(1)) > 0, result.stdout
    calls = re.search(r"^  write +(\d+\.\d+) +(\d+\.\d+) +(\d+\.\d+)$", result.stdout, re.M)
    assert calls is not None, result.stdout  # each arm answers with a write or more
    assert all(float(x) >= 1 for x in calls.groups()), calls.group(0)
    assert "failover minus the floor, per request: " in result.stdout
    assert list(tmp_path.iterdir()) == []


CACHE_SIM = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import subprocess
import instructions
out = Path(sys.argv[2])
subprocess.run([*instructions.callgrind(out, True), "/bin/true"], check=True, capture_output=True)
totals = instructions.events(out.read_text())
print(" ".join(f"{k}={v}" for k, v in totals.items()))
print("cycles", instructions.estimated_cycles({k: float(v) for k, v in totals.items()}))
"""


def test_instruction_count_simulates_the_caches_valgrind_is_given(tmp_path: Path) -> None:
    """`--cache-sim`: valgrind takes the options as built (this machine's L2 as the last
    level), and a dump's totals are read by event name; the cycle estimate adds each miss
    at its weight to the instructions."""
    import shutil

    if shutil.which("valgrind") is None:
        if os.environ.get("CI"):
            pytest.fail("valgrind is missing under CI")
        pytest.skip("no valgrind")
    result = subprocess.run(
        [sys.executable, "-c", CACHE_SIM, str(INSTRUCTIONS.parent), str(tmp_path / "true.out")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    totals = dict(pair.split("=") for pair in first.split())
    assert {"Ir", "I1mr", "D1mr", "ILmr", "DLmr", "Bc", "Bcm", "Bi", "Bim"} <= set(totals)
    ir = int(totals["Ir"])
    misses = sum(int(totals[name]) for name in ("I1mr", "D1mr", "D1mw")) * 10
    misses += sum(int(totals[name]) for name in ("ILmr", "DLmr", "DLmw")) * 100
    misses += (int(totals["Bcm"]) + int(totals["Bim"])) * 15
    assert ir > 0 and misses > 0
    assert float(second.split()[1]) == ir + misses


def test_instruction_count_reads_instructions_alone_from_a_dump_without_the_simulation() -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import instructions\n"
        "print(instructions.events('events: Ir\\nfn=(1) f\\n0 5\\ntotals: 1234\\n'))\n"
        "print(instructions.events('events: Ir\\n'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(INSTRUCTIONS.parent)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert result.stdout.splitlines() == ["{'Ir': 1234}", "None"]
