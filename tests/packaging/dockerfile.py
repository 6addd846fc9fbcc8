"""A small Dockerfile reader for structural checks: instructions, build stages, ARG defaults,
LABELs and exec-form arrays. It follows the Dockerfile reference's rules for comments, line
continuations and parser directives; it does not expand variables."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

DIRECTIVE = re.compile(r"^#\s*([a-zA-Z]+)\s*=\s*(\S+)\s*$")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # everything after the keyword, continuations joined
    line: int  # 1-based line of the keyword

    def flags(self) -> dict[str, str]:
        """Leading ``--name=value`` flags (COPY --from, HEALTHCHECK --interval, ...)."""
        found = {}
        for word in shlex.split(self.args):
            if not word.startswith("--"):
                break
            name, _, value = word[2:].partition("=")
            found[name] = value
        return found

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form ENTRYPOINT/CMD/SHELL, or None for the shell form."""
        text = self.args.strip()
        if not text.startswith("["):
            return None
        parsed = json.loads(text)
        assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed)
        return parsed


@dataclass
class Stage:
    base: str  # the FROM argument as written (may reference ARGs)
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None

    def args(self) -> dict[str, str | None]:
        return dict(parse_arg(i.args) for i in self.all("ARG"))

    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = {}
        for instruction in self.all("LABEL"):
            for word in shlex.split(instruction.args):
                key, sep, value = word.partition("=")
                assert sep, f"LABEL without '=' at line {instruction.line}: {word}"
                labels[key] = value
        return labels


@dataclass
class Dockerfile:
    path: Path
    directives: dict[str, str]
    global_args: dict[str, str | None]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        (found,) = [s for s in self.stages if s.name == name]
        return found


def parse_arg(text: str) -> tuple[str, str | None]:
    name, sep, default = text.strip().partition("=")
    if not sep:
        return name, None
    words = shlex.split(default) if default else [""]
    return name, words[0] if words else ""


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines with continuations joined and comment lines dropped (also inside continuations)."""
    result: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if not pending:
            start = number
        if raw.rstrip().endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        pending.append(raw)
        result.append((start, " ".join(part.strip() for part in pending)))
        pending = []
    assert not pending, "the file ends inside a line continuation"
    return result


def parse(path: Path) -> Dockerfile:
    text = path.read_text()
    directives: dict[str, str] = {}
    for raw in text.splitlines():
        match = DIRECTIVE.match(raw)
        if not match:
            break
        directives[match.group(1).lower()] = match.group(2)
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for number, line in logical_lines(text):
        keyword, _, args = line.partition(" ")
        instruction = Instruction(keyword.upper(), args.strip(), number)
        if instruction.keyword == "FROM":
            words = [w for w in instruction.args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif not stages:
            assert instruction.keyword == "ARG", f"{path}:{number}: only ARG may precede FROM"
            key, value = parse_arg(instruction.args)
            global_args[key] = value
        else:
            stages[-1].instructions.append(instruction)
    return Dockerfile(path, directives, global_args, stages)
