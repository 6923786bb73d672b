"""Which ``--processes`` mode is fastest at which batch size: the whole ``gym-runtime run`` command timed.

Rollouts/s over the command's whole wall time (interpreter start to exit, the
embedded server and every worker child included), weather with the scripted
policy, or (``--http``) the ``openai`` adapter calling ``tests/bench/mock_openai.py``.
Runs alternate between the modes (and the interpreters of ``--python``, e.g. a
checkout before a change) so that a loaded machine's drift hits every mode
alike; the table shows the median of ``--reps`` runs and the load average.

Each interpreter's checkout is byte-compiled first (``compileall``), as a checkout is after its first
run: where ``PYTHONDONTWRITEBYTECODE`` is set (this project's 2-core machines set it) every command
would otherwise compile the repository's modules again, ~0.1 CPU-s a command that no user pays.

    python tests/bench/process_modes.py [--sizes 100 1000 2000 10000] [--modes auto one per-role 2]
                                        [--reps 3] [--http] [--python before=/path/to/python ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "resources/weather/config.yaml"
DATA = REPO / "resources/weather/data/example.jsonl"


def make_input(n: int, tmp: Path) -> Path:
    rows = DATA.read_text().splitlines()
    path = tmp / f"in_{n}.jsonl"
    if not path.exists():
        path.write_text("".join(rows[i % len(rows)] + "\n" for i in range(n)))
    return path


@contextlib.contextmanager
def mock_server() -> Iterator[list[str]]:
    mock = subprocess.Popen(
        [sys.executable, str(REPO / "tests/bench/mock_openai.py")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert mock.stdout is not None
        port = int(mock.stdout.readline().split()[1])
        yield [
            "--set",
            "models.policy.adapter=openai",
            "--set",
            f"models.policy.base_url=http://127.0.0.1:{port}/v1",
            "--set",
            "models.policy.model=mock",
        ]
    finally:
        mock.terminate()
        mock.wait(10)


def whole_run(python: str, n: int, mode: str, tmp: Path, extra: list[str]) -> float:
    inp = make_input(n, tmp)
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            python,
            "-m",
            "gym_runtime.cli",
            "run",
            str(CONFIG),
            "-i",
            str(inp),
            "-o",
            str(tmp / "out.jsonl"),
            "--no-progress",
            "--processes",
            mode,
            *extra,
        ],
        cwd=tmp,
        capture_output=True,
        text=True,
        env={**os.environ, "OPENAI_API_KEY": "mock"},
        timeout=900,
    )
    wall = time.perf_counter() - t0
    assert out.returncode == 0 and f"{n} rows, 0 failed" in out.stdout, (out.stdout, out.stderr[-2000:])
    (tmp / "out.jsonl").unlink()
    return n / wall


# byte-compiles the gym_runtime checkout an interpreter imports (its packages, not its venvs)
COMPILE = (
    "import compileall, pathlib, gym_runtime; root = pathlib.Path(gym_runtime.__file__).resolve().parents[1]; "
    "[compileall.compile_dir(root / d, quiet=1) for d in ('runtime', 'agents', 'resources', 'models')]"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 2000, 10000])
    ap.add_argument("--modes", nargs="+", default=["auto", "one", "per-role", "2"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--http", action="store_true", help="the openai adapter to the zero-latency mock")
    ap.add_argument("--python", nargs="+", default=[f"now={sys.executable}"], metavar="LABEL=PATH")
    args = ap.parse_args()
    pythons = [p.split("=", 1) for p in args.python]
    for _, py in pythons:
        subprocess.run([py, "-c", COMPILE], check=True, capture_output=True)
    with tempfile.TemporaryDirectory() as tmp_s, mock_server() if args.http else contextlib.nullcontext([]) as extra:
        tmp = Path(tmp_s)
        print(
            f"weather, {'openai adapter -> zero-latency mock' if args.http else 'scripted policy'}; "
            f"{os.cpu_count()} cores; medians of {args.reps} alternated runs; rollouts/s over the whole command\n"
        )
        print("| rollouts | " + " | ".join(f"{lab} {m}" for lab, _ in pythons for m in args.modes) + " | load |")
        print("| ---: |" + " ---: |" * (len(pythons) * len(args.modes)) + " ---: |")
        for n in args.sizes:
            got: dict[tuple[str, str], list[float]] = defaultdict(list)
            loads = []
            for _ in range(args.reps):
                for lab, py in pythons:
                    for m in args.modes:
                        loads.append(os.getloadavg()[0])
                        got[(lab, m)].append(whole_run(py, n, m, tmp, extra))
            cells = [f"{statistics.median(got[(lab, m)]):,.0f}" for lab, _ in pythons for m in args.modes]
            print(f"| {n:,} | " + " | ".join(cells) + f" | {statistics.median(loads):.1f} |", flush=True)


if __name__ == "__main__":
    main()
