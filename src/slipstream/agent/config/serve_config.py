"""The one config of ``slipstream serve``: sections, each setting in exactly one of them.

    defaults < environment (POD_IP, ...) < file (--config, or the operator's ConfigMap)
             < flags  --ServeConfig.from_layers()--> ServeConfig (frozen, validated once)
    ServeConfig --to_yaml()--> what --print-config prints, and --config reads back

The file is YAML in the CRD's spelling (camelCase keys, the CRD's section names), so the
ServingReplica's fields keep their names from ``kubectl get sr -o yaml`` to the agent:

    model: {path: /models/llama, name: llama, dtype: bfloat16}
    scheduler: {policy: lars, maxNumSeqs: 128}

Errors are one line naming the key (and its flag): ``scheduler.maxNumSeqs (--max-num-seqs):
Input should be greater than or equal to 1``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from slipstream.agent.config.engine_sections import (
    EngineSettings, ModelSettings, ParallelSettings, SchedulerSettings)
from slipstream.agent.config.serving_sections import (
    DisaggregationSettings, KVTierSettings, PoolSettings, ServerSettings, SloSettings)
from slipstream.agent.config.setting import field_flag


class ConfigError(ValueError):
    """A config that does not validate; the message is one line naming the key."""


class ServeConfig(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True,
                              extra="forbid")

    model: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    parallelism: ParallelSettings = Field(default_factory=ParallelSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    slo: SloSettings = Field(default_factory=SloSettings)
    pools: PoolSettings = Field(default_factory=PoolSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    disaggregation: DisaggregationSettings = Field(default_factory=DisaggregationSettings)
    kv_tiers: KVTierSettings = Field(default_factory=KVTierSettings)

    @model_validator(mode="after")
    def _across_sections(self) -> ServeConfig:
        if self.server.api_processes > 1:
            if self.server.single_process:
                raise ValueError("server.apiProcesses above 1 needs the engine in a process of "
                                 "its own (leave out --single-process)")
            if self.disaggregation.role != "mixed":
                raise ValueError("server.apiProcesses above 1 serves the mixed role only; "
                                 "prefill and decode instances run one API process")
        return self

    @classmethod
    def from_layers(cls, *layers: dict[str, Any]) -> ServeConfig:
        """The config of the layers (nested dicts, file or field spelling), later ones
        winning key by key. ConfigError names the first key that does not validate."""
        merged: dict[str, Any] = {}
        for layer in layers:
            for section, values in _normalised(layer).items():
                merged.setdefault(section, {}).update(values)
        return _validate(merged)

    @classmethod
    def load(cls, path: Path) -> ServeConfig:
        return cls.from_layers(read_file(path))

    def to_tree(self, only_set: bool = False) -> dict[str, Any]:
        """The file form: camelCase keys; ``only_set``: only what was given (the operator's
        ConfigMap keeps what the spec says, not every default)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=only_set,
                               exclude_none=only_set)

    def to_yaml(self, only_set: bool = False) -> str:
        return yaml.safe_dump(self.to_tree(only_set), sort_keys=True)

    def changed(self, **sections: dict[str, Any]) -> ServeConfig:
        """This config with some settings changed (``changed(server={"port": 0})``),
        validated again."""
        return ServeConfig.from_layers(self.to_tree(only_set=True), sections)


def read_file(path: Path) -> dict[str, Any]:
    """A config file's tree. OSError when unreadable; ConfigError when not a YAML mapping."""
    try:
        tree = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"not YAML: {' '.join(str(error).split())}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"expected a mapping of sections (model, engine, ...), got "
                          f"{type(tree).__name__}")
    return tree


def _normalised(layer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``layer`` with section and key names in field spelling (snake_case); an unknown
    section or key is a ConfigError naming it."""
    sections = _names(ServeConfig)
    tree: dict[str, dict[str, Any]] = {}
    for section_key, values in layer.items():
        section = sections.get(section_key)
        if section is None:
            raise ConfigError(f"{section_key}: unknown section (sections: "
                              f"{', '.join(sorted(_wire(ServeConfig)))})")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{section_key}: expected a mapping of settings, got "
                              f"{type(values).__name__}")
        section_type = ServeConfig.model_fields[section].annotation
        assert isinstance(section_type, type) and issubclass(section_type, BaseModel)
        keys = _names(section_type)
        for key, value in values.items():
            if key not in keys:
                raise ConfigError(f"{section_key}.{key}: unknown key (keys: "
                                  f"{', '.join(sorted(_wire(section_type)))})")
            tree.setdefault(section, {})[keys[key]] = value
    return tree


def _names(model: type[BaseModel]) -> dict[str, str]:
    """Every accepted spelling of ``model``'s fields -> the field name."""
    names = {}
    for name, field in model.model_fields.items():
        names[name] = name
        names[field.alias or name] = name
    return names


def _wire(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


def _validate(tree: dict[str, Any]) -> ServeConfig:
    try:
        return ServeConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(_one_line(error)) from None


def _one_line(error: ValidationError) -> str:
    first = error.errors()[0]
    message = str(first["msg"]).removeprefix("Value error, ")
    loc = [str(part) for part in first["loc"]]
    if len(loc) >= 2 and loc[0] in ServeConfig.model_fields:
        section_type = ServeConfig.model_fields[loc[0]].annotation
        assert isinstance(section_type, type) and issubclass(section_type, BaseModel)
        field = section_type.model_fields.get(loc[1])
        if field is not None:
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            switches = extra.get("switches")
            flag = ", ".join(switches) if isinstance(switches, dict) else field_flag(loc[1], extra)
            wire = [ServeConfig.model_fields[loc[0]].alias or loc[0], field.alias or loc[1]]
            where = ".".join(wire + loc[2:])
            value = f", got {first['input']!r}" if first["type"] != "value_error" else ""
            return f"{where} ({flag}): {message}{value}"
    where = ".".join(to_camel(part) for part in loc)
    return f"{where}: {message}" if where else message
