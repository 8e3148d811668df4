"""docs/configuration.md must list every flag and environment variable the server accepts."""

from pathlib import Path

from mmserve.config import EngineConfig, ServerConfig, env_names, flag_names

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_every_option_is_documented():
    text = DOC.read_text()
    missing = [name for cls in (EngineConfig, ServerConfig)
               for name in flag_names(cls) + env_names(cls) if f"`{name}`" not in text]
    assert not missing, f"undocumented options (add them to {DOC.name}): {missing}"
