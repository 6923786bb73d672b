"""NeMo Gym configs → our config dict, so a NeMo Gym config of a bundled environment runs unchanged.

``load_config`` calls ``convert_file`` when a YAML file has NeMo Gym's shape
(``config_paths``, or top-level instances holding ``resources_servers`` /
``responses_api_agents`` / ``responses_api_models``); what comes out is an
ordinary raw config, so interpolation, ``--set`` and every check apply as usual.

Loading, as NeMo Gym does it:

* ``config_paths: [a.yaml, b.yaml]``: files merged in order (later wins, mappings
  merged deeply), then the file itself on top. Paths are tried relative to the
  current directory (NeMo Gym's root), then the config's directory and its parents.
* ``_inherit_from: X`` inside any mapping: that mapping is merged over a base —
  another YAML file when ``X`` ends in ``.yaml``/``.yml`` (relative to the file
  naming it), else the node at dotted path ``X`` of the merged config.
* ``${name}``: a top-level scalar of the merged config or of ``env.yaml`` (in the
  current directory, as NeMo Gym reads it, or beside the config); anything else is
  left for the usual ``${VAR}`` interpolation (environment, ``env.yaml``).
  ``${oc.env:NAME,default}`` reads the environment.

Mapping (``SERVERS``; instance names are kept, so rows' ``agent_ref`` still match):

=========================================  ==============================================
NeMo Gym                                   gym-runtime
=========================================  ==============================================
resources_servers: mcqa                    resources: {server: resources.mcqa}
resources_servers: math_with_judge         resources.math (``judge_model_server`` → ``options.judge_model``)
resources_servers: example_single_tool_call  resources.weather
resources_servers: example_session_state_mgmt  resources.counter
resources_servers: example_multi_step      resources.multi_step
resources_servers: example_multi_turn_gymnasium  resources.multi_turn_gymnasium
resources_servers: <same name>             resources.<same name> (workplace_assistant, code_gen, calendar,
                                           equivalence_llm_judge, instruction_following, structured_outputs,
                                           reasoning_gym, math_advanced_calculations)
responses_api_agents: simple_agent         agents: {agent: agents.simple, resource, model, max_steps}
responses_api_models: openai_model         models: {adapter: openai} (openai_base_url/api_key/model → base_url/…)
responses_api_models: vllm_model           models: {adapter: vllm}
                                           (return_token_id_information → return_token_ids)
=========================================  ==============================================

Server settings other than NeMo Gym's descriptive ones (``entrypoint``, ``domain``,
``description``, ...) become the resource's ``options``; ``*_model_server: {name}``
becomes ``*_model: name``. Any other resources server is *hosted*: ``resources: {nemo_gym: NAME,
options: <its settings as written>}`` runs NeMo Gym's own code in our workers (``gym_runtime.nemo_gym.hosting``).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from gym_runtime.errors import ConfigError

SERVER_TYPES = ("resources_servers", "responses_api_agents", "responses_api_models")

RESOURCES: dict[str, str] = {
    "mcqa": "resources.mcqa",
    "math_with_judge": "resources.math",
    "math_advanced_calculations": "resources.math_advanced_calculations",
    "equivalence_llm_judge": "resources.equivalence_llm_judge",
    "instruction_following": "resources.instruction_following",
    "structured_outputs": "resources.structured_outputs",
    "reasoning_gym": "resources.reasoning_gym",
    "workplace_assistant": "resources.workplace_assistant",
    "code_gen": "resources.code_gen",
    "calendar": "resources.calendar",
    "example_single_tool_call": "resources.weather",
    "example_session_state_mgmt": "resources.counter",
    "example_multi_step": "resources.multi_step",
    "example_multi_turn_gymnasium": "resources.multi_turn_gymnasium",
}
AGENTS: dict[str, str] = {"simple_agent": "agents.simple"}
MODELS: dict[str, str] = {"openai_model": "openai", "vllm_model": "vllm"}

# NeMo Gym's descriptive or process-level settings: they have no meaning here.
_META = {
    "entrypoint",
    "domain",
    "verified",
    "verified_url",
    "description",
    "value",
    "license",
    "host",
    "port",
    "num_workers",
    "datasets",
    "dependencies",
    "python_version",
}
# Per-server option names that differ from NeMo Gym's (None: dropped).
_OPTION_RENAMES: dict[str, dict[str, str | None]] = {
    "code_gen": {"num_processes": "max_parallel", "debug": None},
}
_MODEL_FIELDS: dict[str, dict[str, str | None]] = {
    "openai_model": {
        "openai_base_url": "base_url",
        "openai_api_key": "api_key",
        "openai_model": "model",
        "openai_default_headers": "headers",
        "drop_input_reasoning_items": None,
    },
    "vllm_model": {
        "base_url": "base_url",
        "api_key": "api_key",
        "model": "model",
        "default_headers": "headers",
        "return_token_id_information": "return_token_ids",
        "chat_template_kwargs": "chat_template_kwargs",
        "extra_body": "extra_body",
        "request_prompt_and_generation_token_ids": None,
        "uses_reasoning_parser": None,
        "uses_interleaved_reasoning": None,
        "sampling_overrides": None,
    },
}
_AGENT_FIELDS = {"resources_server", "model_server", "max_steps"}
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_OC_ENV = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^}]*))?\}")


class NemoConfigError(ConfigError):
    """A NeMo Gym config that cannot be mapped; the message names the file and the entry."""


def is_nemo_gym(raw: dict[str, Any]) -> bool:
    """NeMo Gym's shape: ``config_paths``, or an instance holding one of its server types."""
    if "config_paths" in raw:
        return True
    return any(isinstance(v, dict) and any(t in v for t in SERVER_TYPES) for v in raw.values())


def _merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(out[k], v) if k in out else v
        return out
    return copy.deepcopy(over)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise NemoConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise NemoConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise NemoConfigError(f"{path}: the top level must be a mapping")
    return _inherit_files(data, path.parent, str(path))


def _inherit_files(node: Any, here: Path, source: str) -> Any:
    """Resolve ``_inherit_from: file.yaml`` (relative to the file that says it)."""
    if isinstance(node, list):
        return [_inherit_files(v, here, source) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _inherit_files(v, here, source) for k, v in node.items()}
    ref = node.get("_inherit_from")
    if isinstance(ref, str) and ref.endswith((".yaml", ".yml")):
        base = _read(here / ref if not Path(ref).is_absolute() else Path(ref))
        node.pop("_inherit_from")
        node = _merge(base, node)
    return node


def _find(ref: str, config_dir: Path) -> Path:
    candidates = (
        [Path(ref)]
        if Path(ref).is_absolute()
        else [Path.cwd() / ref, config_dir / ref, *(parent / ref for parent in config_dir.parents)]
    )
    for c in candidates:
        if c.is_file():
            return c
    raise NemoConfigError(f"config_paths: {ref} not found (tried the current directory, {config_dir} and its parents)")


def _inherit_paths(node: Any, root: dict[str, Any], where: str) -> Any:
    """Resolve ``_inherit_from: a.b.c`` (a dotted path into the merged config)."""
    if isinstance(node, list):
        return [_inherit_paths(v, root, where) for v in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("_inherit_from")
    if isinstance(ref, str):
        base: Any = root
        for part in ref.split("."):
            if not isinstance(base, dict) or part not in base:
                raise NemoConfigError(f"{where}: _inherit_from: {ref!r} is not a path of the config")
            base = base[part]
        node = _merge(_inherit_paths(base, root, where), {k: v for k, v in node.items() if k != "_inherit_from"})
    return {k: _inherit_paths(v, root, f"{where}.{k}" if where else str(k)) for k, v in node.items()}


def _variables(merged: dict[str, Any], config_dir: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for env_path in (config_dir / "env.yaml", Path.cwd() / "env.yaml"):
        if env_path.is_file():
            data = yaml.safe_load(env_path.read_text()) or {}
            if isinstance(data, dict):
                found.update({str(k): str(v) for k, v in data.items() if not isinstance(v, (dict, list))})
    found.update({str(k): str(v) for k, v in merged.items() if isinstance(v, (str, int, float, bool))})
    return found


def _substitute(node: Any, variables: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {k: _substitute(v, variables) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, variables) for v in node]
    if isinstance(node, str) and "${" in node:
        node = _OC_ENV.sub(lambda m: os.environ.get(m.group(1), m.group(2) or ""), node)
        whole = _REF.fullmatch(node)
        node = _REF.sub(lambda m: variables.get(m.group(1), m.group(0)), node)
        if whole and "${" not in node:
            return yaml.safe_load(node) if node else node
    return node


def _ref_name(value: Any, kind: str, where: str) -> str:
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return value["name"]
    raise NemoConfigError(f"{where}: expected {{type: {kind}, name: ...}}, got {value!r}")


def _supported(table: dict[str, str]) -> str:
    return ", ".join(sorted(table))


def _resource(name: str, impl: str, body: dict[str, Any], where: str) -> dict[str, Any]:
    if impl not in RESOURCES:
        # no port of ours: NeMo Gym's own server code is hosted, its settings passed through as they are
        settings = {k: v for k, v in body.items() if k not in _META and v is not None}
        return {"nemo_gym": impl, **({"options": settings} if settings else {})}
    renames = _OPTION_RENAMES.get(impl, {})
    options: dict[str, Any] = {}
    for key, value in body.items():
        if key in _META or value is None:
            continue
        if key.endswith("_model_server"):
            options[key.removesuffix("_server")] = _ref_name(value, "responses_api_models", f"{where}.{key}")
            continue
        target = renames.get(key, key)
        if target is not None:
            options[target] = value
    entry: dict[str, Any] = {"server": RESOURCES[impl]}
    if options:
        entry["options"] = options
    return entry


def _agent(name: str, impl: str, body: dict[str, Any], where: str) -> dict[str, Any]:
    if impl not in AGENTS:
        raise NemoConfigError(
            f"{where}: NeMo Gym agent {impl!r} has no gym-runtime equivalent; supported: {_supported(AGENTS)}"
        )
    unknown = sorted(set(body) - _AGENT_FIELDS - _META)
    if unknown:
        raise NemoConfigError(f"{where}: {', '.join(unknown)}: not supported for {impl}")
    if "resources_server" not in body or "model_server" not in body:
        raise NemoConfigError(f"{where}: {impl} needs resources_server and model_server")
    entry: dict[str, Any] = {
        "agent": AGENTS[impl],
        "resource": _ref_name(body["resources_server"], "resources_servers", f"{where}.resources_server"),
        "model": _ref_name(body["model_server"], "responses_api_models", f"{where}.model_server"),
    }
    if body.get("max_steps") is not None:
        entry["max_steps"] = body["max_steps"]
    return entry


def _model(name: str, impl: str, body: dict[str, Any], where: str) -> dict[str, Any]:
    if impl not in MODELS:
        raise NemoConfigError(
            f"{where}: NeMo Gym model server {impl!r} has no gym-runtime equivalent; supported: {_supported(MODELS)}"
        )
    fields = _MODEL_FIELDS[impl]
    entry: dict[str, Any] = {"adapter": MODELS[impl]}
    for key, value in body.items():
        if key in _META:
            continue
        if key not in fields:
            raise NemoConfigError(f"{where}.{key}: not supported for {impl} (known: {', '.join(sorted(fields))})")
        target = fields[key]
        if target is not None and value not in (None, {}, ""):
            entry[target] = value
    return entry


_CONVERTERS = {
    "resources_servers": ("resources", _resource),
    "responses_api_agents": ("agents", _agent),
    "responses_api_models": ("models", _model),
}


def merged_dict(path: str | os.PathLike[str], raw: dict[str, Any]) -> dict[str, Any]:
    """The NeMo Gym global config dict of a file: ``config_paths`` merged, inheritance and ``${}`` resolved."""
    p = Path(path)
    config_dir = p.resolve().parent
    raw = _inherit_files(raw, config_dir, str(p))
    paths = raw.get("config_paths") or []
    if isinstance(paths, str):
        paths = [s.strip() for s in paths.strip("[]").split(",") if s.strip()]
    if not isinstance(paths, list):
        raise NemoConfigError(f"{p}: config_paths must be a list of YAML files")
    merged: dict[str, Any] = {}
    for ref in paths:
        merged = _merge(merged, _read(_find(str(ref), config_dir)))
    merged = _merge(merged, {k: v for k, v in raw.items() if k != "config_paths"})
    merged = _inherit_paths(merged, merged, "")
    return _substitute(merged, _variables(merged, config_dir))


def convert(ng: dict[str, Any], *, source: str = "config") -> dict[str, Any]:
    """A merged NeMo Gym dict → our raw config dict (``models``/``resources``/``agents``)."""
    out: dict[str, Any] = {"models": {}, "resources": {}, "agents": {}}
    for name, instance in ng.items():
        if not isinstance(instance, dict):
            continue  # variables (policy_base_url, ...) and NeMo Gym's process settings
        kinds = [t for t in SERVER_TYPES if t in instance]
        if not kinds:
            continue
        if len(kinds) > 1 or len(instance) > 1:
            raise NemoConfigError(
                f"{source}: {name}: an instance holds exactly one server type, got {sorted(instance)}"
            )
        impls = instance[kinds[0]]
        if not isinstance(impls, dict) or len(impls) != 1:
            raise NemoConfigError(f"{source}: {name}.{kinds[0]}: expected exactly one server, e.g. {{mcqa: {{...}}}}")
        ((impl, body),) = impls.items()
        section, conv = _CONVERTERS[kinds[0]]
        out[section][str(name)] = conv(str(name), str(impl), body or {}, f"{source}: {name}.{kinds[0]}.{impl}")
    if not (out["resources"] or out["agents"] or out["models"]):
        raise NemoConfigError(f"{source}: no NeMo Gym servers found")
    return out


def convert_file(path: str | os.PathLike[str], raw: dict[str, Any]) -> dict[str, Any]:
    """``load_config``'s hook: a NeMo Gym config file (already parsed as ``raw``) → our raw dict."""
    return convert(merged_dict(path, raw), source=str(path))


def datasets(path: str | os.PathLike[str]) -> dict[str, list[dict[str, Any]]]:
    """Agent instance name → its NeMo Gym ``datasets:`` entries (for ``prepare``)."""
    p = Path(path)
    merged = merged_dict(p, _read(p))
    found: dict[str, list[dict[str, Any]]] = {}
    for name, instance in merged.items():
        agents = instance.get("responses_api_agents") if isinstance(instance, dict) else None
        if isinstance(agents, dict):
            for body in agents.values():
                if isinstance(body, dict) and isinstance(body.get("datasets"), list):
                    found[str(name)] = body["datasets"]
    return found


def data_only_overrides(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """``--set`` entries that stand in for model servers NeMo Gym configs name but do not define.

    NeMo Gym keeps the policy model in a file of its own; ``validate`` and ``prepare``
    never call a model, so for them a missing one gets a placeholder (the scripted
    test double), as NeMo Gym's data tools do. Models defined in any of ``paths``
    are left alone; configs without NeMo Gym's shape, or any problem, add nothing.
    """
    wanted: set[str] = set()
    defined: set[str] = set()
    for path in paths:
        try:
            raw = _read(Path(path))
            ours = convert_file(path, raw) if is_nemo_gym(raw) else raw
        except (NemoConfigError, OSError):
            return []
        models = ours.get("models")
        defined |= set(models) if isinstance(models, dict) else set()
        if is_nemo_gym(raw):
            wanted |= {a["model"] for a in ours["agents"].values()}
            wanted |= {
                v
                for r in ours["resources"].values()
                for k, v in r.get("options", {}).items()
                if k.endswith("_model") and isinstance(v, str)
            }
    return [f"+models.{m}.adapter=scripted" for m in sorted(wanted - defined)]
