"""docs/configuration.md must list every flag and environment variable the server accepts."""

import argparse
import os
import re
from pathlib import Path

from mmserve.config import (
    DEMO_MODEL_DIR,
    EngineConfig,
    ServerConfig,
    add_dataclass_args,
    env_names,
    flag_names,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
# A table row: | `--flag` (/ `--no-flag`) | `MMSERVE_VAR` | default | meaning |
ROW = re.compile(r"^\| `(--[a-z0-9-]+)`(?: / `--no-[a-z0-9-]+`)? \| `(MMSERVE_[A-Z0-9_]+)` \| ([^|]*) \|", re.MULTILINE)


def test_every_option_is_documented():
    text = DOC.read_text()
    missing = [name for cls in (EngineConfig, ServerConfig)
               for name in flag_names(cls) + env_names(cls) if f"`{name}`" not in text]
    assert not missing, f"undocumented options (add them to {DOC.name}): {missing}"


def _shows(value: object, documented: str) -> bool:
    """Whether a row's default column (its first word; "empty" for an empty string) is `value`."""
    first = documented.split()[0] if documented.split() else ""
    if isinstance(value, bool):
        return first.lower() == str(value).lower()
    if isinstance(value, int | float):
        try:
            return float(first) == value
        except ValueError:
            return False
    if value == str(DEMO_MODEL_DIR):
        return "demo model" in documented
    return "empty" in documented if value == "" else first == value


def test_each_row_has_the_flags_variable_and_default(monkeypatch):
    """The table drifted from the code unseen: a default changed in one of them only."""
    for name in [name for name in os.environ if name.startswith("MMSERVE_")]:
        monkeypatch.delenv(name)   # the defaults of the code, not of this shell
    rows = {flag: (env, default.strip()) for flag, env, default in ROW.findall(DOC.read_text())}
    parser = argparse.ArgumentParser()
    for cls in (EngineConfig, ServerConfig):
        add_dataclass_args(parser, cls)
    code = {"--" + name.replace("_", "-"): ("MMSERVE_" + name.upper(), value)
            for name, value in vars(parser.parse_args([])).items()}
    assert rows.keys() == code.keys(), f"only in {DOC.name}: {rows.keys() - code.keys()}; only in the code: " \
                                       f"{code.keys() - rows.keys()}"
    wrong = [f"{flag}: {rows[flag]} in {DOC.name}, {code[flag]} in the code" for flag in code
             if rows[flag][0] != code[flag][0] or not _shows(code[flag][1], rows[flag][1])]
    assert not wrong, wrong
