"""Loading: YAML → a ``Config``, with ``${VAR}`` interpolation and ``--set`` overrides.

Order of application: parse each YAML file (``load_raw``) → deep-merge them in
order (``merge_raw``) → apply ``--set a.b=value`` (a path the config or its
schema does not have is an error; ``+a.b=value`` adds named entries) →
interpolate ``${VAR}`` / ``${VAR:-default}`` (from the environment, then an
``env.yaml`` beside the configs) → convert to Structs. Unknown or wrong-typed keys are errors
that name the key's path (``agents.weather_agent.max_steps``). Pure data: it imports no agent,
resource or adapter module (``resolved`` does).
"""

from __future__ import annotations

import copy
import difflib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect
import yaml

from gym_runtime.config.nemo_gym import NemoConfigError, convert_file, is_nemo_gym
from gym_runtime.config.schema import AgentConfig, Config, ResourceConfig, SandboxConfig, check_name
from gym_runtime.errors import ConfigError, did_you_mean
from gym_runtime.model import WORKER_KEYS, ModelConfig, WrittenOptions, written_model_config
from gym_runtime.plugins import use_config_dir

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}")
_PATH_RE = re.compile(r"at `\$((?:\.[^`\[]+|\[\d+\])*)`")


def _interpolate(node: Any, env: dict[str, str], path: str) -> Any:
    if isinstance(node, dict):
        return {k: _interpolate(v, env, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, env, f"{path}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:

        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            raise ConfigError(f"{path}: environment variable {name} is not set (and has no default)")

        whole = _VAR.fullmatch(node)
        value = _VAR.sub(sub, node)
        # A whole-value reference like `${N:-4}` may stand for a number or bool.
        if whole and value and not value.startswith(("{", "[")):
            try:
                return yaml.safe_load(value)
            except yaml.YAMLError:
                return value
        return value
    return node


def load_raw(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One config file as plain data (no substitution, no checks beyond "a YAML mapping")."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        rows = " (a JSONL file of task rows goes after -i)" if p.suffix == ".jsonl" else ""
        raise ConfigError(f"{p}: config file not found; give a config YAML's path{rows}") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a directory, not a config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        rows = "; a JSONL file of task rows goes after -i, the config YAML first" if p.suffix == ".jsonl" else ""
        raise ConfigError(f"{p}: invalid YAML: {' '.join(str(e).split())}{rows}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    if is_nemo_gym(raw):  # NeMo Gym's shape → our raw dict, then on as usual (config/nemo_gym.py)
        try:
            raw = convert_file(p, raw)
        except NemoConfigError as e:
            raise ConfigError(str(e)) from None
    return raw


def merge_raw(raws: list[dict[str, Any]]) -> dict[str, Any]:
    """Deep-merge configs in order: mappings merge key by key, anything else is replaced by the later one.

    This is the one merge every multi-file form maps onto (several ``CONFIG``
    arguments, NeMo Gym ``config_paths``), so they all mean the same thing.
    """
    out: dict[str, Any] = {}
    for raw in raws:
        _merge_into(out, raw)
    return out


def _merge_into(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge_into(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``a.b.c=value`` override; the value is parsed as a YAML scalar or flow collection.

    The path must exist in the config or in its schema (a typo is an error naming
    the nearest valid key); ``+a.b.c=value`` may add new named entries, e.g.
    ``+models.judge.adapter=openai``.
    """
    key, sep, value = assignment.partition("=")
    adding = key.startswith("+")
    key = key.removeprefix("+")
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {assignment!r}: expected KEY.PATH=VALUE")
    try:
        parsed = yaml.safe_load(value) if value else ""
    except yaml.YAMLError as e:
        problem = str(e).splitlines()[0] if str(e) else "invalid"
        raise ConfigError(f"--set {key}: the value {value!r} is not valid YAML ({problem})") from None
    parts = key.split(".")
    _check_path(raw, parts, adding=adding)
    node = raw
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a mapping")
        node = nxt
    node[parts[-1]] = parsed


def _check_path(raw: dict[str, Any], parts: list[str], *, adding: bool) -> None:
    """Raise unless every step of ``parts`` is in ``raw`` or allowed by the schema."""
    problem = _path_problem(raw, parts, adding=adding)
    if problem is not None:
        here, hint = problem
        raise ConfigError(f"--set {'.'.join(parts)}: no key {here}{hint}")


OptionsOf = Callable[[str], Any]  # an adapter's name → its Options type (imports it: resolve_config only)


def _path_problem(
    raw: dict[str, Any], parts: list[str], *, adding: bool, options_of: OptionsOf | None = None
) -> tuple[str, str] | None:
    """The first step of ``parts`` that is neither in ``raw`` nor in the schema, with a hint (the nearest
    key: ``; did you mean ...?``), or None when the path is fine. ``--set`` and the config files share it.
    Without ``options_of`` (loading: no adapter imported) an adapter's key of a models entry passes."""
    info: Any = msgspec.inspect.type_info(Config)
    node: Any = raw
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        present = isinstance(node, dict) and part in node
        if _is_model_entry(info) and options_of is None and part not in WORKER_KEYS:
            return None  # an adapter's own key: resolve_config checks it against the adapter's Options
        info = _flat_model_entry(info, node, options_of)
        known, free, choices = _schema_step(info, part)
        if not present and not known and not free:
            if isinstance(info, msgspec.inspect.DictType) and adding:
                pass  # a new named entry, asked for explicitly
            else:
                names = sorted(set(choices) | (set(node) if isinstance(node, dict) else set()))
                near = difflib.get_close_matches(part, names, n=1, cutoff=0.5)
                hint = (
                    f"; did you mean {'.'.join([*parts[:i], near[0]])}?"
                    if near
                    else (f"; valid keys here: {', '.join(names)}" if names and len(names) <= 12 else "")
                )
                plus = " (use +KEY.PATH=VALUE to add a new entry)" if isinstance(info, msgspec.inspect.DictType) else ""
                return here, hint + plus
        if free:
            return None  # free-form mapping (options, headers): anything below goes
        info = _schema_child(info, part)
        node = node.get(part) if isinstance(node, dict) else None
    return None


def _unknown_key_hint(raw: dict[str, Any], path: str, options_of: OptionsOf | None = None) -> str:
    """``; did you mean agents.a.max_steps?`` for an unknown key a config file spells (``path``), or ``""``."""
    parts = [p for p in path.split(".") if p]
    if not parts:
        return ""
    # the same mappings along the path, without the key in question (a present key counts as known)
    copy: dict[str, Any] = dict(raw)
    node = copy
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            break
        node[part] = node = dict(child)
    else:
        node.pop(parts[-1], None)
    problem = _path_problem(copy, parts, adding=False, options_of=options_of)
    if problem is None:
        return ""
    hint = problem[1].split(" (use +", 1)[0]
    return hint if "did you mean" in hint else ""


def _is_model_entry(info: Any) -> bool:
    return isinstance(info, msgspec.inspect.StructType) and info.cls is ModelConfig


def _flat_model_entry(info: Any, node: Any, options_of: OptionsOf | None) -> Any:
    """A ``models.NAME`` entry is flat in YAML: the worker's keys plus its adapter's option fields."""
    if not _is_model_entry(info) or options_of is None:
        return info
    adapter = node.get("adapter", "scripted") if isinstance(node, dict) else "scripted"
    try:
        options: Any = msgspec.inspect.type_info(options_of(str(adapter)))
    except ValueError:
        return info  # an unknown adapter is reported when the entry is converted
    worker = [f for f in info.fields if f.encode_name != "options"]
    return msgspec.inspect.StructType(
        cls=ModelConfig,
        fields=tuple(worker) + options.fields,
        tag_field=None,
        tag=None,
        array_like=False,
        forbid_unknown_fields=True,
    )


def _structs(info: Any) -> list[Any]:
    if isinstance(info, msgspec.inspect.StructType):
        return [info]
    if isinstance(info, msgspec.inspect.UnionType):
        return [t for x in info.types for t in _structs(x)]
    return []


def _schema_step(info: Any, part: str) -> tuple[bool, bool, list[str]]:
    """(``part`` is a schema field here, anything goes here, the field names here)."""
    structs = _structs(info)
    if structs:
        names = [f.encode_name for s in structs for f in s.fields]
        return part in names, False, names
    if isinstance(info, msgspec.inspect.UnionType):
        info = next((t for t in info.types if isinstance(t, msgspec.inspect.DictType)), None)
    if isinstance(info, msgspec.inspect.DictType):
        # a mapping of named entries (models, agents): names are data, not schema
        free = not _structs(info.value_type) and not isinstance(info.value_type, msgspec.inspect.DictType)
        return False, free, []
    return False, info is None or isinstance(info, msgspec.inspect.AnyType), []


def _schema_child(info: Any, part: str) -> Any:
    for s in _structs(info):
        for f in s.fields:
            if f.encode_name == part:
                return f.type
    if isinstance(info, msgspec.inspect.UnionType):
        info = next((t for t in info.types if isinstance(t, msgspec.inspect.DictType)), None)
    if isinstance(info, msgspec.inspect.DictType):
        return info.value_type
    return msgspec.inspect.AnyType()


def _env_file(config_path: Path) -> dict[str, str]:
    env_path = config_path.parent / "env.yaml"
    if not env_path.is_file():
        return {}
    try:
        data = yaml.safe_load(env_path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{env_path}: invalid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{env_path}: must be a mapping of NAME: value")
    return {str(k): str(v) for k, v in data.items()}


def load_config(
    path: str | os.PathLike[str] | list[str | os.PathLike[str]],
    overrides: list[str] | None = None,
) -> Config:
    """Read, merge (in order), override, substitute, convert.

    ``--set`` overrides are applied to the merged file contents *before* ``${VAR}``
    substitution, so ``--set 'models.policy.api_key=${KEY}'`` reads ``KEY`` from
    the environment. Relative paths resolve beside the first file.
    """
    paths = [Path(p) for p in (path if isinstance(path, list) else [path])]
    if not paths:
        raise ConfigError("no config file given")
    raw = merge_raw([load_raw(p) for p in paths])
    source = ", ".join(str(p) for p in paths)
    for o in overrides or []:
        apply_override(raw, o)
    from_set = _adapter_keys_set(overrides or [])
    from_env = _adapter_keys_from_env(raw)
    env: dict[str, str] = {}
    for p in paths:
        env.update(_env_file(p))
    env.update(os.environ)
    try:
        raw = _interpolate(raw, env, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    raw["base_dir"] = str(paths[0].resolve().parent)
    use_config_dir(_module_names(raw), raw["base_dir"])  # modules named relative to the config (gym_runtime.plugins)
    cfg = config_from_dict(raw, source=source)
    for name, m in cfg.models.items():
        if isinstance(m.options, WrittenOptions):
            m.options = msgspec.structs.replace(
                m.options, from_env=from_env.get(name, frozenset()), from_set=from_set.get(name, frozenset())
            )
    return cfg


def _adapter_keys_set(overrides: list[str]) -> dict[str, frozenset[str]]:
    """models entry → the adapter keys that ``--set`` overrides wrote (their errors name the ``--set``)."""
    out: dict[str, set[str]] = {}
    for o in overrides:
        parts = o.partition("=")[0].removeprefix("+").split(".")
        if len(parts) >= 3 and parts[0] == "models" and parts[2] not in WORKER_KEYS:
            out.setdefault(parts[1], set()).add(parts[2])
    return {k: frozenset(v) for k, v in out.items()}


def _adapter_keys_from_env(raw: dict[str, Any]) -> dict[str, frozenset[str]]:
    """models entry → the keys whose value (anywhere inside) is a ``${VAR}`` reference: held as secrets."""

    def refers(value: Any) -> bool:
        if isinstance(value, dict):
            return any(refers(v) for v in value.values())
        if isinstance(value, list):
            return any(refers(v) for v in value)
        return isinstance(value, str) and _VAR.search(value) is not None

    models = raw.get("models")
    return {
        str(name): frozenset(k for k, v in entry.items() if refers(v))
        for name, entry in (models.items() if isinstance(models, dict) else [])
        if isinstance(entry, dict)
    }


def _module_names(raw: dict[str, Any]) -> list[str]:
    """The ``server``/``agent`` module names of a raw config (malformed entries are left to the checks)."""
    names = []
    for section, key in (("resources", "server"), ("agents", "agent")):
        entries = raw.get(section)
        for entry in entries.values() if isinstance(entries, dict) else []:
            if isinstance(entry, dict) and isinstance(entry.get(key), str):
                names.append(entry[key])
    return names


def _converter(typ: type[msgspec.Struct]) -> Callable[[Any], Any]:
    return lambda entry: msgspec.convert(entry, typ, strict=False)


# How one entry of each section is parsed (a models entry is flat: the worker's
# keys, and its adapter's keys held as written until resolve_config, see gym_runtime.model).
_SECTIONS: dict[str, Callable[[Any], Any]] = {
    "models": written_model_config,
    "resources": _converter(ResourceConfig),
    "agents": _converter(AgentConfig),
    "sandboxes": _converter(SandboxConfig),
}


_ENTRY_TYPES: dict[str, type[msgspec.Struct]] = {
    "resources": ResourceConfig,
    "agents": AgentConfig,
    "sandboxes": SandboxConfig,
}


def _choices(typ: type[msgspec.Struct], path: str) -> str:
    """`` (one of: docker, podman, ...)``: the values a key of ``typ`` (``path``: ``backend``, ``limits.x``) takes
    when it is a ``Literal``; "" for any other key."""
    info: Any = msgspec.inspect.type_info(typ)
    for part in path.split(".") if path else []:
        fields = {f.name: f.type for f in getattr(info, "fields", ())}
        if part not in fields:
            return ""
        info = fields[part]
    kinds = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    values = [v for t in kinds if isinstance(t, msgspec.inspect.LiteralType) for v in t.values]
    return f" (one of: {', '.join(map(str, values))})" if values else ""


def config_from_dict(raw: dict[str, Any], *, source: str = "config") -> Config:
    """Plain data → ``Config``, checked as far as data alone allows (no plugin imported: ``resolve_config``)."""
    # Entries are converted one by one so that errors can name them (msgspec
    # reports dict keys as `[...]`).
    sections: dict[str, dict[str, Any]] = {}
    for section, parse in _SECTIONS.items():
        entries = raw.get(section) or {}
        if not isinstance(entries, dict):
            raise ConfigError(f"{source}: {section}: expected a mapping of name -> settings")
        sections[section] = {}
        for name, entry in entries.items():
            check_name(str(name), f"{source}: {section}")
            try:
                sections[section][str(name)] = parse(entry)
            except msgspec.ValidationError as e:
                text = readable(str(e))  # "path: problem", or ": problem" for the entry itself
                if section in _ENTRY_TYPES and "Invalid enum value" in text:  # say which values it takes
                    text += _choices(_ENTRY_TYPES[section], text.partition(":")[0])
                where = f"{section}.{name}" + (text if text.startswith(":") else f".{text}")
                raise ConfigError(f"{source}: {where}{file_key_hint(raw, f'{section}.{name}', text)}") from None
    try:
        cfg = msgspec.convert({k: v for k, v in raw.items() if k not in _SECTIONS}, Config, strict=False)
    except msgspec.ValidationError as e:
        text = readable(str(e))
        if "Invalid enum value" in text:  # say which values it takes (ray.nats, jetstream.storage ...)
            text += _choices(Config, text.partition(":")[0])
        raise ConfigError(f"{source}: {text.lstrip(': ')}{file_key_hint(raw, '', text)}") from None
    cfg.models, cfg.resources, cfg.agents = sections["models"], sections["resources"], sections["agents"]
    cfg.sandboxes = sections["sandboxes"]
    cfg.source = source
    _check_ray_roles(cfg, source)
    users = [("agents", n, a.sandbox) for n, a in cfg.agents.items()]
    for section, name, pool in users + [("resources", n, r.sandbox) for n, r in cfg.resources.items()]:
        if pool and pool not in cfg.sandboxes:
            raise ConfigError(f"{source}: {section}.{name}.sandbox: no sandbox pool named {pool!r} under sandboxes")
    for name, a in cfg.agents.items():  # a dead worker's task comes back after ack_wait_s: its sandboxes must wait
        for pool in _pools_of(cfg, a):
            grace = cfg.sandboxes[pool].lease_grace_s
            if grace is not None and a.checkpoint != "off" and grace <= a.ack_wait_s:
                raise ConfigError(
                    f"{source}: sandboxes.{pool}.lease_grace_s ({grace:g}) must exceed agents.{name}.ack_wait_s "
                    f"({a.ack_wait_s:g}): a dead worker's rollout comes back after ack_wait_s and would find its "
                    f"sandboxes gone (raise lease_grace_s, e.g. to {max(300, 2 * a.ack_wait_s):g})"
                )
    for name, a in cfg.agents.items():
        if a.model not in cfg.models:
            raise ConfigError(f"{source}: agents.{name}.model: no model named {a.model!r} under models")
        if a.resource and a.resource not in cfg.resources:
            raise ConfigError(f"{source}: agents.{name}.resource: no resource named {a.resource!r} under resources")
        for key, value in a.options.items():  # any model the options name (``*_model`` keys) must exist
            if key.endswith("_model") and isinstance(value, str) and value not in cfg.models:
                raise ConfigError(f"{source}: agents.{name}.options.{key}: no model named {value!r} under models")
    for name in cfg.pricing.models if cfg.pricing else ():
        if name not in cfg.models:
            raise ConfigError(f"{source}: pricing.models.{name}: no model named {name!r} under models")
    for name, r in cfg.resources.items():
        for other in r.calls:
            if other not in cfg.resources or other == name:
                raise ConfigError(f"{source}: resources.{name}.calls: {other!r} is not another entry under resources")
    return cfg


def _pools_of(cfg: Config, agent: AgentConfig) -> list[str]:
    """The sandbox pools an agent's rollouts hold leases in: its own, its environment's and those of the
    environments that environment calls (each lease must outlive the rollout's redelivery)."""
    envs = [agent.resource] if agent.resource in cfg.resources else []
    envs += [other for env in envs for other in cfg.resources[env].calls if other in cfg.resources]
    pools = [agent.sandbox, *(cfg.resources[env].sandbox for env in envs)]
    return list(dict.fromkeys(p for p in pools if p))


def _check_ray_roles(cfg: Config, source: str) -> None:
    """Each ``ray.roles`` key names an entry of the config (``ROLE.NAME``, the role checked by its schema); a
    wrong one is said at load, with the entries it could name."""
    entries = [f"{section}.{name}" for section in _SECTIONS for name in getattr(cfg, section)]
    for key in cfg.ray.roles:
        if key not in entries:
            role = key.partition(".")[0]
            raise ConfigError(
                f"{source}: ray.roles: {key!r} names no entry of the config's {role}{did_you_mean(key, entries)} "
                f"(its entries: {', '.join(entries)})"
            )


def file_key_hint(raw: dict[str, Any], prefix: str, text: str, options_of: OptionsOf | None = None) -> str:
    """For ``KEY: unknown key`` (a typo in a file): the nearest valid key, as ``--set`` says it."""
    if not text.endswith(": unknown key"):
        return ""
    key = text.removesuffix(": unknown key")
    return _unknown_key_hint(raw, f"{prefix}.{key}" if prefix else key, options_of)


def readable(msg: str) -> str:
    """``Object contains unknown field `x` - at `$.agents.a``` → ``agents.a.x: unknown key``."""
    m = _PATH_RE.search(msg)
    path = m.group(1).lstrip(".") if m else ""
    unknown = re.match(r"Object contains unknown field `([^`]+)`", msg)
    if unknown:
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return f"{key}: unknown key"
    text = _PATH_RE.sub("", msg).rstrip(" -")
    return f"{path}: {text}" if path else f": {text}"
