"""``--variant`` of the autoscaling study: a few ``spec.autoscaling`` settings changed, parsed
and checked as the CRD names them, and the label of the fleet that runs them."""

from __future__ import annotations

import json

from pydantic.alias_generators import to_camel

from slipstream.bench.autoscale_report import AUTOSCALED
from slipstream.crds.autoscaling import Autoscaling, AutoscalingTargets

_AUTOSCALING_NAMES = {to_camel(name) for name in Autoscaling.model_fields} - {"targets"}
_TARGET_NAMES = {to_camel(name) for name in AutoscalingTargets.model_fields}
# What a variant may change: the bounds are the study's (--min/--max-instances), and a
# variant with the autoscaler off would be a static fleet of --min-instances.
_VARIANT_NAMES = _AUTOSCALING_NAMES - {"minInstances", "maxInstances", "enabled"}


def parse_variant(text: str) -> dict:
    """``--variant`` settings, ``name=value[,name=value...]``, as a ``spec.autoscaling``
    overlay. Names are the CRD's (camelCase); a target may be written bare (``prefillLoad``)
    or as ``targets.prefillLoad``. Raises ValueError naming what is wrong."""
    overlay: dict = {}
    for part in text.split(","):
        name, sep, raw = part.strip().partition("=")
        name = name.strip()
        if not sep or not name or not raw.strip():
            raise ValueError(f"{part.strip()!r} is not name=value")
        try:
            value = json.loads(raw.strip())
        except json.JSONDecodeError:
            raise ValueError(f"{name}: {raw.strip()!r} is not a number or a boolean") from None
        bare = name.removeprefix("targets.")
        if bare not in _TARGET_NAMES and name not in _VARIANT_NAMES:
            raise ValueError(
                f"{name!r} is not a spec.autoscaling setting a variant may change; known: "
                f"{', '.join(sorted(_VARIANT_NAMES))} and the targets "
                f"{', '.join(sorted(_TARGET_NAMES))} (--min-instances and --max-instances "
                "apply to every autoscaled fleet)")
        # The CRD's CEL rules are the API server's to check; these are the ones a study
        # could trip over without an error (pydantic checks the types).
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name}: {raw.strip()!r} must be a number >= 0")
        if bare in _TARGET_NAMES:
            if value == 0:
                raise ValueError(f"{name}: a target must be above 0")
            overlay.setdefault("targets", {})[bare] = value
        else:
            overlay[name] = value
    return overlay


def variant_label(overlay: dict) -> str:
    """The fleet's label: ``autoscaled`` and the settings it changes, say
    ``autoscaled prefillLoad=0.75``."""
    settings = {**{k: v for k, v in overlay.items() if k != "targets"},
                **overlay.get("targets", {})}
    return " ".join([AUTOSCALED] + [f"{k}={v}" for k, v in sorted(settings.items())])
