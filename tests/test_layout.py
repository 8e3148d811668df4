"""The package layout says which process runs a file (docs/architecture.md, "Layout"), and src/ holds
no code that only tests use. Both are checked here, so a move or an import that breaks them fails."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "mmserve"

# What the server process (the front end) must never import: the engine-core process's code, the
# worker's, tensor parallelism's, sampling, drafting, the grammar matchers, the model's heavy parts.
ENGINE_SIDE = ("mmserve.core", "mmserve.worker", "mmserve.executor", "mmserve.sample", "mmserve.spec_decode",
               "mmserve.structured_output.manager", "mmserve.model.decoder", "mmserve.model.loader",
               "mmserve.model.vision", "mmserve.model.assistant")
FRONT_END = ("server", "engine", "clients", "ipc")
# Libraries the front end loads at first use, not at start (docs/benchmarks.md, "Start-up imports"):
# xgrammar at the first grammar; transformers never for the demo model and its drafter (their specs
# are read from config.json, model/config_json.py), only for an audio model's feature extractor.
FIRST_USE = ("xgrammar", "transformers")
# What the front end does with the model as it starts (`make run`'s: the demo model and its drafter),
# short of the engine process: the observer's specs, the engine and server objects, the input
# processor (tokenizer, spec) it builds at READY.
START_UP = """
from concurrent.futures import ThreadPoolExecutor
from mmserve.config import DEMO_ASSISTANT_DIR, DEMO_MODEL_DIR, EngineConfig, ServerConfig
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.input.processor import InputProcessor
from mmserve.model.spec import load_spec_without_transformers
from mmserve.server.app import build_server
from mmserve.server.observability import setup_observability
config = EngineConfig(model=str(DEMO_MODEL_DIR), speculative_model=str(DEMO_ASSISTANT_DIR), device="cpu")
server_config = ServerConfig(port=0)
spec = load_spec_without_transformers(config.model)
observability = setup_observability(config, server_config, spec=spec, configure_global_tracing=False)
build_server(AsyncEngine(config, observer=observability.observer), server_config, config, spec=spec,
             metrics=observability.metrics)
InputProcessor.from_checkpoint(config, ThreadPoolExecutor(1), spec=spec, context_length=1024)
"""
# The offline API runs the engine core in the caller's process by design (vLLM's LLM does too).
BOTH_IN_ONE = {"mmserve.engine.llm"}

# Entry points that nothing inside the package imports: the `mmserve` command (pyproject's
# [project.scripts]), `make proto` (python -m mmserve.protogen), the stubs' packages.
ENTRY_POINTS = {"mmserve.cli", "mmserve.protogen", "mmserve.api.mmserve", "mmserve.api.mmserve.v1",
                "mmserve.__init__"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_front_end_module_imports_engine_side_code():
    """Import every front-end module in a fresh interpreter, one at a time, and name any that pulls
    in the engine core's, the worker's or the model's heavy code, or a library it loads at first use;
    then start the front end's side of a server on the demo model and name a first-use library it loaded."""
    modules = sorted(_module_name(p) for p in SRC.rglob("*.py")
                     if p.relative_to(SRC).parts[0] in FRONT_END and _module_name(p) not in BOTH_IN_ONE)
    probe = (
        "import importlib, sys\n"
        f"side = {ENGINE_SIDE!r}\n"
        f"for name in {modules!r}:\n"
        "    before = set(sys.modules)\n"
        "    importlib.import_module(name)\n"
        "    pulled = sorted(m for m in set(sys.modules) - before if any(m == s or m.startswith(s + '.') for s in side))\n"
        "    if pulled:\n"
        "        print(name, '->', pulled[:3])\n"
        f"print(*(f'{{m}} loaded at import' for m in {FIRST_USE!r} if m in sys.modules))\n"
        f"{START_UP}\n"
        f"print(*(f'{{m}} loaded at start-up' for m in {FIRST_USE!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(modules) > 30 and "mmserve.server.app" in modules and "mmserve.engine.async_engine" in modules
    assert done.stdout.strip() == "", f"front-end modules import engine-side code or a first-use library:\n{done.stdout}"


def _imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names; `from a import b` counts a and a.b), and the
    dotted names in its strings (registries that import by name: attention backends, subcommands)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("mmserve."):
            out.add(node.value)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_every_module_in_src_serves_the_package():
    """A module that nothing in src/ imports (and that is no entry point) exists only for tests or
    benchmarks: analysis code belongs in bench/, test helpers in tests/."""
    files = list(SRC.rglob("*.py"))
    used = set().union(*(_imports(p) for p in files))
    # a package counts as used when any of its modules is imported
    used |= {name.rsplit(".", i)[0] for name in used for i in range(1, name.count(".") + 1)}
    unused = sorted(name for p in files
                    if (name := _module_name(p)) not in used and name not in ENTRY_POINTS
                    and not name.startswith("mmserve.api.") and name != "mmserve")
    assert not unused, f"modules no part of the package imports: {unused}"


def test_the_layout_places_every_package_top_level_module_and_subcommand():
    """docs/architecture.md's Layout is the map a newcomer reads first: every package of src/mmserve
    (as `name/`), every module at its top (as `name.py`) and every `mmserve` subcommand (as
    `mmserve NAME`) must be on it. The files inside a package are placed by what they do, often not
    by name (a third of them), so they are not checked: requiring each name would bloat the map."""
    from mmserve.cli import SUBCOMMANDS

    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    layout = text.split("## Layout", 1)[1].split("```")[1]
    packages = {p.parent.name + "/" for p in SRC.rglob("__init__.py")
                if p.parent != SRC and p.relative_to(SRC).parts[0] != "api"}   # api/: generated stubs
    modules = {p.name for p in SRC.glob("*.py") if p.name != "__init__.py"}
    commands = {f"`mmserve {name}`" for name in SUBCOMMANDS}
    assert len(packages) > 15 and len(modules) > 5 and len(commands) > 8
    unplaced = sorted(name for name in packages | modules | commands if name not in layout)
    assert not unplaced, f"not on docs/architecture.md's Layout: {unplaced}"
