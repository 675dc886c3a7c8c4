"""Configuration modules that import alone, each in a fresh interpreter (kvoffload.config, the tier
registry, validation). The parsing itself, bad configuration failing at start with a message naming
the key (CASES C21), is tested in process: tests/unit/test_config.py."""


def test_config_and_tier_registry_import_alone():
    import subprocess
    import sys

    for module in ("kvoffload.config", "kvoffload.tiers.registry", "kvoffload.validation"):
        out = subprocess.run(
            [sys.executable, "-c", f"import {module}"], capture_output=True, text=True
        )
        assert out.returncode == 0, (module, out.stderr)
