"""An agent whose sandbox of the fleet burns a known amount of CPU (tests/e2e/test_sandbox_cpu.py).

``run`` execs a Python program in a sandbox of its own that spins until its own ``time.process_time()``
reaches ``BURN_S``, and prints that (2 s: the engine's own work in the container, its exec's start, stays
well within 10% of it); it leaves the sandbox open (the runtime ends the rollout's lease, and
reads the sandbox's CPU as it does), then plays ``agents.simple``. The row's ``burned_cpu_s`` is what the
program measured of itself.
"""

from __future__ import annotations

from agents import simple
from gym_runtime.agent import AgentContext, Outcome

BURN_S = 2.0


def program(seconds: float) -> str:
    """A Python program that spins for ``seconds`` of its own CPU time, then prints its CPU time."""
    return f"import time\nwhile time.process_time() < {seconds}:\n    pass\nprint(time.process_time())\n"


async def run(ctx: AgentContext) -> Outcome:
    box = await ctx.sandbox(cpu=1.0)
    r = await box.exec(["python3", "-c", program(BURN_S)], timeout_s=120)
    assert r.exit_code == 0, r
    outcome = await simple.run(ctx)
    outcome.fields["burned_cpu_s"] = float(r.stdout)
    return outcome
