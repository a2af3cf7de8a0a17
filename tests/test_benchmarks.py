"""The benchmarks still run and print their numbers (their speed is read, not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_throughput_benchmark_prints_the_ratio() -> None:
    out = run("bench_throughput.py", "--seconds", "0.3", "--rounds", "1", "--concurrency", "4")
    assert "gateway / bare" in out
    ratio = float(out.strip().splitlines()[-1].split()[3])
    assert ratio > 0


def test_streaming_benchmark_prints_peak_rss() -> None:
    out = run("bench_streaming.py")
    assert "after streaming  256 MiB" in out
