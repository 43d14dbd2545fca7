"""``slipstream router`` argument handling: backends, discovery and refusals."""

from __future__ import annotations

import argparse

import pytest

from slipstream.agent.router import cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_static_backends_carry_their_pool(monkeypatch):
    monkeypatch.delenv("POD_IP", raising=False)
    config = cli.config_from_args(parse("--backend", "http://127.0.0.1:8001/=short",
                                        "--backend", "http://127.0.0.1:8002=long",
                                        "--long-prefill-threshold-tokens", "1000"))
    assert [(b.url, b.pool) for b in config.static_backends] == [
        ("http://127.0.0.1:8001", "short"), ("http://127.0.0.1:8002", "long")]
    assert config.kubernetes is None and config.long_prefill_threshold_tokens == 1000
    assert config.host == "127.0.0.1"


def test_pod_discovery_takes_the_namespace_from_the_downward_api(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "serving")
    config = cli.config_from_args(parse("--selector", "slipstream.dev/replica=chat"))
    assert config.kubernetes.namespace == "serving"
    assert config.kubernetes.label_selector == "slipstream.dev/replica=chat"


@pytest.mark.parametrize("argv, message", [
    ((), "no backends"),
    (("--backend", "http://127.0.0.1:1=medium"), "pool must be one of"),
    (("--backend", "127.0.0.1:1=short"), "must start with http"),
    (("--backend", "http://127.0.0.1:1=short", "--namespace", "x"), "not both"),
])
def test_bad_arguments_are_refused_with_a_reason(monkeypatch, argv, message):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    with pytest.raises(ValueError, match=message):
        cli.config_from_args(parse(*argv))


def test_run_exits_2_without_backends(monkeypatch, caplog):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    assert cli.run(parse()) == 2
    assert "no backends" in caplog.text


def test_serve_help_names_router_flags_that_exist(capsys):
    """Issue 30: `slipstream serve --help` named `slipstream router --prefill/--decode`,
    which do not exist. Every `slipstream router --flag` it names must be a router flag."""
    import re

    from slipstream.cli import parse_subcommand

    with pytest.raises(SystemExit):
        parse_subcommand(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    named = re.findall(r"slipstream router[^)]*?(--[a-z-]+)", text)
    assert named, "the help should say how the router chains prefill and decode"
    router_parser = argparse.ArgumentParser()
    cli.add_arguments(router_parser)
    flags = {option for action in router_parser._actions for option in action.option_strings}
    assert set(named) <= flags
    assert "--prefill/--decode" not in text


@pytest.mark.parametrize("argv", [["router", "--decode", "7", "--backend", "http://a:1=short"],
                                  ["serve", "--kv-hold", "5"]])
def test_abbreviated_flags_are_refused_not_guessed(argv, capsys):
    """`--decode 7` used to be read as `--decode-weight-tokens 7` without a word."""
    from slipstream.cli import parse_subcommand

    with pytest.raises(SystemExit) as exit_info:
        parse_subcommand(argv)
    assert exit_info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
