"""Configuration: YAML → msgspec Structs, with ``${VAR}`` interpolation and ``--set`` overrides.

Three jobs, one module each: ``schema`` (the Structs: what each key means), ``loading`` (files, ``--set`` and
``${VAR}`` into a ``Config``) and ``resolved`` (the plugins' checks and the fingerprints: a ``ResolvedConfig``).
This package re-exports their public names, so ``from gym_runtime.config import X`` is the one spelling.

Order of application: parse each YAML file (``load_raw``) → deep-merge them in
order (``merge_raw``) → apply ``--set a.b=value`` (a path the config or its
schema does not have is an error; ``+a.b=value`` adds named entries) →
interpolate ``${VAR}`` / ``${VAR:-default}`` (from the environment, then an
``env.yaml`` beside the configs) → convert to Structs. Unknown or wrong-typed keys are errors
that name the key's path (``agents.weather_agent.max_steps``). Secrets stay in
the Structs but are redacted from anything printed.

Loading is pure data: it imports no agent, resource or adapter module. What only a plugin can
check — an adapter's own keys (a ``models`` entry is flat), an agent's ``check_options``, that the
modules exist — is checked by ``resolve_config``, which returns a frozen ``ResolvedConfig`` (the
parsed options, the loaded plugins, the fingerprints): the one value workers, ``make_workers``,
``publish_batch`` and ``Client`` take, made once before anything is published or any worker takes work
(a publisher imports only the adapters, ``resolve_models``: its tasks' fingerprints hash their parsed
options). Until then an
adapter's keys are held as written (``gym_runtime.model.WrittenOptions``): a key whose name looks like
a secret (``api_key``, ``token``, ``headers``, ...) or whose value came from ``${VAR}`` is redacted;
once resolved, the adapter's own ``secret_fields`` decide.
"""

from gym_runtime.config.loading import apply_override, config_from_dict, load_config, load_raw, merge_raw
from gym_runtime.config.resolved import (
    HOSTED_RESOURCE_MODULE,
    ResolvedConfig,
    resolve_config,
    resolve_models,
)
from gym_runtime.config.schema import (
    ENTRY_NAME,
    HOSTED_AGENT_MODULE,
    NAME_RULE,
    AgentConfig,
    Config,
    EnvironmentServerLimits,
    GatewayConfig,
    JetStreamConfig,
    ModelPrice,
    PricingConfig,
    RayConfig,
    RayRole,
    ResourceConfig,
    SandboxConfig,
    SandboxLimits,
    check_name,
    redact,
)
from gym_runtime.model import ModelConfig

__all__ = [
    "ENTRY_NAME",
    "HOSTED_AGENT_MODULE",
    "HOSTED_RESOURCE_MODULE",
    "NAME_RULE",
    "AgentConfig",
    "Config",
    "EnvironmentServerLimits",
    "GatewayConfig",
    "JetStreamConfig",
    "ModelConfig",
    "ModelPrice",
    "PricingConfig",
    "RayConfig",
    "RayRole",
    "ResolvedConfig",
    "ResourceConfig",
    "SandboxConfig",
    "SandboxLimits",
    "apply_override",
    "check_name",
    "config_from_dict",
    "load_config",
    "load_raw",
    "merge_raw",
    "redact",
    "resolve_config",
    "resolve_models",
]
