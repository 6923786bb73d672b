"""What ``server --secure`` costs: connect time and batch throughput, plain vs TLS + nkey + permissions.

Both runs use the embedded nats-server (its own process) and the scripted policy on
the ``weather`` environment, all workers in this process (one connection per role
when secured, one shared connection when not), so the difference is TLS, nkey
signing and the server's permission checks.

With ``--sync always interval`` it also shows what syncing every write before its acknowledgement
costs (the server's ``sync_interval``; ``always`` is the default of a server with a kept store).

    python tests/bench/secure.py [--repeats 40] [--connects 20] [--sync always interval] [--reps 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gym_runtime.config import load_config, resolve_config  # noqa: E402
from gym_runtime.observability import logs
from gym_runtime.observability.tracing import Telemetry  # noqa: E402
from gym_runtime.ops.credentials import ClientAuth  # noqa: E402
from gym_runtime.ops.nats_server import EmbeddedServer  # noqa: E402
from gym_runtime.service.loop import run_async  # noqa: E402
from gym_runtime.service.runner import run_batch  # noqa: E402
from gym_runtime.transport.bus import Bus  # noqa: E402


def measure(secure: bool, repeats: int, connects: int, sync: str = "always") -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        auth_dir = Path(tmp) / "auth"
        srv = EmbeddedServer(store_dir=str(Path(tmp) / "js"), secure_dir=str(auth_dir) if secure else None, sync=sync)
        t0 = time.perf_counter()
        srv.start()
        start_s = time.perf_counter() - t0
        auth = ClientAuth(auth_dir) if secure else None
        try:

            async def connect_times() -> list[float]:
                out = []
                for _ in range(connects):
                    t = time.perf_counter()
                    bus = await Bus.connect(
                        srv.url,
                        namespace="gym",
                        telemetry=Telemetry(),
                        name="bench",
                        auth=auth,
                        role="publisher" if auth else None,
                    )
                    out.append(time.perf_counter() - t)
                    await bus.close()
                return out

            conn = run_async(connect_times)
            cfg = load_config(REPO / "resources/weather/config.yaml")
            server0, ours0 = _cpu_s(srv.pid), time.process_time()
            result = run_async(
                lambda: run_batch(
                    resolve_config(cfg),
                    srv.url,
                    input_path=REPO / "resources/weather/data/example.jsonl",
                    out=Path(tmp) / "out.jsonl",
                    telemetry=Telemetry(),
                    repeats=repeats,
                    auth=auth,
                )
            )
            assert result.stats.failures == 0
            server_cpu, ours_cpu = _cpu_s(srv.pid) - server0, time.process_time() - ours0
        finally:
            srv.stop()
    return {
        "start_s": start_s,
        "connect_ms": statistics.median(conn) * 1e3,
        "rollouts": result.tasks,
        "elapsed_s": result.elapsed_s,
        "per_s": result.tasks / result.elapsed_s,
        # CPU time moves less than wall time on a loaded machine: nats-server's (where accounts and permissions
        # are checked) and this process's (every role), per rollout
        "server_us": server_cpu / result.tasks * 1e6,
        "ours_us": ours_cpu / result.tasks * 1e6,
    }


def _cpu_s(pid: int | None) -> float:
    """A process's user + system CPU seconds (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=40, help="rollouts per weather task (5 tasks)")
    ap.add_argument("--connects", type=int, default=20)
    ap.add_argument("--sync", nargs="+", default=["always"], choices=("always", "interval"))
    ap.add_argument("--reps", type=int, default=1, help="alternated runs of each; the table shows medians")
    args = ap.parse_args()
    logs.configure("warning")
    runs: dict[tuple[bool, str], list[dict[str, float]]] = {}
    for _ in range(args.reps):  # alternated, so a loaded machine's drift hits every variant alike
        for secure in (False, True):
            for sync in args.sync:
                runs.setdefault((secure, sync), []).append(measure(secure, args.repeats, args.connects, sync))
    print(f"medians of {args.reps}; load {os.getloadavg()[0]:.1f}")
    print(
        f"{'bus':<10} {'sync':<9} {'server start':>13} {'connect p50':>12} {'rollouts':>9} {'elapsed':>9} "
        f"{'rollouts/s':>11} {'server CPU/rollout':>19} {'ours CPU/rollout':>17}"
    )
    for (secure, sync), ms in runs.items():
        m = {k: statistics.median(x[k] for x in ms) for k in ms[0]}
        print(
            f"{'secured' if secure else 'plain':<10} {sync:<9} {m['start_s']:>12.2f}s {m['connect_ms']:>10.1f}ms "
            f"{m['rollouts']:>9.0f} {m['elapsed_s']:>8.2f}s {m['per_s']:>11.1f} {m['server_us']:>16.0f} us "
            f"{m['ours_us']:>14.0f} us"
        )


if __name__ == "__main__":
    main()
