"""The base of every ServingReplica API model: snake_case in Python, camelCase on the wire.

Models are frozen and reject unknown fields; ``to_api`` gives the wire form, as stored by
the API server and as ``kubectl get sr -o yaml`` shows it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True,
                              extra="forbid")

    def to_api(self) -> dict[str, Any]:
        """The wire form: camelCase keys, unset optionals left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
