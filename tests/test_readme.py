"""README.md stays true: every service setting is documented with its environment variable."""

from pathlib import Path

from drafter_service.settings import ENV_PREFIX as DRAFTER_ENV
from drafter_service.settings import DrafterSettings
from gateway_service.settings import ENV_PREFIX as GATEWAY_ENV
from gateway_service.settings import GatewaySettings
from shared.settings import help_rows
from verifier_service.settings import ENV_PREFIX as VERIFIER_ENV
from verifier_service.settings import VerifierSettings

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_setting_is_in_the_configuration_table():
    for cls, prefix in ((VerifierSettings, VERIFIER_ENV), (DrafterSettings, DRAFTER_ENV), (GatewaySettings, GATEWAY_ENV)):
        for flag, env, _, _ in help_rows(cls, prefix):
            assert f"| `{flag}` | `{env}` |" in README, flag


def test_the_two_commands_are_documented():
    assert "scripts/demo" in README and "scripts/test" in README
