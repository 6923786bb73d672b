"""The verifiers 0.4 loopback endpoint's key stays in the guest: the harness programs verifiers starts (its
``subprocess`` runtime, the one ``agents.verifiers_v1`` runs harnesses in) and what they start do not inherit
it (round 4 of the red team: every harness subprocess could read it and call the agent's model directly).

verifiers' runtime starts programs with the guest's environment less every name holding ``API_KEY`` (the
same rule in the 0.3.1 installed here and in 0.4.0, the guest's layer): the key's variable is named so. Real
parts: verifiers' own runtime and real processes; nothing of verifiers is replaced."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("verifiers.v1.runtimes.subprocess")

from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime  # noqa: E402

from agents import verifiers_v1  # noqa: E402

KEY = "endpoint-key-8c41f0"


async def test_a_program_the_harness_runs_and_its_children_do_not_see_the_endpoint_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(verifiers_v1._KEY_VAR, KEY)  # as the guest sets it (``_Served.start``)
    monkeypatch.setenv("GYM_HARMLESS_SETTING", "kept")  # what the harness does inherit
    runtime = SubprocessRuntime(SubprocessConfig())
    await runtime.start()
    try:
        leak = 'env; sh -c \'env; cat /proc/$$/environ | tr "\\0" "\\n"\''
        got = await runtime.run(["sh", "-c", leak], {})
        assert got.exit_code == 0, got.stderr
        assert "GYM_HARMLESS_SETTING=kept" in got.stdout  # the environment did reach it
        assert KEY not in got.stdout
        background = await runtime.open_process(["sh", "-c", "env"], {})
        out = b"".join([chunk async for chunk in background.stdout])
        assert await background.wait() == 0 and b"GYM_HARMLESS_SETTING" in out and KEY.encode() not in out
    finally:
        await runtime.stop()
        if runtime.workdir is not None:
            shutil.rmtree(runtime.workdir, ignore_errors=True)
    assert os.environ[verifiers_v1._KEY_VAR] == KEY  # the guest's own client still reads it
