"""The dry run's call 1 as on the device, where the bundle is not unpacked yet: run a script with
every package the bundle brings unimportable, so a call-1 section that needs one fails on this CPU
rather than on the lent machine. transformers is blocked too, though the image has 5.17: CI tests
5.24, so a call-1 section must not need it.

    python scripts/gpu_lease/image_only.py SITE SCRIPT [ARGS...]   # SITE: .gpu_bundle/site
"""

from __future__ import annotations

import importlib.abc
import runpy
import sys
from pathlib import Path

SKIP = (".dist-info", ".libs", "__pycache__")


def bundled_modules(site: Path) -> set[str]:
    """The importable names the site tree adds: its top-level packages and modules, the subpackages
    of a namespace package (google.rpc, not the image's google.protobuf), and what a .pth adds
    (the CuTe DSL's cutlass)."""
    names = set()
    for root in (site, *site.glob("*/dsl_packages")):
        for entry in root.iterdir():
            if entry.name.endswith(SKIP) or entry.suffix == ".pth" or entry.name == "dsl_packages":
                continue
            name = entry.name.split(".")[0]
            if entry.is_dir() and not (entry / "__init__.py").exists() and root == site:   # a namespace
                names.update(f"{name}.{sub.name.split('.')[0]}" for sub in entry.iterdir()
                             if not sub.name.endswith(SKIP))
            else:
                names.add(name)
    return names


class Blocked(importlib.abc.MetaPathFinder):
    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if any(".".join(parts[:i]) in self.names for i in range(1, len(parts) + 1)):
            raise ModuleNotFoundError(f"{fullname} comes with the bundle, which lease call 1 does not have yet",
                                      name=fullname)
        return None


def main() -> None:
    site, script, *args = sys.argv[1:]
    sys.meta_path.insert(0, Blocked(bundled_modules(Path(site))))
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
