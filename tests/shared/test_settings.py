"""Service settings: defaults < environment < flags, validated with messages naming the setting."""

import argparse

import pytest

from drafter_service import settings as drafter_settings
from verifier_service import settings as verifier_settings


def parse(module, argv, environ):
    parser = module.add_arguments(argparse.ArgumentParser())
    return module.from_args(parser.parse_args(argv), environ)


def test_flags_beat_environment_beat_defaults():
    s = parse(verifier_settings, ["--port", "7001"], {"TANDEM_VERIFIER_PORT": "7000", "TANDEM_VERIFIER_MAX_SESSIONS": "3"})
    assert (s.port, s.max_sessions, s.host) == (7001, 3, "127.0.0.1")
    d = parse(drafter_settings, [], {"TANDEM_DRAFTER_PLANNER": "mtp"})
    assert d.planner == "mtp" and d.port == 50052


def test_booleans_from_environment_and_flags():
    assert parse(verifier_settings, [], {"TANDEM_VERIFIER_RANDOM_WEIGHTS": "true"}).random_weights is True
    assert parse(verifier_settings, ["--no-random-weights"], {"TANDEM_VERIFIER_RANDOM_WEIGHTS": "yes"}).random_weights is False
    with pytest.raises(ValueError, match="TANDEM_VERIFIER_RANDOM_WEIGHTS = 'maybe' is not a boolean"):
        parse(verifier_settings, [], {"TANDEM_VERIFIER_RANDOM_WEIGHTS": "maybe"})


def test_none_unsets_an_optional_setting_as_help_shows_its_default():
    # --help shows an optional setting's default as "none": the same word sets it back there,
    # from a flag over the environment; a setting that is a plain string keeps "none" as a value.
    environ = {"TANDEM_VERIFIER_DRAFTER": "127.0.0.1:50052"}
    assert parse(verifier_settings, [], environ).drafter == "127.0.0.1:50052"
    assert parse(verifier_settings, ["--drafter", "none"], environ).drafter is None
    assert parse(verifier_settings, [], {"TANDEM_VERIFIER_DRAFTER": "None"}).drafter is None
    assert parse(verifier_settings, ["--probabilistic-drafters", "none"], {}).probabilistic_drafters == "none"


@pytest.mark.parametrize(
    "argv,environ,message",
    [
        (["--port", "abc"], {}, "--port = 'abc' is not a valid int"),
        ([], {"TANDEM_VERIFIER_MAX_SESSIONS": "0"}, "max_sessions 0 must be >= 1"),
        (["--dtype", "int8"], {}, "dtype 'int8' must be one of"),
        (["--max-draft-tokens", "20"], {}, "max_draft_tokens 20 must lie in [0, max_draft_tokens_limit = 16]"),
        (["--tls-cert", "c.pem"], {}, "tls_cert and tls_key must be given together"),
        (["--drafter-deadline-ms", "nan"], {}, "drafter_deadline_ms nan must be finite"),
        (["--drafter-socket", "/tmp/d.sock"], {}, "drafter_socket needs drafter too"),
        (["--drafter", "127.0.0.1:1", "--drafter-socket", ""], {}, "drafter_socket must not be empty"),
    ],
)
def test_bad_verifier_settings_are_named(argv, environ, message):
    with pytest.raises(ValueError) as error:
        parse(verifier_settings, argv, environ)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "argv,message",
    [(["--planner", "random"], "planner 'random' must be adaptive, mtp or suffix"),
     (["--moce-scale", "-1"], "moce_scale -1.0 must be finite and > 0"),
     (["--device", "tpu"], "device 'tpu' must be cpu, cuda or cuda:N"),
     (["--local-socket", ""], "local_socket must not be empty")],
)
def test_bad_drafter_settings_are_named(argv, message):
    with pytest.raises(ValueError) as error:
        parse(drafter_settings, argv, {})
    assert message in str(error.value)


def test_cli_refuses_to_start_with_a_bad_setting(capsys):
    from shared.cli import main

    assert main(["verifier", "--max-sessions", "0"]) == 2
    assert "max_sessions 0 must be >= 1" in capsys.readouterr().err


def test_the_drafters_moce_scale_follows_its_slot_budget_by_default():
    from drafter_service.settings import DrafterSettings

    assert DrafterSettings().moce_base_scale(16) == 1.0  # every expert resident: plain routing
    assert DrafterSettings(expert_slots=4).moce_base_scale(16) == 3.0  # 25%
    assert DrafterSettings(expert_slots=8).moce_base_scale(16) == 2.0  # 50%
    assert DrafterSettings(expert_slots=16).moce_base_scale(16) == 1.0
    assert DrafterSettings(expert_slots=4, moce_scale=1.5).moce_base_scale(16) == 1.5  # as set


@pytest.mark.parametrize("address", ["127.0.0.1:50052", "drafter:50052", "[::1]:50052", "dns:///tandem-drafter:50052",
                                     "dns://10.0.0.1/drafters.internal:1", "ipv4:10.0.0.5:50052,10.0.0.6:50052",
                                     "ipv6:[::1]:5,[::2]:6", "unix:/tmp/drafter.sock"])
def test_addresses_grpc_resolves_are_accepted(address):
    from gateway_service.settings import GatewaySettings

    assert verifier_settings.VerifierSettings(drafter=address).drafter == address
    assert GatewaySettings(verifier=address).verifier == address


@pytest.mark.parametrize("address, shown", [
    ("localhost", "'localhost' where host:port"),  # gRPC would dial port 443
    ("127.0.0.1:99999", "'127.0.0.1:99999' where host:port"),  # gRPC wraps it to another port
    ("http://verifier:1", "is not a gRPC target"),
    ("dns:///drafters.internal", "'drafters.internal' where host:port"),
    ("ipv4:10.0.0.5:50052,10.0.0.6", "'10.0.0.6' where host:port"),
    ("unix:", "names no socket path"),
])
def test_addresses_are_checked_at_start(address, shown):
    from gateway_service.settings import GatewaySettings

    with pytest.raises(ValueError, match=f"drafter {address!r} .*{shown}".replace("[", r"\[").replace("?", r"\?")):
        verifier_settings.VerifierSettings(drafter=address)
    with pytest.raises(ValueError, match="verifier "):
        GatewaySettings(verifier=address)
