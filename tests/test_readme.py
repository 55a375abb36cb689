"""README.md and docs/CONFIGURATION.md stay true: every service setting is in the reference
exactly as its help text says, and the README's table agrees with the settings it shows."""

import re
from pathlib import Path

from drafter_service.settings import ENV_PREFIX as DRAFTER_ENV
from drafter_service.settings import DrafterSettings
from gateway_service.settings import ENV_PREFIX as GATEWAY_ENV
from gateway_service.settings import GatewaySettings
from shared.settings import help_rows
from verifier_service.settings import ENV_PREFIX as VERIFIER_ENV
from verifier_service.settings import VerifierSettings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "CONFIGURATION.md").read_text()
SETTINGS = ((VerifierSettings, VERIFIER_ENV), (DrafterSettings, DRAFTER_ENV), (GatewaySettings, GATEWAY_ENV))
ROW = re.compile(r"^\| `(--[a-z0-9-]+)` \| `([A-Z0-9_]+)` \| ([^|]*) \|", re.MULTILINE)


def rows() -> dict[str, tuple[str, str, str]]:
    """env var -> (flag, default, help), every service's settings."""
    return {env: (flag, default, meaning) for cls, prefix in SETTINGS for flag, env, default, meaning in help_rows(cls, prefix)}


def test_every_setting_is_in_the_reference_as_its_help_says():
    for env, (flag, default, meaning) in rows().items():
        assert f"| `{flag}` | `{env}` | {default} | {meaning} |" in REFERENCE, f"{flag}: run scripts/config_tables"


def test_no_table_names_a_setting_that_does_not_exist():
    known = rows()
    for name, text in (("docs/CONFIGURATION.md", REFERENCE), ("README.md", README)):
        found = ROW.findall(text)
        assert found, name
        for flag, env, default in found:
            assert env in known, f"{name}: {env}"
            assert (flag, default.strip()) == known[env][:2], f"{name}: {flag}"


def test_the_readme_shows_the_main_settings_and_points_to_the_rest():
    shown = {env for _, env, _ in ROW.findall(README)}
    for env in ("TANDEM_VERIFIER_MODEL", "TANDEM_VERIFIER_DRAFTER", "TANDEM_VERIFIER_DEVICE", "TANDEM_VERIFIER_PORT"):
        assert env in shown
    assert "docs/CONFIGURATION.md" in README


def test_the_two_commands_are_documented():
    assert "scripts/demo" in README and "scripts/test" in README
