"""An agent of a user's own that runs a command in a sandbox of its pool: the deploy recipes' tests load it as a
user's code is loaded there (a folder on ``PYTHONPATH``, mounted into the Compose services), by the name
``box_agent``. Reward 1 when the sandbox printed what it should."""

from gym_runtime import AgentContext, Outcome, VerifyReply, create_params


async def run(ctx: AgentContext) -> Outcome:
    response = await ctx.generate(create_params(ctx.row["responses_create_params"]))
    async with ctx.sandbox(memory_mb=128) as box:
        r = await box.exec(["python3", "-c", "print(6 * 7)"], timeout_s=60)
    return Outcome(response=response, verdict=VerifyReply(reward=float(r.stdout == b"42\n")))
