"""The arguments of the ``pretrain_gpt.py`` command in a Megatron-LM launch script, read without
running it.

Megatron-LM's example scripts build the command from shell variables (``NUM_LAYERS=80``,
``TP=${TP:-4}``) and arrays (``MODEL_ARGS=( --num-layers 2 ... )``), then call
``torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]} ...``. ``read_script``
follows those assignments in order, expands ``$NAME``, ``${NAME}``, ``${NAME:-default}``,
``${NAME[@]}`` and ``$((a*b))`` (integer arithmetic), and returns the words after
``pretrain_gpt.py`` with the world size its launcher asks for (torchrun's ``--nproc_per_node``
x ``--nnodes``). Lines inside ``if``/``for``/``while`` blocks are not followed (a shell would
take one branch; this does not guess which): the flags they would add are reported, so a
script that computes its command that way can be given as its arguments instead.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

ENTRY_POINTS = ("pretrain_gpt.py", "pretrain_mamba.py")
_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)(\+?)=(.*)$", re.S)
_EXPAND = re.compile(r"\$\(\((.+?)\)\)|\$\{([A-Za-z_]\w*)(\[@\]|\[\*\])?(?::?-([^}]*))?\}"
                     r"|\$([A-Za-z_]\w*)")
_BLOCK_START = re.compile(r"^(if|for|while|until|case)\b")
_BLOCK_END = re.compile(r"^(fi|done|esac)\b")


@dataclass
class Command:
    """The ``pretrain_gpt.py`` arguments of a script, the world size its launcher asks for (0:
    not said), and the flags of the conditional blocks that were not followed."""
    args: list[str]
    world_size: int = 0
    skipped: list[str] = field(default_factory=list)


def _logical_lines(text: str) -> list[str]:
    """The script's lines with ``\\`` continuations joined, comments dropped (outside quotes),
    and multi-line array assignments ``NAME=( ... )`` joined into one."""
    lines, buffer, depth = [], "", 0
    for raw in text.splitlines():
        line = raw.rstrip()
        stripped = line.lstrip()
        if stripped.startswith("#") and not buffer:
            continue
        if buffer and stripped.startswith("#"):
            continue
        line = re.sub(r"\s+#.*$", "", line) if "'" not in line and '"' not in line else line
        buffer += (" " if buffer else "") + line.rstrip("\\").strip()
        depth += line.count("(") - line.count(")")
        if line.endswith("\\") or depth > 0:
            continue
        if buffer:
            lines.append(buffer)
        buffer, depth = "", 0
    if buffer:
        lines.append(buffer)
    return lines


class _Shell:
    """The variables and arrays seen so far, and the expansion of words with them."""

    def __init__(self, env: dict[str, str] | None = None):
        self.values: dict[str, list[str]] = {k: [v] for k, v in (env or {}).items()}

    def text(self, name: str) -> str:
        return " ".join(self.values.get(name, []))

    def expand(self, word: str) -> str:
        def one(match: re.Match) -> str:
            arithmetic, name, index, default, plain = match.groups()
            if arithmetic is not None:  # bare names are variables there too
                names = re.sub(r"[A-Za-z_]\w*", lambda m: self.text(m.group()) or "0",
                               self.expand(arithmetic))
                return str(self._arithmetic(names))
            name = name or plain
            value = self.text(name)
            return value if value or default is None else self.expand(default.strip("\"'"))
        return _EXPAND.sub(one, word)

    @staticmethod
    def _arithmetic(expression: str) -> int:
        if not re.fullmatch(r"[\d\s+\-*/()%]+", expression):
            raise ValueError(f"$(( {expression} )) is not integer arithmetic")
        return int(eval(expression.replace("/", "//"), {"__builtins__": {}}))  # digits only

    def words(self, line: str) -> list[str]:
        """``line`` split as the shell would, each word expanded (an array's ``[@]`` expands to
        its words)."""
        out = []
        for word in shlex.split(line, posix=True):
            expanded = self.expand(word)
            out.extend(expanded.split() if ("[@]" in word or "[*]" in word or "$" in word)
                       else [expanded])
        return out

    def assign(self, name: str, append: bool, value: str) -> None:
        value = value.strip()
        if value.startswith("(") and value.endswith(")"):
            items = self.words(value[1:-1])
        else:
            items = [" ".join(self.words(value))] if value else [""]
            if append and name in self.values:
                items = [self.text(name) + items[0]]
        self.values[name] = (self.values.get(name, []) if append and value.startswith("(")
                             else []) + items


def _launcher_world(words: list[str]) -> int:
    """torchrun's processes: ``--nproc_per_node`` x ``--nnodes`` (0 when not said)."""
    def value(flag: str) -> int:
        for i, word in enumerate(words):
            given = word.split("=", 1)[1] if word.startswith(f"{flag}=") else \
                words[i + 1] if word == flag and i + 1 < len(words) else None
            if given is not None:
                return int(given) if given.isdigit() else 0
        return 0
    per_node = value("--nproc_per_node") or value("--nproc-per-node")
    return per_node * (value("--nnodes") or 1) if per_node else 0


def read_script(text: str, env: dict[str, str] | None = None) -> Command:
    """The command of the Megatron-LM launch script ``text`` (``env``: variables given to it,
    as ``NAME=value`` before ``bash script.sh``). Raises ValueError when no line runs
    ``pretrain_gpt.py``."""
    shell, skipped, depth = _Shell(env), [], 0
    for line in _logical_lines(text):
        if _BLOCK_START.match(line):
            depth += 1
        if depth:
            skipped += [w for w in re.findall(r"--[a-z][\w-]*", line)]
            if _BLOCK_END.match(line) or re.search(r";\s*(fi|done)$", line):
                depth -= 1
            continue
        if (match := _ASSIGN.match(line)) and not line.startswith(("torchrun", "python")):
            shell.assign(match.group(1), bool(match.group(2)), match.group(3))
            continue
        words = shell.words(line)
        entry = next((i for i, w in enumerate(words) if w.endswith(ENTRY_POINTS)), None)
        if entry is not None:
            return Command(words[entry + 1:], _launcher_world(words[:entry]), skipped)
    raise ValueError("no line of the script runs pretrain_gpt.py: give the script that launches "
                     "it, or its arguments after --")
