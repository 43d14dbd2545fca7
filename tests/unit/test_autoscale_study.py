"""The autoscaling study's ``--variant``: more autoscaled fleets with changed
``spec.autoscaling`` settings, run beside the default one on the same arrivals."""

from __future__ import annotations

import argparse
import json

import pytest

from slipstream.bench import autoscale_study as study


def args(**changes) -> argparse.Namespace:
    values = {"min_instances": 1, "max_instances": 8, "scale_down_window_s": 60,
              "tpot_slo_ms": 100.0}
    return argparse.Namespace(**{**values, **changes})


def test_a_variant_names_targets_bare_or_under_targets_and_other_settings_as_the_crd():
    assert study.parse_variant("prefillLoad=0.75") == {"targets": {"prefillLoad": 0.75}}
    assert study.parse_variant("targets.prefillLoad=0.8, tolerance=0.05,forecastSeconds=0") == {
        "targets": {"prefillLoad": 0.8}, "tolerance": 0.05, "forecastSeconds": 0}
    assert study.variant_label(study.parse_variant("tolerance=0.05,prefillLoad=0.75")) == \
        "autoscaled prefillLoad=0.75 tolerance=0.05"


@pytest.mark.parametrize("text, says", [
    ("prefillLoad", "is not name=value"),
    ("prefillLoad=", "is not name=value"),
    ("prefillLoad=high", "is not a number"),
    ("prefillLoad=-0.1", "must be a number >= 0"),
    ("prefillLoad=0", "a target must be above 0"),
    ("tolerance=true", "must be a number >= 0"),
    ("prefilLoad=0.7", "'prefilLoad' is not a spec.autoscaling setting"),
    ("maxInstances=3", "--min-instances and --max-instances"),
    ("enabled=0", "is not a spec.autoscaling setting"),
])
def test_a_bad_variant_is_refused_with_what_is_wrong(text, says):
    with pytest.raises(ValueError, match=says):
        study.parse_variant(text)


def test_a_variant_changes_only_its_settings_and_keeps_the_studys():
    base = study.autoscaled_spec(args()).autoscaling
    varied = study.autoscaled_spec(args(), study.parse_variant("prefillLoad=0.75,maxStep=1")
                                   ).autoscaling
    assert base is not None and varied is not None
    assert base.targets.prefill_load == 0.67  # the CRD's default
    assert varied.targets.prefill_load == 0.75 and varied.max_step == 1
    # The study's bounds and scale-down window, and every other target, stay as they were.
    assert varied.scale_down_stabilization_seconds == base.scale_down_stabilization_seconds == 60
    assert (varied.min_instances, varied.max_instances) == (1, 8)
    assert varied.targets.model_copy(update={"prefill_load": 0.67}) == base.targets
    assert study.autoscaling_settings(args(), {"targets": {"prefillLoad": 0.75}}
                                      )["targets"]["prefillLoad"] == 0.75


@pytest.mark.parametrize("variant, says", [
    ("prefillLoad=-1", "must be a number >= 0"),
    ("periodSeconds=1.5", "periodSeconds"),
])
def test_the_command_refuses_a_bad_variant_before_it_simulates(variant, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        study.main(["--out", str(tmp_path), "--variant", variant])
    assert stopped.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "autoscale_study.json").exists()


def test_a_variant_runs_as_one_more_autoscaled_fleet_on_the_same_arrivals(tmp_path):
    # The whole study on a tiny step (the real H100 tables and trace, a few hundred requests):
    # the variant is a row of its own, beside the default autoscaled fleet and the static
    # ones, with its settings in the JSON.
    study.main(["--out", str(tmp_path), "--only", "step", "--step-s", "40",
                "--step-low-qps", "1", "--step-high-qps", "3", "--sizing-s", "10",
                "--warmup-s", "0", "--variant", "prefillLoad=0.9,tolerance=0.05"])
    written = json.loads((tmp_path / "autoscale_study.json").read_text())
    label = "autoscaled prefillLoad=0.9 tolerance=0.05"
    fleets = written["results"]["step"]
    assert list(fleets) == ["static-peak", "static-mean", "autoscaled", label]
    assert fleets["autoscaled"]["autoscaling"]["targets"]["prefillLoad"] == 0.67
    assert fleets[label]["autoscaling"]["targets"]["prefillLoad"] == 0.9
    assert fleets[label]["autoscaling"]["tolerance"] == 0.05
    assert written["variants"][label]["targets"]["prefillLoad"] == 0.9
    assert written["autoscaling"]["targets"]["prefillLoad"] == 0.67
    assert fleets[label]["requests"] == fleets["autoscaled"]["requests"] > 0
    tables = (tmp_path / "autoscale_study_tables.md").read_text()
    assert f"| {label} |" in tables and "| autoscaled |" in tables
    assert (tmp_path / "autoscale_study.png").stat().st_size > 0
