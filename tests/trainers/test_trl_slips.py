"""Issue 75 point 10: the async TRL recipe's two easy slips, each made in the recipe run as a user's script. Without
its ``use_cpu_attention()`` line TRL raised "Torch not compiled with CUDA enabled" and nothing named the helper: the
rollout worker now applies it where CUDA is not available. The trainer's ``num_generations`` against the worker's
trained on with no word: now one line as the trainer starts the worker."""

from __future__ import annotations

from pathlib import Path

from tests.trainers.world import need

need("trl")  # before the recipe helpers: their module skips on import without TRL, an ImportError here

from tests.trainers.test_trl_docs import run_recipe_with  # noqa: E402

CPU_LINE = (
    "    use_cpu_attention()  # TRL's attention kernel (FlashAttention-3) is CUDA-only: a plain-torch one instead\n"
)


def test_the_async_recipe_without_its_cpu_attention_line_trains_on_a_machine_without_cuda(tmp_path: Path) -> None:
    torch = need("torch")
    assert not torch.cuda.is_available()  # (the tier runs on CPU: the slip is only one there)
    res, _ = run_recipe_with(tmp_path, cpu=(CPU_LINE, "    pass\n"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Torch not compiled with CUDA enabled" not in res.stderr


def test_the_trainers_num_generations_against_the_workers_is_one_line(tmp_path: Path) -> None:
    res, took = run_recipe_with(
        tmp_path, generations=("            num_generations=2,\n", "            num_generations=4,\n")
    )
    assert res.returncode != 0, res.stderr[-3000:]
    said = [line for line in res.stderr.splitlines() if "ClientError:" in line]
    assert said and said[-1].endswith(
        "AsyncGRPOConfig(num_generations=4) and GymRolloutWorker(num_generations=2) differ: give both the same "
        "num_generations"
    ), res.stderr[-3000:]
    assert took < 200, took
