"""Reading a config: YAML in (bounded: no alias bombs, no deep nesting, no key given twice), `--section.key=value`
overrides on top, each value checked against its field's type, then every value check (config/checks.py); every
problem is collected and raised together in one ConfigError. Also writing the resolved config and its summary."""
from __future__ import annotations

import dataclasses
import math
import re
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path

import yaml

from safe_io import nofollow
from safe_io.names import shown
from safe_io.urls import display

from .checks import validate
from .errors import ConfigError, closest
from .numbers import integer_in, number
from .sections import REMOVED_FIELDS, Config

# A config file is a few kilobytes: a file far larger is a checkpoint or a corpus given in its place.
MAX_CONFIG_BYTES = 16 * 2**20
# Anchors and aliases may repeat a few sections; more than this many repeated values is an attack.
MAX_ALIAS_VALUES = 10_000
# A config nests four levels (section, key, list, mapping); YAML's composer recurses once per level.
MAX_NESTING = 64
# Integer fields reach int64 tensors, numpy keys and checkpoint counters: a value past 64 bits would overflow there.
INT64_RANGE = range(-(2**63), 2**63)


# How a type problem names what was expected and what was given, in the words of YAML.
_EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_GIVEN = {int: "the integer", float: "the number", bool: "the boolean", str: "the string", list: "the list",
          dict: "the mapping", type(None): "null"}


def _type_problem(where: str, value, kinds: Sequence[type]) -> str:
    """"model.dim: expected an integer, got the string '128'", with a hint where quotes are the mistake."""
    expected = " or ".join(_EXPECTED.get(t, t.__name__) for t in kinds)
    given = "null" if value is None else f"{_GIVEN.get(type(value), type(value).__name__)} {value!r}"
    text = f"{where}: expected {expected}, got {given}"
    if isinstance(value, str) and int in kinds and integer_in(value) is not None:
        text += " (in quotes, a number is a string: write it without them)"
    return text


def _is_a(value, kind: type) -> bool:
    """isinstance, except that a boolean is no integer (YAML's true is not 1)."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _coerce(value, hint, where: str, problems: list[str]):
    """Check `value` against type `hint`; return it (ints accepted for floats). Appends to problems."""
    if isinstance(value, _Unreadable):  # whatever the field's type: YAML read it, the config refuses it
        problems.append(f"{where}: {value.problem}")
        return value
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        kinds = [t for t in options if t is not type(None)]
        if len(kinds) > 1:  # e.g. int | str: a value of one of them, as it is
            _check_kind(value, kinds, where, problems)
            return value
        hint = kinds[0]
    origin = typing.get_origin(hint)
    if origin is typing.Literal:  # its type here; whether it is one of the choices: config/checks.py
        hint = type(typing.get_args(hint)[0])
    if origin is list:
        return _coerce_list(value, typing.get_args(hint)[0], where, problems)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a section of its own, e.g. data.sources[0]
        if not isinstance(value, dict):
            problems.append(f"{where}: expected a mapping, got {value!r}")
            return hint()
        return _build(hint, value, where, problems)
    if hint is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        return _coerce_float(value, where, problems)
    _check_kind(value, [hint], where, problems)
    return value


def _check_kind(value, kinds: Sequence[type], where: str, problems: list[str]) -> None:
    """`value` is of one of `kinds`, and an integer fits in 64 bits."""
    if not any(_is_a(value, t) for t in kinds):
        problems.append(_type_problem(where, value, kinds))
    elif int in kinds and _is_a(value, int) and value not in INT64_RANGE:
        problems.append(f"{where}: {value} does not fit a 64-bit integer (at most 2**63 - 1), in which the run "
                        f"counts it")


def _coerce_list(value, item, where: str, problems: list[str]):
    if isinstance(value, str):  # a single path is accepted where a list is expected
        value = [value]
    if not isinstance(value, list):
        problems.append(f"{where}: expected a list, got {value!r}")
        return value
    return [_coerce(v, item, f"{where}[{i}]", problems) for i, v in enumerate(value)]


def _coerce_float(value: int | float | str, where: str, problems: list[str]) -> float | str:
    """A float field's value: ints become floats; a string that reads as a number (in the digits 0-9) is
    accepted, because YAML reads 3e-4 as a string (YAML 1.1 needs a dot); NaN and infinities are refused."""
    if isinstance(value, str):
        try:
            result = number(value)
        except ValueError:
            problems.append(_type_problem(where, value, [float]))
            return value
    else:
        result = float(value)
    if not math.isfinite(result):
        problems.append(f"{where}: must be a finite number, got {value!r}")
        return value if isinstance(value, float) else result
    return result


def _build(cls, raw: dict, where: str, problems: list[str]):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if not isinstance(key, str):  # YAML keys may be numbers, null or lists
            problems.append(f"{where.lstrip('.') or 'top level'}: key {key!r} is not a name")
            continue
        if key not in names:
            full_key, prefix = (where + "." + key).lstrip("."), (where + ".").lstrip(".")
            if full_key in REMOVED_FIELDS:
                problems.append(f"{full_key} is no longer a field: use {REMOVED_FIELDS[full_key]}")
            else:
                problems.append(f"unknown key '{full_key}'{closest(key, names, prefix)}")
            continue
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            value = {} if value is None else value  # a section whose keys are all commented out
            if not isinstance(value, dict):
                problems.append(f"{(where + '.' + key).lstrip('.')}: expected a section (mapping), got {value!r}")
                continue
            kwargs[key] = _build(hint, value, f"{where}.{key}", problems)
        else:
            before = len(problems)
            coerced = _coerce(value, hint, f"{where}.{key}".lstrip("."), problems)
            if len(problems) == before:  # a mistyped value keeps the default, so value checks still run
                kwargs[key] = coerced
    return cls(**kwargs)


def split_known_args(parser, argv: list[str]):
    """parser.parse_known_args, the rest being `--section.key=value` overrides; anything else is a usage
    error (argparse's, exit 2). Shared by train_fsdp.py and the scripts that take the same config."""
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not (o.startswith("--") and "=" in o and "." in o.split("=", 1)[0])]
    if bad:
        options = re.findall(r"--\w+", parser.format_usage())  # the script's own options
        hint = closest(bad[0].split("=", 1)[0], options) or ": overrides look like --section.key=value"
        parser.error(f"unrecognised argument {bad[0]!r}{hint}")
    return args, overrides


class _Refused(yaml.YAMLError):
    """Valid YAML that the loader refuses; the message says why and where."""


def _at(mark: yaml.Mark | None) -> str:
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""


def _expansion(root: yaml.Node) -> int:
    """How many more values the document holds once every alias (and merge key) is written out than it
    spells out itself; _Refused when an alias refers to a value that contains it."""
    sizes: dict[int, int] = {}  # id(node) -> values in it, aliases expanded
    ancestors: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # depth first, without recursion: nesting depth is the document's to choose
        node, finished = stack.pop()
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        if finished:
            ancestors.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
        elif id(node) in ancestors:
            raise _Refused("an alias refers to a value that contains it")
        elif id(node) not in sizes:
            ancestors.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children)
    return sizes[id(root)] - len(sizes)


class _Unreadable:
    """A value YAML reads that no config takes, kept so that the type check reports `problem` under its key."""

    problem = ""


class _LongInt(_Unreadable):
    """A YAML integer with more digits than Python converts (sys.get_int_max_str_digits)."""

    def __init__(self, digits: int):
        self.digits = digits
        self.problem = f"an integer of {digits:,} digits, far out of range"

    def __repr__(self) -> str:
        return f"<an integer of {self.digits:,} digits>"


class _Base60(_Unreadable):
    """A YAML 1.1 base-60 number: `190:20:30` is 685230 to YAML 1.1, a time or a typo to its writer."""

    def __init__(self, text: str):
        self.text = text
        self.problem = (f"{text} is read as a number in base 60 (YAML 1.1's sexagesimal); write the number in "
                        "decimal, or quote the text for a string")

    def __repr__(self) -> str:
        return self.text


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses what a config never holds and would otherwise fail far from its cause:
    aliases that repeat more than MAX_ALIAS_VALUES values ("billion laughs": a few hundred bytes that grow
    to gigabytes once the tree is walked), nesting deeper than MAX_NESTING (the composer recurses once per
    level, a RecursionError), and a key given twice in one mapping (the last would silently win)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        if self.depth >= MAX_NESTING:
            raise _Refused(f"nested more than {MAX_NESTING} levels deep{_at(self.peek_event().start_mark)}")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_document(self, node: yaml.Node):
        if _expansion(node) > MAX_ALIAS_VALUES:
            raise _Refused(f"its aliases repeat more than {MAX_ALIAS_VALUES:,} values (an alias bomb?); "
                           f"write the values out instead")
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict = {}  # key -> its key node; merge keys (<<) are overridden by design, so not counted
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                earlier = first.setdefault(key, key_node)
            except TypeError:  # a list or mapping as a key: SafeConstructor says so itself
                continue
            if earlier is not key_node:
                raise _Refused(f"key {key!r} is given twice{_at(key_node.start_mark)}, first at line "
                               f"{earlier.start_mark.line + 1}, column {earlier.start_mark.column + 1}; give each "
                               f"key once")
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: yaml.ScalarNode):
        if ":" in node.value:  # base 60 (YAML 1.1's resolver tags only 0-9, _ and : as an integer with a colon)
            return _Base60(node.value)
        try:
            value = super().construct_yaml_int(node)
        except ValueError:  # past Python's limit on the digits of a decimal integer
            return _LongInt(sum(c.isdigit() for c in node.value))
        # Hexadecimal, binary and base-60 integers have no such limit, yet could not be printed in decimal.
        digits = int(value.bit_length() * math.log10(2)) + 1
        return _LongInt(digits) if 0 < sys.get_int_max_str_digits() < digits else value


    def construct_yaml_float(self, node: yaml.ScalarNode):
        return _Base60(node.value) if ":" in node.value else super().construct_yaml_float(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)
_BoundedLoader.add_constructor("tag:yaml.org,2002:float", _BoundedLoader.construct_yaml_float)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """One line for a YAML error: what went wrong and, when known, where."""
    problem = getattr(err, "problem", None)
    if not problem:
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"{problem}{_at(getattr(err, 'problem_mark', None))}"


def parse_override(arg: str) -> tuple[list[str], object]:
    """'--train.lr=1e-3' -> (['train', 'lr'], 0.001). Values are parsed as YAML scalars."""
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body:
        raise ConfigError([f"override '{arg}' must look like --section.key=value"])
    key, value = body.split("=", 1)
    try:
        return key.split("."), yaml.load(value, Loader=_BoundedLoader) if value != "" else ""
    except yaml.YAMLError as err:  # the value itself may be long (a list of files): name the key
        if isinstance(err, _Refused):
            raise ConfigError([f"override --{key}: {err}"]) from None
        raise ConfigError([f"override --{key}: not valid YAML: {_yaml_problem(err)}"]) from None


def read_yaml_file(path: Path) -> dict:
    """A YAML mapping from a file, within the loader's bounds (size, nesting, aliases, duplicate keys);
    ConfigError in one line otherwise. Also for config.yaml files that came with a copied run folder."""
    if path.is_dir():
        raise ConfigError([f"{path} is a directory; give a config file, e.g. config/train_tiny_fsdp.yaml"])
    if not path.is_file():  # a FIFO would block reading, a device never end
        from data.errors import file_problem

        problem = file_problem(path)
        raise ConfigError([f"config file not found: {shown(path)}" if problem == "no such file" else
                           f"{shown(path)}: {problem}; give the YAML file, e.g. config/train_tiny_fsdp.yaml"])
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError([f"{path}: {path.stat().st_size:,} bytes is not a config file (at most "
                               f"{MAX_CONFIG_BYTES:,}); give the YAML file, e.g. config/train_tiny_fsdp.yaml"])
        text = path.read_bytes()  # bytes: YAML finds the encoding, and undecodable text is a YAMLError
    except OSError as err:
        raise ConfigError([f"{path}: cannot read: {err.strerror or err}"]) from None
    try:
        raw = yaml.load(text, Loader=_BoundedLoader) or {}
    except _Refused as err:
        raise ConfigError([f"{path}: {err}"]) from None
    except yaml.YAMLError as err:
        raise ConfigError([f"{path}: not valid YAML: {_yaml_problem(err)}"]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: top level must be a mapping of sections"])
    return raw


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Read YAML, apply overrides, validate everything; raise ConfigError listing every problem."""
    raw = {} if path is None else read_yaml_file(Path(path))
    problems: list[str] = []
    for arg in overrides:
        try:
            keys, value = parse_override(arg)
        except ConfigError as err:
            problems += err.problems
            continue
        node = raw
        for k in keys[:-1]:
            if node.get(k) is None:
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                problems.append(f"override '{arg}': '{k}' is not a section")
                break
        else:
            node[keys[-1]] = value
    cfg = _build(Config, raw, "", problems)
    problems += validate(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg



def summarize_config(cfg: Config) -> list[str]:
    """A few lines for the console; the whole resolved config goes to <output_dir>/config.yaml."""

    d, t, f, c = cfg.data, cfg.train, cfg.fsdp, cfg.checkpoint
    corpus = (d.dataset_dir or ", ".join(map(display, d.files)) or ", ".join(s.path for s in d.sources)
              or d.hf_dataset.path)
    return [
        f"run {cfg.run.name}: output {cfg.output_dir} (the resolved config: config.yaml there), seed {cfg.run.seed}",
        f"data: {corpus or 'the default corpus'}, seq {d.seq_len}, tokenizer {d.tokenizer}, format {d.format}"
        f"{', document masking' if d.document_masking else ''}"
        f"{', positions restart at each document' if cfg.model.reset_positions else ''}",
        f"train: {f'{t.epochs:g} epochs' if t.epochs is not None else f'{t.max_steps} steps'}, global batch "
        f"{t.global_batch_size}, micro-batch {t.micro_batch_size}, optimizer {t.optimizer}, "
        f"lr {t.lr:g} ({t.lr_schedule}, warmup {t.warmup_steps}), precision {t.precision}, float8 {t.float8}"
        f"{', output projection in FP8' if t.float8_output else ''}, compile {t.compile}",
        f"fsdp: version {f.version}, {f.sharding_strategy}, activation checkpointing {f.activation_checkpointing}; "
        f"checkpoint: {c.format} every {c.interval} steps, keep {c.keep_last_n}",
    ]


def config_text(cfg: Config) -> str:
    """The resolved config as YAML, as config.yaml holds it."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config into a new file of a unique name beside `path` (created exclusively, never through a
    link), renamed into place: a symbolic link at `path` is replaced, never written through (nofollow.replace_file)."""
    nofollow.replace_file(path, config_text(cfg).encode())
