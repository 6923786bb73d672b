"""Resolution: a loaded ``Config`` checked by the plugins it names, frozen with what workers need.

``resolve_config`` imports the adapters and agent modules a config names, lets them check their options
and computes each entry's fingerprint, once, before anything is published or any worker takes work.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import MappingProxyType, ModuleType
from typing import Any

import msgspec

from gym_runtime.config.fingerprints import agent_parts, config_fields, config_fingerprints, mismatches
from gym_runtime.config.loading import file_key_hint, readable
from gym_runtime.config.schema import (
    AgentConfig,
    Config,
    GatewayConfig,
    JetStreamConfig,
    PricingConfig,
    ResourceConfig,
    SandboxConfig,
)
from gym_runtime.errors import ConfigError, UserError
from gym_runtime.model import WORKER_KEYS, ModelConfig, WrittenOptions, adapter_module, resolve_model
from gym_runtime.plugins import import_plugin, load_plugin

HOSTED_RESOURCE_MODULE = "gym_runtime.nemo_gym.hosting.resource"  # what the workers use of hosting


class AgentView(msgspec.Struct, frozen=True, kw_only=True):
    """What an agent worker takes of a resolved config, in one read (``ResolvedConfig.agent``): its entry, its
    module, its fingerprint and discovery fields, rows' ``provenance.parts`` and each model's fingerprint."""

    entry: AgentConfig
    module: ModuleType
    fingerprint: str
    fields: Mapping[str, str]
    parts: dict[str, str]
    model_fingerprints: dict[str, str]


class ResolvedConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A config whose plugins have checked it: what workers, ``make_workers``, ``publish_batch`` and ``Client``
    take. Made only by ``resolve_config`` (or ``resolve_models``), once, from a loaded ``Config``, which it
    leaves as it was.

    ``config``: the loaded config with each ``models`` entry's options parsed by its adapter, whole (what is
    printed, checked rows against and kept beside the output). Each of its keys is set apart once too, so a
    holder reads ``resolved.gateway``, never ``resolved.config.gateway``: ``namespace``, ``nats``, ``jetstream``,
    ``gateway``, the ``models``, ``resources``, ``agents`` and ``sandboxes`` entries (read-only mappings nobody
    holding the resolved config can change), ``pricing``, ``reward_bound``, ``base_dir`` and ``source``.
    ``agent_modules``: each agent entry's module (a hosted one's: ``gym_runtime.nemo_gym.hosting.agent``); ``hosting``:
    what the workers use of hosting (``gym_runtime.nemo_gym.hosting.resource``), when a resource is hosted or an agent
    module runs in verifiers' own built environment (its ``verifiers_version``). Both loaded by name, as
    plugins are, so that the workers in a worker process import nothing from ``gym_runtime.nemo_gym.hosting`` (the
    guest process's entry, ``workers.guest_main``, which runs a hosted server's code itself in its built environment,
    is the one that does); empty when resolved for publishing only (``plugins`` False). ``fingerprints`` and
    ``fields``: each entry's, by (role, name) as workers register (``config.fingerprints``)."""

    config: Config
    plugins: bool
    agent_modules: Mapping[str, ModuleType]
    hosting: ModuleType | None
    fingerprints: Mapping[tuple[str, str], str]
    fields: Mapping[tuple[str, str], Mapping[str, str]]
    namespace: str
    nats: str | list[str]
    jetstream: JetStreamConfig
    gateway: GatewayConfig
    models: Mapping[str, ModelConfig]  # options parsed by each entry's adapter
    resources: Mapping[str, ResourceConfig]
    agents: Mapping[str, AgentConfig]
    sandboxes: Mapping[str, SandboxConfig]
    pricing: PricingConfig | None
    reward_bound: float  # the largest |reward| a row may carry
    base_dir: str  # relative paths in the config resolve here
    source: str  # the file(s) errors found later name

    def mismatches(self, workers: list[dict[str, Any]]) -> list[str]:
        """One phrase per entry of this config that live workers (``discover``'s answers) serve with another
        config, naming the keys that differ (``config.fingerprints.mismatches``)."""
        return mismatches(self.fingerprints, self.fields, workers)

    def model_fingerprints(self) -> dict[str, str]:
        """Each models entry's fingerprint, by name."""
        return {name: self.fingerprints[("model", name)] for name in self.models}

    def model_table(self) -> dict[str, dict[str, str]]:
        """Each model entry's adapter, model name and fingerprint (the batch manifest's ``models``: what rows'
        ``provenance.turns`` name); URLs, keys and headers are never in it."""
        table = {}
        for name, m in self.models.items():
            model = getattr(m.options, "model", None)
            entry = {"adapter": m.adapter, "fingerprint": self.fingerprints[("model", name)]}
            if isinstance(model, str) and model:
                entry["model"] = model
            table[name] = entry
        return table

    def agent(self, name: str) -> AgentView:
        """agents.NAME as its worker needs it, its module loaded when this config was resolved."""
        module = self.agent_modules.get(name)
        if module is None:  # a bug: a config resolved for publishing only cannot start an agent's workers
            raise TypeError(f"agents.{name}: its module was not loaded (resolve_config, not resolve_models)")
        return AgentView(
            entry=self.agents[name],
            module=module,
            fingerprint=self.fingerprints[("agent", name)],
            fields=self.fields[("agent", name)],
            parts=agent_parts(self.config, name),
            model_fingerprints=self.model_fingerprints(),
        )


def resolve_config(cfg: Config) -> ResolvedConfig:
    """Import the adapters and agents ``cfg`` names, let them check their options, and compute the fingerprints.

    The step between loading (pure data) and starting workers: ``start``, ``run``, ``validate`` and ``Client``
    call it, once, so a bad option is one ``ConfigError`` naming the key before anything is published or any
    worker takes work. ``cfg`` is left as it is.
    """
    cfg = copy.deepcopy(cfg)  # its own copy: the caller's Config may change later, this one never does
    models = _parsed_models(cfg)
    agents = {name: _agent_module(name, a, cfg.source) for name, a in cfg.agents.items()}
    hosted = any(r.hosted for r in cfg.resources.values())
    built = any(getattr(m, "verifiers_version", None) for m in agents.values())  # verifiers' own environment
    hosting = import_plugin(HOSTED_RESOURCE_MODULE) if hosted or built else None
    return _resolved(cfg, models, plugins=True, agent_modules=agents, hosting=hosting)


def resolve_models(cfg: Config) -> ResolvedConfig:
    """The adapters' half of ``resolve_config``: each ``models`` entry's options parsed by its adapter.

    Publishing needs this much (a task carries its agent's fingerprint, which hashes the adapters'
    parsed options, defaults included, as the workers see them), so ``publish`` imports the adapters,
    as loading did before; never an agent or environment module (the result starts no worker).
    """
    cfg = copy.deepcopy(cfg)
    return _resolved(cfg, _parsed_models(cfg), plugins=False, agent_modules={}, hosting=None)


def _resolved(
    cfg: Config,
    models: dict[str, ModelConfig],
    *,
    plugins: bool,
    agent_modules: dict[str, ModuleType],
    hosting: ModuleType | None,
) -> ResolvedConfig:
    config = msgspec.structs.replace(cfg, models=models)
    roles = [("model", n) for n in config.models] + [("resource", n) for n in config.resources]
    roles += [("agent", n) for n in config.agents]
    return ResolvedConfig(
        config=config,
        plugins=plugins,
        agent_modules=MappingProxyType(agent_modules),
        hosting=hosting,
        fingerprints=MappingProxyType(config_fingerprints(config)),
        fields=MappingProxyType({(r, n): MappingProxyType(config_fields(config, r, n)) for r, n in roles}),
        namespace=config.namespace,
        nats=config.nats,
        jetstream=config.jetstream,
        gateway=config.gateway,
        models=MappingProxyType(config.models),
        resources=MappingProxyType(config.resources),
        agents=MappingProxyType(config.agents),
        sandboxes=MappingProxyType(config.sandboxes),
        pricing=config.pricing,
        reward_bound=config.reward_bound,
        base_dir=config.base_dir,
        source=config.source,
    )


def _parsed_models(cfg: Config) -> dict[str, ModelConfig]:
    """Each ``models`` entry with its options parsed by its adapter (a new mapping: ``cfg`` is not changed)."""
    models = {}
    for name, m in cfg.models.items():
        try:
            models[name] = resolve_model(m)
        except msgspec.ValidationError as e:
            raise ConfigError(_model_error(cfg, name, m, readable(str(e)))) from None
    return models


def _model_error(cfg: Config, name: str, m: ModelConfig, text: str) -> str:
    """A models entry's option error as loading used to say it: the key's path and the nearest valid key;
    a key a ``--set`` wrote is named as that ``--set`` (``--set models.p.prefx: no key ...; did you mean``)."""
    written = m.options.values if isinstance(m.options, WrittenOptions) else {}
    raw = {"models": {name: {**{k: getattr(m, k) for k in WORKER_KEYS}, **written}}}
    where = f"models.{name}" + (text if text.startswith(":") else f".{text}")
    key = text.removesuffix(": unknown key")
    hint = file_key_hint(raw, f"models.{name}", text, _adapter_options)
    if isinstance(m.options, WrittenOptions) and text.endswith(": unknown key") and key in m.options.from_set:
        return f"--set models.{name}.{key}: no key models.{name}.{key}{hint}"
    return f"{cfg.source}: {where}{hint}"


def _adapter_options(name: str) -> Any:
    return adapter_module(name).Options


def _agent_module(name: str, a: AgentConfig, source: str) -> ModuleType:
    """agents.NAME's module, which validates its ``options`` now, not as a failure on every rollout.

    An agent module may define ``check_options(options) -> parsed`` (raising ``ValueError``).
    """
    try:
        module = load_plugin("agent", a.agent, f"agents.{name}.agent")
    except UserError as e:
        raise ConfigError(f"{source}: {e}") from None
    check = getattr(module, "check_options", None)
    if check is not None:
        try:
            check(a.options)
        except ValueError as e:
            text = readable(str(e).removeprefix("options: "))
            sep = "" if text.startswith(":") else "."
            raise ConfigError(f"{source}: agents.{name}.options{sep}{text}") from None
    return module
