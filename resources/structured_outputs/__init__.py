"""structured_outputs: the response must satisfy the JSON schema the task gives.

Matches NeMo Gym's ``structured_outputs`` resources server. The task row carries
``schema_str`` (a JSON schema, as a string), ``schema_type`` (``json`` default,
``yaml``, ``xml``, ``toml`` or ``csv``: how text answers are parsed) and
``response_mode``:

- ``text`` (default): the ``output_text`` parts of every message item, joined,
  are parsed as ``schema_type`` — no code fences or prose allowed;
- ``tool_call``: the response must hold exactly one ``function_call``, named
  ``tool_name`` when the row gives one, whose JSON arguments (or their
  ``tool_payload_key`` member) are the instance.

The schema is made strict before validation: every object schema that lists
``properties`` (reached through nested objects, not through lists such as
``anyOf``) gets all of them ``required`` and ``additionalProperties: false``.
Validation is OpenAPI 3.1 (JSON Schema 2020-12; ``format`` is not enforced),
through ``openapi-schema-validator``. XML text is coerced to the schema's scalar
types (``options.xml_coerce_types``, default true) with repeated-element lists
unwrapped; CSV rows are always coerced.

``reward`` is 1.0 or 0.0; extra fields ``error_type`` (``empty_response``,
``schema_error``, ``parse_error``, ``validation_error``, ``api_error``,
``missing_tool_call``, ``multiple_tool_calls``, ``wrong_tool_name``,
``tool_arguments_parse_error``, ``missing_tool_payload_key``; null on success)
and ``error_message`` (the exception text, cut to 200 characters).

Parsing and validation run in a worker process with a time limit
(``options.timeout_s``, default 30 s): schemas and documents come from the data.
"""

from __future__ import annotations

import csv
import io
import json
import tomllib
from collections.abc import Callable
from typing import Any

import msgspec

from gym_runtime.messages import FunctionCall, Response, output_text
from gym_runtime.resource import Resource, Verdict, run_in_process

__all__ = ["SCHEMA_TYPES", "StructuredOutputs", "evaluate_object", "evaluate_text", "strictify", "tool_payload"]

SCHEMA_TYPES = ("json", "yaml", "xml", "toml", "csv")
Outcome = tuple[float, str | None, str | None]


def _described(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:200]}"


# ------------------------------------------------------------------ schema and parsing


def strictify(schema: Any) -> None:
    """Require every listed property and forbid others, in place, through nested objects."""
    if not isinstance(schema, dict):
        return
    if "properties" in schema:
        schema["required"] = list(schema["properties"])
        schema["additionalProperties"] = False
    for value in list(schema.values()):
        strictify(value)


def parse_document(schema_type: str, text: str) -> Any:
    if schema_type == "json":
        return json.loads(text)
    if schema_type == "yaml":
        import yaml

        return yaml.safe_load(text)
    if schema_type == "xml":
        import xmltodict

        return xmltodict.parse(text)
    if schema_type == "toml":
        return tomllib.loads(text)
    if schema_type == "csv":
        return list(csv.DictReader(io.StringIO(text)))
    return None


def _scalar(value: str, kind: Any) -> Any:
    """A string converted to a JSON-schema scalar type; unchanged when it does not convert."""
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            return float(value)
        if kind == "boolean":
            low = value.lower()
            if low in ("true", "1"):
                return True
            if low in ("false", "0"):
                return False
    except (ValueError, AttributeError):
        pass
    return value


def coerce_xml(data: Any, schema: Any) -> Any:
    """xmltodict output (all strings) walked alongside the schema and converted where possible."""
    if not isinstance(schema, dict) or "type" not in schema:
        return data
    kind = schema["type"]
    if kind == "object" and isinstance(data, dict):
        props = schema.get("properties", {})
        return {k: coerce_xml(v, props[k]) if k in props else v for k, v in data.items()}
    if kind == "array":
        # <skills><skill>a</skill><skill>b</skill></skills> parses as {"skill": [...]} (or one value):
        # at an array position a one-key dict is that wrapping, not data.
        if isinstance(data, dict) and len(data) == 1:
            data = next(iter(data.values()))
        if not isinstance(data, list):
            data = [] if data is None else [data]
        return [coerce_xml(item, schema.get("items", {})) for item in data]
    if data is None and kind == "string":
        return ""  # an empty element is an empty string; other types stay null and fail
    if isinstance(data, str):
        return _scalar(data, kind)
    return data


def _csv_cell(value: Any, kind: Any) -> Any:
    if isinstance(kind, list):
        if (value is None or value == "") and "null" in kind:
            return None
        for k in kind:
            if k == "null":
                continue
            out = _csv_cell(value, k)
            if not isinstance(out, str) or k == "string":
                return out
        return value
    if value is None or value == "":
        return value
    return _scalar(value, kind)


def coerce_csv(rows: list[dict[str, Any]], schema: Any) -> list[dict[str, Any]]:
    """csv.DictReader rows (all strings) converted to the item schema's property types."""
    item = schema.get("items", schema)
    props = item.get("properties", {})
    return [{k: _csv_cell(v, props.get(k, {}).get("type", "string")) for k, v in row.items()} for row in rows]


def _validate(instance: Any, schema: Any) -> None:
    from openapi_schema_validator import validate

    validate(instance, schema)


# ------------------------------------------------------------------ the two modes (worker-process functions)


def evaluate_text(schema_type: str, schema_str: str, text: str, xml_coerce_types: bool = True) -> Outcome:
    """(reward, error_type, error_message) for a text answer."""
    if not text or not text.strip():
        return 0.0, "empty_response", "No assistant response text"

    schema = _strict_schema(schema_str)
    if isinstance(schema, tuple):
        return schema
    try:
        document = parse_document(schema_type, text)
    except Exception as e:
        return 0.0, "parse_error", _described(e)

    def coerced(schema: Any) -> Any:  # a coercion that fails is a validation error
        if schema_type == "xml" and xml_coerce_types:
            return coerce_xml(document, schema)
        if schema_type == "csv":
            return coerce_csv(document, schema)
        return document

    return _checked(schema, coerced)


def evaluate_object(schema_str: str, instance: Any) -> Outcome:
    """(reward, error_type, error_message) for already-parsed tool-call arguments."""
    schema = _strict_schema(schema_str)
    return schema if isinstance(schema, tuple) else _checked(schema, lambda _schema: instance)


def _strict_schema(schema_str: str) -> Any:
    """The schema, made strict (``strictify``); a ``schema_error`` outcome when it is not JSON."""
    try:
        schema = json.loads(schema_str)
    except Exception as e:
        return 0.0, "schema_error", str(e)[:200]
    strictify(schema)
    return schema


def _checked(schema: Any, document: Callable[[Any], Any]) -> Outcome:
    """1.0 when ``document(schema)`` (the answer, coerced to the schema's types where its format needs) is
    valid; else a ``validation_error`` outcome."""
    try:
        _validate(document(schema), schema)
    except Exception as e:
        return 0.0, "validation_error", _described(e)
    return 1.0, None, None


# ------------------------------------------------------------------ response reading


def _error_repr(error: dict[str, Any]) -> str:
    """An API error the way the OpenAI SDK prints ``ResponseError``."""
    keys = [k for k in ("code", "message") if k in error] + [k for k in error if k not in ("code", "message")]
    return "ResponseError(" + ", ".join(f"{k}={error[k]!r}" for k in keys) + ")"


def tool_payload(row: dict[str, Any], response: Response) -> tuple[Any, str | None, str | None]:
    """(instance, error_type, error_message) from the response's single function call."""
    if response.error is not None:
        return None, "api_error", _error_repr(response.error)[:200]
    calls = [i for i in response.output if isinstance(i, FunctionCall)]
    if not calls:
        return None, "missing_tool_call", "No function_call item found in assistant response"
    names = ", ".join(c.name for c in calls)
    if len(calls) > 1:
        return None, "multiple_tool_calls", f"Expected exactly one function_call, got: {names}"
    call = calls[0]
    tool_name = row.get("tool_name")
    if tool_name and call.name != tool_name:
        return None, "wrong_tool_name", f"Expected tool '{tool_name}', got: {names}"
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError as e:
        return None, "tool_arguments_parse_error", _described(e)
    key = row.get("tool_payload_key")
    if key:
        if not isinstance(arguments, dict) or key not in arguments:
            return None, "missing_tool_payload_key", f"Missing tool payload key: {key}"
        return arguments[key], None, None
    return arguments, None, None


def _task(row: dict[str, Any]) -> tuple[str, str]:
    schema_str = row.get("schema_str")
    if not isinstance(schema_str, str):
        raise ValueError("task row: schema_str (a JSON schema as a string) is required")
    schema_type = row.get("schema_type", "json")
    if schema_type not in SCHEMA_TYPES:
        raise ValueError(f"task row: schema_type must be one of {', '.join(SCHEMA_TYPES)}; got {schema_type!r}")
    return schema_str, schema_type


class StructuredTask(msgspec.Struct, kw_only=True):
    """The task fields verify reads."""

    schema_str: str
    schema_type: str = "json"
    response_mode: str | None = None
    tool_name: str | None = None
    tool_payload_key: str | None = None


class StructuredOutputs(Resource):
    """Stateless: no tools of its own (tool-call tasks offer theirs in ``responses_create_params.tools``)."""

    task_fields = StructuredTask
    requires = ("openapi_schema_validator", "xmltodict")
    install = "pip install 'gym-runtime[envs]'"
    check_task = staticmethod(_task)
    row_tools = "any"  # the rows offer answer tools: graded, never run here

    async def verify(self, task: dict[str, Any], response: Response) -> Verdict:
        schema_str, schema_type = _task(task)
        timeout = float(self.options.get("timeout_s", 30.0))
        if task.get("response_mode") == "tool_call":
            instance, error_type, error_message = tool_payload(task, response)
            if error_type is None:
                reward, error_type, error_message = await run_in_process(
                    evaluate_object, schema_str, instance, timeout=timeout
                )
            else:
                reward = 0.0
        else:
            coerce = bool(self.options.get("xml_coerce_types", True))
            reward, error_type, error_message = await run_in_process(
                evaluate_text, schema_type, schema_str, output_text(response.output), coerce, timeout=timeout
            )
        return Verdict(reward=reward, fields={"error_type": error_type, "error_message": error_message})
