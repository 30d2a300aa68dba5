"""The flags of ``launch.py train`` and of the other commands, derived from their declarations
(``specring.shared.config.run_config``, ``specring.shared.commands.command_config``).

Nothing here names a config field: every field of ``RunConfig`` declared with ``setting``/``num`` becomes

* a flag ``--SECTION.FIELD-NAME`` (``--trainer.grad-clip``; ``--run-dir`` for ``RunConfig``'s own fields)
  plus its declared aliases (``--lr``; ``--slot-mb`` with its scale), parsed by its type: ``int``/``float``
  through ``finite_number``, ``bool`` as ``--x``/``--no-x`` (``--x=false`` too), lists as comma lists,
  ``X | None`` accepting ``none``, choices checked;
* a line of ``--help``, in its group, with its default (and CPU default, and whether it may change on
  ``--resume``);
* a key of ``--config FILE`` (TOML or YAML; unknown keys refused by name).

Order of precedence: the field's default (its machine default for the device lists), then ``--config
FILE``, then flags; a field that follows another (``data.seed`` follows ``trainer.seed``) takes its value
when only that one is set; then, when every device is CPU, each CPU default the user did not set. With
``--resume`` the saved ``config.json`` of the run is the base instead, and a flag may only change it where
its field says so (``config_from_args``).

The other commands (``eval``, ``export``, ``regenerate``, ``prepare``) declare their options the same way, one flat
dataclass per command (``shared.config.run_config.option_specs``); ``command_parser`` derives the command's parser from
any such class (one flag ``--FIELD-NAME`` per field, parsed by its type as above; a ``switch`` field is a flag that
takes no value, an ``nargs``/``repeat``/``positional`` field takes its values as declared; ``--help`` grouped by the
class's ``HELP_GROUPS``, every default shown) and ``command_config`` builds the typed object from the parsed flags, a
bad value's ``ConfigError`` naming the flag as typed.
"""

from __future__ import annotations

import argparse
import textwrap
import typing
from pathlib import Path
from typing import Any, Callable

from specring.shared.config.run_config import (
    Alias,
    FieldSpec,
    RunConfig,
    field_specs,
    finite_number,
    option_specs,
    section_classes,
)
from specring.shared.errors import ConfigError
from specring.shared.machine.device_groups import is_cpu_group

GROUPS = {  # --help groups, in order: title -> description
    "topology": "where the processes run: producers (each runs the target) and consumers (each trains the "
                "drafter, one data-parallel rank), and how they talk",
    "target & capture": "the target model and the layers whose hidden states the producers capture",
    "drafter & training": "the drafter (DFlash, DFlash2 or EAGLE-3), its loss and optimisation, and tau "
                          "(acceptance length) measured during training",
    "data": "the tokenized data and the batch plan",
    "rings": "one shared-memory ring per producer; each slot holds the hidden states of one batch",
    "health monitor": "heartbeats, hang detection and producer restarts (durations in seconds)",
    "nodes": "several nodes: each runs this command with its own --node-rank; node 0 owns the batch ledger",
    "run directory": "where the run keeps its records, and continuing it",
}

DESCRIPTION = """\
Train a speculative-decoding drafter (DFlash, DFlash2, EAGLE-3) from a target's hidden states: producers (each runs the
target and captures its hidden states) and consumers (drafter trainers) run as separate processes joined by
shared-memory rings.

Every configuration field is a flag --SECTION.FIELD-NAME (sections: data, ring, producer, trainer,
monitor; --run-dir, --resume, --report-to, --tcp and --run-id have none); the common ones also have a
short alias (--lr, --producers, --slot-mb, ...). --config FILE sets the same fields from TOML or YAML
([trainer] lr = 3e-4; the recipes in configs/); flags override the file. When every producer and
consumer is on CPU, the fields that show an "on CPU" default use it unless set. Lists are comma lists
(1,9,17); "none" clears a field that allows it; a yes/no field takes --FLAG or --no-FLAG. --target takes
a directory or a Hugging Face hub id (Qwen/Qwen3-8B)."""

EPILOG = """\
examples:
  launch.py train                                   the embedded default: fixture target, demo corpus
  launch.py train --plan                            print the resolved run (and its CPU defaults); start nothing
  launch.py train --config configs/qwen3-8b.toml --data data/train.arrow --epochs 1
                                                    a shipped recipe (configs/): target, layers, drafter, 8 GPUs
  launch.py train --target Qwen/Qwen3-8B --data data/train.arrow --producers cuda:0,cuda:1,cuda:2 \\
      --consumers cuda:3,cuda:4,cuda:5,cuda:6,cuda:7 --target-layers 1,9,17,25,33 --run-dir runs/q8
  launch.py train --target org/custom-model --trust-remote-code ...   a target with its own modelling code
  launch.py train --report-to tensorboard,wandb     trackers (wandb offline without WANDB_API_KEY)
  launch.py train --drafter eagle3 --draft-vocab 32000 --ttt-steps 7   an EAGLE-3 drafter (three target layers)
  launch.py train --drafter dflash2 --trainer.loss dpace   a DFlash2 drafter (convolutions, candidate selector)
  launch.py train --config run.toml --lr 3e-4       the file, with one value overridden
  launch.py train --trainer.grad-clip 0.5 --monitor.backoff-max-s 30 --data.bucket-edges 64,256,1024
  launch.py train --resume --max-steps 2000         continue runs/latest for longer
  launch.py train --run-dir runs/q8 --resume --hang-timeout-s 300"""


# ---------------------------------------------------------------------------------------------- values

def show(value: Any, scale: int = 1, unit: str = "") -> str:
    """A value as the command line writes it: ``none``, ``on``/``off``, comma lists, ``0.0006``; numbers
    divided by ``scale`` and followed by ``unit`` (``--slot-mb``)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(show(v) for v in value) or "[]"
    if isinstance(value, (int, float)) and scale != 1:
        value = value / scale
    if isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, str) and not value:
        text = '""'
    else:
        text = str(value)
    return f"{text} {unit}" if unit else text


def _one_of(choices: tuple) -> Callable[[str], str]:
    """The text itself, refused with ``argparse.ArgumentTypeError`` unless one of ``choices`` (when any)."""
    def parse_text(text: str) -> str:
        if choices and text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text
    return parse_text


def value_parser(spec: FieldSpec, alias: Alias | None = None) -> Callable[[str], Any]:
    """The ``argparse`` ``type=`` of a field's flag (``alias``: of that alias, with its scale): of each value
    on its own for a list field that takes one value per argument (``nargs``, ``repeat``, ``positional``),
    else of a comma list for a list field."""
    base, scale = spec.base_type, (alias.scale if alias else 1)
    choices = spec.meta.get("choices") or ()
    if typing.get_origin(base) is list:
        (item,) = typing.get_args(base)
        one = finite_number(item, scale) if item in (int, float) else _one_of(choices)

        def parse_value(text: str) -> Any:
            parts = [p.strip() for p in text.split(",") if p.strip()]
            if not parts:
                example = {int: "1,9,17"}.get(item) or (",".join(choices) if choices else "cpu,cpu or cuda:0,cuda:1")
                raise argparse.ArgumentTypeError(f"expected a comma-separated list such as {example}, got {text!r}")
            return [one(p) for p in parts]
        if spec.meta.get("nargs") or spec.meta.get("repeat") or spec.meta.get("positional"):
            parse_value = one
    elif base in (int, float):
        parse_value = finite_number(base, scale)
    else:
        parse_value = _one_of(choices)

    def parse(text: str) -> Any:
        if spec.optional and text.strip().lower() == "none":
            return None
        return parse_value(text)

    parse.__name__ = getattr(base, "__name__", "value")
    return parse


_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def _error(option_string: str, message: str) -> argparse.ArgumentError:
    """An argparse error that names the flag as typed (argparse itself would name all of a field's flags)."""
    return argparse.ArgumentError(None, f"argument {option_string}: {message}")


class _FieldAction(argparse.Action):
    """Parse a field's value (``parse``, see ``value_parser``; each of them when argparse gives a list, ``nargs``),
    store it under the field's key (``dest``; appended to the values before with ``repeat``) and remember the flag
    as typed (``ns.flag_of``; a positional argument: its name), so that errors name the flag the user wrote."""

    def __init__(self, option_strings, dest, parse: Callable[[str], Any] | None = None, repeat: bool = False, **kw):
        self.parse, self.repeat = parse, repeat
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if values is argparse.SUPPRESS:  # an empty positional of some Python versions
            return
        option_string = option_string or self.dest
        if self.parse is not None:
            try:
                values = [self.parse(v) for v in values] if isinstance(values, list) else self.parse(values)
            except argparse.ArgumentTypeError as e:
                raise _error(option_string, str(e)) from None
        if self.repeat:
            values = list(getattr(namespace, self.dest, None) or []) + [values]
        setattr(namespace, self.dest, values)
        vars(namespace).setdefault("flag_of", {})[self.dest] = option_string


class _SwitchAction(_FieldAction):
    """A ``switch`` field's flag: takes no value, sets the field on (``--trust-remote-code``)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, True, option_string)


class _BoolAction(_FieldAction):
    """``--x`` (on), ``--no-x`` (off), ``--x=false``; ``--x=none`` for a ``bool | None`` field."""

    def __init__(self, option_strings, dest, optional=False, negatives=(), **kw):
        self.optional, self.negatives = optional, set(negatives)
        super().__init__(option_strings, dest, nargs="?", **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        negative = option_string in self.negatives
        if values is None:
            value: bool | None = not negative
        elif negative:
            raise _error(option_string, "takes no value")
        elif values.lower() in _TRUE or values.lower() in _FALSE:
            value = values.lower() in _TRUE
        elif self.optional and values.lower() == "none":
            value = None
        else:
            raise _error(option_string, f"expected true or false{' or none' if self.optional else ''}, "
                                        f"got {values!r}")
        super().__call__(parser, namespace, value, option_string)


def _negative(flag: str) -> str:
    """``--ring.checksum`` -> ``--ring.no-checksum``, ``--checksum`` -> ``--no-checksum``."""
    head, _, name = flag[2:].rpartition(".")
    return "--" + (head + "." if head else "") + "no-" + name


# ------------------------------------------------------------------------------------------------ help

def metavar(spec: FieldSpec, alias: Alias | None = None) -> str:
    """``N``, ``X``, ``PATH``, ``N,N,...``, ``{auto,flex}``, ``X|none``, ``MIB`` (a scaled alias)."""
    base = spec.base_type
    if alias and alias.unit:
        text = alias.unit.upper()
    elif spec.meta.get("metavar"):
        text = spec.meta["metavar"]
    elif spec.meta.get("path"):
        text = "PATH"
    elif spec.meta.get("choices"):
        text = "{" + ",".join(spec.meta["choices"]) + "}"
    elif typing.get_origin(base) is list:
        text = "N,N,..." if typing.get_args(base)[0] is int else "DEV,DEV,..."
    else:
        text = {int: "N", float: "X"}.get(base, "TEXT")
    return text + "|none" if spec.optional and not spec.required else text


def default_help(spec: FieldSpec, alias: Alias | None = None) -> str:
    """``(default: 8192; on CPU 2048; may change on --resume)``: what ``--help`` appends to a field's line."""
    scale, unit = (alias.scale, alias.unit) if alias else (1, "")
    parts = [spec.meta.get("default_text") or show(spec.default, scale, unit if spec.default else "")]
    if spec.has_cpu_default:
        parts.append(f"on CPU {show(spec.meta['cpu_default'], scale, unit)}")
    if spec.meta.get("follows"):
        parts.append(f"{field_specs()[spec.meta['follows']].preferred_flag} when only that is set")
    if spec.may_change_on_resume:
        parts.append("may change on --resume")
    return "(default: " + "; ".join(parts) + ")"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Field flags as ``--trainer.lr, --lr X`` (one metavar), yes/no flags as ``--ring.[no-]checksum``."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=38)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = getattr(action, "invocation", None)
        return shown if shown else super()._format_action_invocation(action)


class CommandHelpFormatter(argparse.HelpFormatter):
    """``--help`` of the other commands (prepare, regenerate, eval, export, status, restart, clean): every
    option shows its default, ``(default: X)`` appended unless its help line already says it (``off`` for a
    yes/no flag; nothing for a required one); paragraphs of the description and epilog are wrapped, while
    lines that start with two spaces (examples) and a paragraph's ``title:`` line are kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.required or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            value = "on" if action.default else "off"
        elif action.default is None or action.default == []:
            value = "none"
        else:
            value = show(action.default)
        return f"{text} (default: {value})".replace("%", "%%")

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            lines = para.splitlines()
            head = [lines.pop(0)] if lines and lines[0].rstrip().endswith(":") else []
            if lines and all(ln.startswith("  ") for ln in lines):
                out.append("\n".join(indent + ln for ln in head + lines))
            else:
                body = [textwrap.fill(" ".join(lines), width, initial_indent=indent,
                                      subsequent_indent=indent)] if lines else []
                out.append("\n".join([indent + h for h in head] + body))
        return "\n\n".join(out)


def _add_field(group, spec: FieldSpec) -> None:
    """The flags of one field: ``--SECTION.FIELD`` with its unscaled aliases, and one action per scaled alias; a
    positional argument, a switch, a field of several values (``nargs``, ``repeat``) as ``FieldSpec`` says. A
    required field's line shows no default."""
    plain = [a for a in spec.aliases if a.scale == 1]
    scaled = [a for a in spec.aliases if a.scale != 1]
    shown = spec.required or spec.meta.get("positional")
    help_ = (spec.help if shown else f"{spec.help} {default_help(spec)}").replace("%", "%%")
    if spec.meta.get("positional"):  # argparse checks its choices (``invalid choice``), shown as {a,b} unless metavar
        group.add_argument(spec.key, action=_FieldAction, parse=value_parser(spec), nargs=spec.meta.get("nargs"),
                           default=argparse.SUPPRESS, help=help_, metavar=spec.meta.get("metavar"),
                           choices=spec.meta.get("choices") or None)
        return
    if spec.meta.get("switch"):
        group.add_argument(spec.flag, *[a.flag for a in plain], dest=spec.key, action=_SwitchAction,
                           default=argparse.SUPPRESS, required=spec.required, help=help_)
        return
    if spec.base_type is bool:
        flags = [spec.flag] + [a.flag for a in plain]
        negatives = [_negative(f) for f in flags]
        a = group.add_argument(*flags, *negatives, dest=spec.key, action=_BoolAction, optional=spec.optional,
                               negatives=negatives, default=argparse.SUPPRESS, help=help_)
        a.invocation = ", ".join(f.replace("--", "--[no-]") if "." not in f else f.replace(".", ".[no-]")
                                 for f in flags) + (" [=none]" if spec.optional else "")
        return
    mv = metavar(spec)
    a = group.add_argument(spec.flag, *[x.flag for x in plain], dest=spec.key, action=_FieldAction,
                           parse=value_parser(spec), default=argparse.SUPPRESS, metavar=mv, help=help_,
                           nargs=spec.meta.get("nargs"), repeat=bool(spec.meta.get("repeat")), required=spec.required)
    a.invocation = ", ".join([spec.flag] + [x.flag for x in plain]) + " " + mv
    for alias in scaled:
        mv = metavar(spec, alias)
        a = group.add_argument(alias.flag, dest=spec.key, action=_FieldAction, parse=value_parser(spec, alias),
                               default=argparse.SUPPRESS, metavar=mv,
                               help=f"{spec.flag} in {alias.unit} {default_help(spec, alias)}".replace("%", "%%"))
        a.invocation = f"{alias.flag} {mv}"


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``launch.py train``: ``--config``, ``--plan`` and one flag (with aliases) per config field,
    grouped by concern. Field values land in the namespace under their key (``"trainer.lr"``) only when given."""
    ap = argparse.ArgumentParser(prog="launch.py train", description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=HelpFormatter,
                                 usage="launch.py train [--config FILE] [--plan] [--SECTION.FIELD VALUE | "
                                       "--ALIAS VALUE ...]")
    ap.add_argument("--config", default=None, metavar="FILE",
                    help="TOML or YAML file with the sections of the configuration ([data], [ring], [producer], "
                         "[trainer], [monitor], [nodes]) and the run's own keys, e.g. a recipe of configs/; "
                         "flags override it (default: none)")
    ap.add_argument("--plan", action="store_true", help="print the resolved topology, sizes and which values came "
                                                        "from CPU defaults; start nothing (default: off)")
    specs = list(field_specs().values())
    unknown = {s.group for s in specs} - set(GROUPS)
    assert not unknown, f"config fields in groups without a title: {unknown}"
    for title, description in GROUPS.items():
        group = ap.add_argument_group(title, textwrap.fill(description, 100))
        for spec in sorted((s for s in specs if s.group == title), key=lambda s: not s.section):
            _add_field(group, spec)  # a group's section fields first, then RunConfig's own (--tcp)
    return ap


def command_parser(cls: type, prog: str, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """The parser of a command whose options ``cls`` declares (``shared.config.run_config.option_specs``:
    ``EvalConfig``, ...): one flag per field, in the groups of ``cls.HELP_GROUPS``, with ``CommandHelpFormatter``; a
    group titled as argparse's own (``shared.commands.command_config.POSITIONALS``, ``OPTIONS``) is that group (``-h``
    among the options). A field's value lands in the namespace under its name only when given (``command_config`` builds
    ``cls`` from it)."""
    ap = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                 formatter_class=CommandHelpFormatter)
    own = {g.title: g for g in (ap._positionals, ap._optionals)}
    specs = list(option_specs(cls).values())
    for title in dict.fromkeys(s.group for s in specs):
        group = own.get(title) or ap.add_argument_group(title)
        for spec in specs:
            if spec.group == title:
                _add_field(group, spec)
    return ap


def command_config(cls: type, args: argparse.Namespace) -> Any:
    """``cls`` (a command's options, see ``command_parser``) from the flags given, each other field at its default
    (a field's ``machine_default``, when it declares one, computed now: ``status``'s ``runs/latest`` of the current
    directory).

    Raises ``ConfigError`` naming the flag as typed (else the field's flag) when the value is refused (a bound, a
    choice, a required option: ``shared.config.run_config.check_fields``)."""
    specs = option_specs(cls)
    values = {key: getattr(args, key) if hasattr(args, key) else spec.meta["machine_default"]()
              for key, spec in specs.items() if hasattr(args, key) or spec.meta.get("machine_default")}
    try:
        return cls(**values)
    except ConfigError as e:
        if e.key in specs:
            name = getattr(args, "flag_of", {}).get(e.key) or specs[e.key].preferred_flag
            raise ConfigError(f"{name}: {e.detail}", key=e.key, detail=e.detail) from None
        raise


# ------------------------------------------------------------------------------------------ --config

def load_config_file(path: str) -> dict[str, Any]:
    """The values of a TOML/YAML config file by key (``{"trainer.lr": 3e-4, "run_dir": "runs/x"}``).

    Raises ``ConfigError`` naming the file when it is missing, unreadable, not UTF-8 or not valid TOML/YAML, a
    section is not a mapping, or a key is not a config field (the message lists the section's fields). Types and
    ranges are checked later, by the dataclasses (``RunConfig.from_dict``)."""
    d = _read_file(path)
    specs, sections = field_specs(), section_classes()
    top = [s.key for s in specs.values() if not s.section] + list(sections)
    out: dict[str, Any] = {}
    for key, value in d.items():
        if key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f"--config {path}: {key}: must be a mapping (a [{key}] section), got "
                                  f"{type(value).__name__}")
            for name, v in value.items():
                if f"{key}.{name}" not in specs:
                    known = [s.name for s in specs.values() if s.section == key]
                    raise ConfigError(f"--config {path}: unknown key {name!r} in section [{key}] (its fields: "
                                      f"{', '.join(known)})")
                out[f"{key}.{name}"] = v
        elif key in specs:
            out[key] = value
        else:
            raise ConfigError(f"--config {path}: unknown key {key!r} (known: {', '.join(top)})")
    return out


def _read_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: {p} does not exist")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"--config: {p} cannot be read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"--config: {p} is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}, line "
                          f"{line}): TOML and YAML files are UTF-8; save it as UTF-8 (iconv -t UTF-8)") from None
    if p.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore
        try:
            return tomllib.loads(text)
        except Exception as e:
            raise ConfigError(f"--config: {p} is not valid TOML: {e}") from None
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ModuleNotFoundError:
            raise ConfigError("--config: YAML needs PyYAML (pip install pyyaml); or use TOML") from None
        try:
            d = yaml.safe_load(text)
        except Exception as e:
            raise ConfigError(f"--config: {p} is not valid YAML: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"--config: {p} must hold a mapping")
        return d
    raise ConfigError(f"--config: {p} must end in .toml, .yaml or .yml")


# ---------------------------------------------------------------------------------------- resolution

def given_values(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """``{key: (value, source)}`` of every field set by ``--config FILE`` or a flag (flags win); the source
    names it in errors: the flag as typed (``--lr``) or ``--config FILE: trainer.lr``."""
    given: dict[str, tuple[Any, str]] = {}
    if getattr(args, "config", None):
        given.update({k: (v, f"--config {args.config}: {k}") for k, v in load_config_file(args.config).items()})
    flag_of = getattr(args, "flag_of", {})
    for spec in field_specs().values():
        if hasattr(args, spec.key):
            given[spec.key] = (getattr(args, spec.key), flag_of.get(spec.key, spec.flag))
    return given


def _get(d: dict, key: str) -> Any:
    section, _, name = key.rpartition(".")
    return (d[section] if section else d)[name]


def _set(d: dict, key: str, value: Any) -> None:
    section, _, name = key.rpartition(".")
    (d[section] if section else d)[name] = value


def _build(base: dict, sources: dict[str, str]) -> RunConfig:
    """``RunConfig.from_dict(base)``; a ``ConfigError`` is named by the flag or file key the value came from."""
    try:
        cfg = RunConfig.from_dict(base)
    except ConfigError as e:
        if e.key:
            spec = field_specs().get(e.key)
            name = sources.get(e.key) or (spec.preferred_flag if spec else e.key)
            raise ConfigError(f"{name}: {e.detail}", key=e.key, detail=e.detail) from None
        raise ConfigError(f"--config/flags: {e}") from None
    except TypeError as e:
        raise ConfigError(f"--config/flags: {e}") from None
    cfg.sources = sources
    return cfg


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """RunConfig from the parsed flags of ``launch.py train`` (see the module docstring for the order).

    Raises ``ConfigError`` naming the flag, or the file and key, that a bad value came from
    (``RunConfig.sources`` keeps that mapping for the checks that come later, ``supervisor.runplan``).
    ``cfg.cpu_defaults`` lists the CPU defaults applied. With ``--resume`` see ``resumed_config``."""
    given = given_values(args)
    if given.get("resume", (False,))[0]:
        return resumed_config(given)
    specs = field_specs()
    base = RunConfig().to_dict()
    for spec in specs.values():
        if spec.meta.get("machine_default") and spec.key not in given:  # (devices: torch asked only when needed)
            _set(base, spec.key, spec.meta["machine_default"]())
    sources = {}
    for key, (value, source) in given.items():
        _set(base, key, value)
        sources[key] = source
    for spec in specs.values():
        leader = spec.meta.get("follows")
        if leader and spec.key not in given and leader in given:
            _set(base, spec.key, given[leader][0])
            sources[spec.key] = given[leader][1]
    devices = [_get(base, "producer.devices"), _get(base, "trainer.devices")]
    if not all(isinstance(d, list) and all(isinstance(x, str) for x in d) for d in devices):
        raise ConfigError(f"--config: producer.devices and trainer.devices must be lists of device names, "
                          f"got {devices[0]!r} and {devices[1]!r}")
    cpu = {}
    if all(is_cpu_group(d) for d in devices[0] + devices[1]):
        for spec in specs.values():
            if spec.has_cpu_default and spec.key not in given:
                cpu[spec.key] = spec.meta["cpu_default"]
                _set(base, spec.key, cpu[spec.key])
    cfg = _build(base, sources)
    cfg.cpu_defaults = cpu
    return cfg


def _same(spec: FieldSpec, new: Any, old: Any) -> bool:
    """Whether a value given on ``--resume`` is the saved one: equal; the same path resolved (a hub id: the
    directory it resolves to); or, for a field filled when the run starts, its default (which stands for what
    it was filled with)."""
    if new == old or (spec.meta.get("filled_at_start") and new == spec.default):
        return True
    if spec.meta.get("path") and isinstance(new, str) and isinstance(old, str) and new and old:
        if spec.meta.get("hub") and not Path(new).expanduser().is_dir():  # a hub id: the run saved its directory
            from specring.shared.models.hub import resolve_model_dir
            try:
                new = str(resolve_model_dir(new))
            except ConfigError:
                return False
        return Path(new).expanduser().resolve() == Path(old).expanduser().resolve()
    return False


def _shown_as(spec: FieldSpec, source: str, value: Any) -> str:
    """``value`` in the units of the flag ``source`` names (``--slot-mb``: MiB)."""
    alias = next((a for a in spec.aliases if a.flag == source), None)
    return show(value, alias.scale, alias.unit) if alias else show(value)


def resumed_config(given: dict[str, tuple[Any, str]]) -> RunConfig:
    """The configuration of ``--resume``: the run's saved ``config.json``, with the given values of fields
    that may change on resume (``resume=True``: run length, evaluation, checkpoint interval, the health
    monitor, the data file's path) applied and listed in ``cfg.resume_changes``.

    A given value of any other field must equal the saved one (see ``_same``); otherwise ``ConfigError``
    names each such flag with the value the run trained with. ``--max-steps`` without ``--epochs`` ends a
    saved ``--epochs`` (the run then counts steps). No machine, follow or CPU default is applied: the saved
    values are the run's."""
    from specring.shared.run.run_dir import RunDir
    from specring.supervisor.resume import resume_dir

    specs = field_specs()
    run = RunDir(resume_dir(given.get("run_dir", ("runs/default",))[0]))
    run_dir, saved = run.path, run.config_file
    if not saved.is_file():
        raise ConfigError(f"--resume: {saved} does not exist (nothing to resume in --run-dir {run_dir})")
    try:
        base = run.read_config().to_dict()
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume: {saved} cannot be read as a run configuration: {e}") from None
    sources, refused, changes = {}, [], []
    for key, (value, source) in given.items():
        if key in ("run_dir", "resume"):
            continue
        spec, old = specs[key], _get(base, key)
        sources[key] = source
        if _same(spec, value, old):
            continue
        if spec.may_change_on_resume:
            _set(base, key, value)
            changes.append(f"{source} {_shown_as(spec, source, old)} -> {_shown_as(spec, source, value)}")
        else:
            refused.append(f"{source} cannot change when resuming (the run trained with "
                           f"{_shown_as(spec, source, old)})")
    if refused:
        raise ConfigError("--resume: " + "; ".join(refused) + "; start a new run instead")
    if "trainer.max_steps" in given and "trainer.epochs" not in given and base["trainer"]["epochs"] is not None:
        changes.append(f"{specs['trainer.epochs'].preferred_flag} {base['trainer']['epochs']} -> none "
                       f"({given['trainer.max_steps'][1]} counts the run's steps now)")
        base["trainer"]["epochs"] = None
    base["run_dir"], base["resume"] = str(run_dir), True  # the directory may have moved since
    cfg = _build(base, sources)
    cfg.resume_changes = changes
    return cfg


def cpu_default_lines(cfg: RunConfig) -> list[str]:
    """One line per value that came from a CPU default (for ``--plan``), e.g.
    ``data.max_tokens = 2048 (--max-tokens; default 8192 on GPU)``."""
    specs = field_specs()
    return [f"{key} = {show(value)}  ({specs[key].preferred_flag}; {show(specs[key].default)} when a GPU is used)"
            for key, value in cfg.cpu_defaults.items()]
