"""What every setting of the serve config carries next to its type and default: its help, its
command-line flag and how the flag spells its value. ``slipstream serve --help`` is generated
from these (server/cli_flags.py), so the text lives in one place.

    class SchedulerSettings(Section):
        max_num_seqs: int = setting(256, "most requests running at once", ge=1)

A section's file keys are the field names in camelCase (``maxNumSeqs``), as in the CRD; the
snake_case name is accepted too. Its flag is ``--`` plus the field name with dashes, unless
``flag=`` names another (the flags predate the file).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class Section(BaseModel):
    """One section of the serve config: frozen, unknown keys refused, camelCase on the wire."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True,
                              extra="forbid")


def setting(default: Any, help: str, *, flag: str | None = None, metavar: str | None = None,
            switches: dict[str, Any] | None = None, **constraints: Any) -> Any:
    """A field of a section. ``flag``: its command-line spelling (default: from its name).
    ``switches``: flags that set the field to a fixed value (``{"--no-profile": False}``) in
    place of one flag taking a value. ``constraints``: pydantic's (``ge=1``, ``gt=0``)."""
    extra: dict[str, Any] = {}
    if flag is not None:
        extra["flag"] = flag
    if metavar is not None:
        extra["metavar"] = metavar
    if switches is not None:
        extra["switches"] = switches
    return Field(default, description=help, json_schema_extra=extra or None, **constraints)


def field_flag(name: str, extra: dict[str, Any] | None) -> str:
    """The command-line flag of field ``name`` (its ``flag=``, else ``--the-name``)."""
    return str((extra or {}).get("flag") or "--" + name.replace("_", "-"))
