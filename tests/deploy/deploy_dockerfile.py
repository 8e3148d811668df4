"""A small Dockerfile reader: enough structure (stages, instructions, exec form) to check ours.

No Docker engine or linter is available offline; this parses what the checks need and fails on
lines it cannot read.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

KNOWN = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
         "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


@dataclass
class Instruction:
    keyword: str
    value: str
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction, or None for shell form."""
        try:
            parsed = json.loads(self.value)
        except json.JSONDecodeError:
            return None
        return parsed if isinstance(parsed, list) and all(isinstance(a, str) for a in parsed) else None

    def flags_and_args(self) -> tuple[dict[str, str], list[str]]:
        """`--name=value` options in front (COPY --from=..., HEALTHCHECK --interval=...), then the rest."""
        words = shlex.split(self.value)
        flags = {}
        while words and words[0].startswith("--"):
            name, _, value = words.pop(0)[2:].partition("=")
            flags[name] = value
        return flags, words


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for i in self.all("ENV"):
            for word in shlex.split(i.value):
                key, _, value = word.partition("=")
                out[key] = value
        return out


@dataclass
class Dockerfile:
    global_args: list[Instruction]
    stages: list[Stage]


def parse(path: Path) -> Dockerfile:
    logical: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # comments and blank lines may sit inside a continuation too
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append((start, pending + stripped))
        pending = ""
    if pending:
        raise ValueError(f"{path}: line continuation at end of file")

    global_args: list[Instruction] = []
    stages: list[Stage] = []
    for number, text in logical:
        keyword, _, value = text.partition(" ")
        keyword = keyword.upper()
        if keyword not in KNOWN:
            raise ValueError(f"{path}:{number}: unknown instruction {keyword}")
        instruction = Instruction(keyword, re.sub(r"\s+", " ", value.strip()), number)
        if keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+ )?(\S+)(?: AS (\S+))?", instruction.value, re.IGNORECASE)
            if m is None:
                raise ValueError(f"{path}:{number}: cannot read FROM {value!r}")
            stages.append(Stage(base=m.group(1), name=m.group(2)))
        elif not stages:
            if keyword != "ARG":
                raise ValueError(f"{path}:{number}: only ARG may precede the first FROM")
            global_args.append(instruction)
        else:
            stages[-1].instructions.append(instruction)
    if not stages:
        raise ValueError(f"{path}: no FROM")
    return Dockerfile(global_args, stages)
