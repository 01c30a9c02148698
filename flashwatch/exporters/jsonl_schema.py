"""The JSON Schema of a ``metrics.jsonl`` line (:data:`SCHEMA`) and a checker for it.

Every name of a step record's ``metrics`` object comes from ``flashwatch.metrics.METRICS``.
``flashwatch.exporters.jsonl`` re-exports everything here.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..metrics import METRICS, MetricSpec

SCHEMA_VERSION = 1

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

# -- schema -------------------------------------------------------------------------------

_NUMBER = {"anyOf": [{"type": "number"}, {"enum": list(_NONFINITE)}]}
_NUMBER_OR_NULL = {"anyOf": [{"type": "number"}, {"enum": list(_NONFINITE)}, {"type": "null"}]}
_INT_LABELS = ("layer", "head")


def _metric_schema(spec: MetricSpec) -> dict:
    if not spec.labels:
        return dict(_NUMBER, description=spec.help)
    if spec.per_head:
        return {"description": spec.help + " Values as [layer][head].",
                "type": "array", "items": {"type": "array", "items": _NUMBER_OR_NULL}}
    props = {lab: {"type": "integer"} if lab in _INT_LABELS else {"type": "string"}
             for lab in spec.labels}
    props["value"] = _NUMBER
    return {"description": spec.help + " One object per label set.",
            "type": "array",
            "items": {"type": "object", "required": [*spec.labels, "value"],
                      "properties": props, "additionalProperties": False}}


ALERT_SCHEMA: dict = {
    "type": "object",
    "required": ["rule", "step", "layer", "head", "value", "threshold", "severity", "message"],
    "properties": {
        "rule": {"type": "string"},
        "step": {"type": "integer", "minimum": 0},
        "layer": {"type": "integer", "minimum": -1},
        "head": {"type": "integer", "minimum": -1},
        "value": _NUMBER,
        "threshold": _NUMBER,
        "severity": {"enum": ["warning", "critical"]},
        "message": {"type": "string"},
    },
}

STEP_SCHEMA: dict = {
    "type": "object",
    "required": ["kind", "schema", "step", "time", "metrics", "new_alerts", "active_alerts"],
    "properties": {
        "kind": {"const": "step"},
        "schema": {"const": SCHEMA_VERSION},
        "step": {"type": "integer", "minimum": 0},
        "time": {"type": "number", "description": "unix seconds"},
        "metrics": {"type": "object",
                    "required": [m.name for m in METRICS],
                    "properties": {m.name: _metric_schema(m) for m in METRICS},
                    "additionalProperties": False},
        "new_alerts": {"type": "array", "items": ALERT_SCHEMA},
        "active_alerts": {"type": "array", "items": ALERT_SCHEMA},
    },
    "additionalProperties": False,
}

OPEN_SCHEMA: dict = {
    "type": "object",
    "required": ["kind", "schema", "time", "flashwatch_version", "layout"],
    "properties": {
        "kind": {"const": "open"},
        "schema": {"const": SCHEMA_VERSION},
        "time": {"type": "number"},
        "flashwatch_version": {"type": "string"},
        "layout": {"type": "array", "items": {
            "type": "object", "required": ["name", "heads"],
            "properties": {"name": {"type": "string"}, "heads": {"type": "integer", "minimum": 1}},
            "additionalProperties": False}},
        "monitor_config": {"type": "object"},  # MonitorConfig.to_dict(), when a Monitor opened the file
    },
    "additionalProperties": False,
}

CLOSE_SCHEMA: dict = {
    "type": "object",
    "required": ["kind", "schema", "time"],
    "properties": {"kind": {"const": "close"}, "schema": {"const": SCHEMA_VERSION},
                   "time": {"type": "number"}},
    "additionalProperties": False,
}

#: JSON Schema (draft 2020-12) of one line of ``metrics.jsonl``.
SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://flashwatch.invalid/schemas/metrics-jsonl-1.json",
    "title": "flashwatch metrics.jsonl record",
    "oneOf": [OPEN_SCHEMA, STEP_SCHEMA, CLOSE_SCHEMA],
}


def validate_record(record: Any, schema: Mapping = SCHEMA) -> None:
    """Check ``record`` against ``schema`` (the subset of JSON Schema that :data:`SCHEMA` uses).

    Raises:
        ValueError: naming the first field that does not match and what was expected.
    """
    err = _check(record, schema, "$")
    if err:
        raise ValueError(f"flashwatch JSONL record does not match its schema: {err}")


_TYPES = {
    "object": lambda x: isinstance(x, dict),
    "array": lambda x: isinstance(x, list),
    "string": lambda x: isinstance(x, str),
    "integer": lambda x: isinstance(x, int) and not isinstance(x, bool),
    "number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
    "null": lambda x: x is None,
    "boolean": lambda x: isinstance(x, bool),
}


def _check(x: Any, s: Mapping, where: str) -> str | None:
    if "anyOf" in s or "oneOf" in s:
        options = s.get("anyOf") or s["oneOf"]
        errors = [_check(x, o, where) for o in options]
        ok = sum(e is None for e in errors)
        if ok == 0 or ("oneOf" in s and ok > 1):
            if "oneOf" in s and isinstance(x, dict) and "kind" in x:
                # Records: report against the schema of their own kind, not every option.
                for o in options:
                    if o.get("properties", {}).get("kind", {}).get("const") == x["kind"]:
                        return _check(x, o, where)
            return f"{where}: {x!r:.80} matches none of the accepted forms ({'; '.join(filter(None, errors))})"
    if "const" in s and x != s["const"]:
        return f"{where}: expected {s['const']!r}, got {x!r:.80}"
    if "enum" in s and x not in s["enum"]:
        return f"{where}: expected one of {s['enum']}, got {x!r:.80}"
    if "type" in s and not _TYPES[s["type"]](x):
        return f"{where}: expected {s['type']}, got {type(x).__name__} {x!r:.80}"
    if "minimum" in s and isinstance(x, (int, float)) and x < s["minimum"]:
        return f"{where}: must be >= {s['minimum']}, got {x!r}"
    if isinstance(x, dict):
        for key in s.get("required", ()):
            if key not in x:
                return f"{where}: missing required field {key!r}"
        props = s.get("properties", {})
        for key, value in x.items():
            if key in props:
                err = _check(value, props[key], f"{where}.{key}")
                if err:
                    return err
            elif s.get("additionalProperties", True) is False:
                return f"{where}: unexpected field {key!r} (accepted: {', '.join(props)})"
    if isinstance(x, list) and "items" in s:
        for i, item in enumerate(x):
            err = _check(item, s["items"], f"{where}[{i}]")
            if err:
                return err
    return None


__all__ = ["SCHEMA", "STEP_SCHEMA", "OPEN_SCHEMA", "CLOSE_SCHEMA", "ALERT_SCHEMA", "SCHEMA_VERSION",
           "validate_record"]
