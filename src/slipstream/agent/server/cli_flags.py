"""The flags of ``slipstream serve``, generated from the serve config's fields
(agent/config): one group per section, each flag with the field's help, default, choices and
file key. What a parsed command line turns into is a ``ServeConfig``; the argparse Namespace
goes no further than this module and ``cli``.

    argv --argparse--> Namespace (only the flags given)
         --serve_config_from_args()--> defaults < environment < --config FILE < flags
"""

from __future__ import annotations

import argparse
import os
import textwrap
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from slipstream.agent.config.serve_config import ConfigError, ServeConfig, read_file
from slipstream.agent.config.setting import field_flag
from slipstream.agent.server.serve_configs import environment_layer

EXAMPLES = """\
examples:
  slipstream serve --model ~/models/Meta-Llama-3-8B-Instruct --device cuda
  slipstream serve --model tiny --max-num-seqs 64 --print-config > serve.yaml
  slipstream serve --config serve.yaml --port 9000     # the file, with one flag on top

Every flag is also a key of the config file (shown after each flag as "file: section.key");
precedence: defaults < $POD_IP, $SLIPSTREAM_POOL, $SLIPSTREAM_ROLE < --config FILE < flags.
Times are in the unit their name says (_s, _ms); sizes take a unit (512MiB, 4GiB).
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' lines; wraps each flag's help."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _HelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="YAML config file: the sections below, keys in camelCase as "
                             "--print-config writes them (the operator mounts one built from "
                             "the ServingReplica). Flags given here override it")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (defaults, environment, --config and "
                             "flags) as YAML and exit; --config reads it back")
    for section, section_field in ServeConfig.model_fields.items():
        section_type = _model(section_field)
        wire = section_field.alias or section
        group = parser.add_argument_group(
            f"{wire} (file section '{wire}')",
            textwrap.fill(" ".join((section_type.__doc__ or "").split()), width=86))
        for name, field in section_type.model_fields.items():
            _add_flag(group, f"{section}.{name}", f"{wire}.{field.alias or name}", name, field)


def serve_config_from_args(args: argparse.Namespace,
                           environ: Mapping[str, str] | None = None) -> ServeConfig:
    """The config a parsed command line asks for. ConfigError: an unreadable --config, or a
    setting that does not validate (one line naming it and its flag)."""
    try:
        file_layer = read_file(args.config) if args.config is not None else {}
    except (ConfigError, OSError) as error:
        raise ConfigError(f"--config {args.config}: {error}") from None
    flag_layer: dict[str, dict[str, Any]] = {}
    for dest, value in vars(args).items():
        section, dot, key = dest.partition(".")
        if dot:
            flag_layer.setdefault(section, {})[key] = value
    return ServeConfig.from_layers(environment_layer(os.environ if environ is None else environ),
                                   file_layer, flag_layer)


def parse_serve_config(argv: list[str], environ: Mapping[str, str] | None = None
                       ) -> ServeConfig:
    """``slipstream serve ARGV``'s config (tests and tools; argparse errors exit 2)."""
    parser = argparse.ArgumentParser(prog="slipstream serve", allow_abbrev=False)
    add_arguments(parser)
    return serve_config_from_args(parser.parse_args(argv), {} if environ is None else environ)


def _add_flag(group: argparse._ArgumentGroup, dest: str, wire: str, name: str,
              field: FieldInfo) -> None:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    help_text = field.description or ""
    value_type = _unwrap_optional(field.annotation)
    switches = extra.get("switches")
    if isinstance(switches, dict):
        first_value = next(iter(switches.values()))
        for index, (flag, value) in enumerate(switches.items()):
            if index == 0:
                text = f"{help_text} (file: {wire}: {_yaml(value)})"
            elif value == first_value:
                text = f"the same as {next(iter(switches))}"
            else:
                text = f"file: {wire}: {_yaml(value)}" + (
                    " (the default)" if value == field.default else "")
            group.add_argument(flag, dest=dest, action="store_const", const=value,
                               default=argparse.SUPPRESS, help=text)
        return
    flag = field_flag(name, extra)
    default = "" if field.default is None else f"default: {_yaml(field.default)}; "
    text = f"{help_text} ({default}file: {wire})".lstrip()
    kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": text}
    kwargs["metavar"] = extra.get("metavar") or name.upper()
    if value_type is bool:
        del kwargs["metavar"]
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        return
    if typing.get_origin(value_type) is typing.Literal:
        choices = typing.get_args(value_type)
        kwargs |= {"choices": choices, "type": type(choices[0]),
                   "metavar": "{" + ",".join(str(c) for c in choices) + "}"}
    elif typing.get_origin(value_type) is tuple:
        kwargs["type"] = _positive_int_list
    else:
        kwargs["type"] = value_type
    group.add_argument(flag, **kwargs)


def _model(field: FieldInfo) -> type[BaseModel]:
    annotation = field.annotation
    assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _positive_int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
