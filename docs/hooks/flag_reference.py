"""The flag reference of the site, generated when it is built (an MkDocs hook).

Each program's flags are defined into a fresh `absl.flags.FlagValues` by the function
the program itself calls, and written as one Markdown table (`reference_page`): a flag
added to a program is in the reference of the next build, and none can be missed.
"""

from __future__ import annotations

import dataclasses
import html
import re
from collections.abc import Callable

from absl import flags

from recommendation import online_main, recommend, serve_main
from recommendation.training import ncf_common

# absl's own flags, which every program takes; --helpfull lists them under absl's modules.
ABSL_FLAGS = (
    "`--flagfile` (flags from a file), `--undefok`, `--help`, `--helpshort`, `--helpfull`, "
    "`--helpxml`, `--only_check_args` and absl's logging flags (`--logtostderr`, "
    "`--alsologtostderr`, `--log_dir`, `--verbosity`/`-v`, `--stderrthreshold`, ...)"
)


@dataclasses.dataclass(frozen=True)
class Program:
    """A command-line program of the project and the page of its flags.

    Attributes:
        name: What the page calls it.
        module: Its module (``python -m MODULE`` runs it).
        define: Defines its flags into a `FlagValues`, as the program does at start.
        about: One sentence on what it does, with a link to its guide.
    """

    name: str
    module: str
    define: Callable[[flags.FlagValues], None]
    about: str

    @property
    def page(self) -> str:
        return f"reference/{self.name}.md"


PROGRAMS = (
    Program(
        "ncf-main",
        "recommendation.ncf_main",
        ncf_common.define_ncf_flags,
        "Trains NeuMF offline in train/eval cycles ([offline runs](../offline.md)).",
    ),
    Program(
        "ncf-online",
        "recommendation.online_main",
        online_main.define_online_flags,
        "Trains NeuMF from an event stream ([online training](../online.md)).",
    ),
    Program(
        "ncf-serve",
        "recommendation.serve_main",
        serve_main.define_serve_flags,
        "Serves an online model over TensorFlow Serving's REST API, its trainer's "
        "publications applied in place ([serving an online model](../serving-online.md)).",
    ),
    Program(
        "ncf-create-data",
        "recommendation.create_ncf_data",
        ncf_common.define_data_flags,
        "Prepares a dataset only ([datasets](../datasets.md)).",
    ),
    Program(
        "export",
        "recommendation.export",
        ncf_common.define_ncf_flags,
        "Exports the latest checkpoint of an ncf-main run for serving; it takes ncf-main's "
        "flags, as the run's dataset and model flags say what the checkpoint holds "
        "([serving](../serving.md)).",
    ),
    Program(
        "recommend",
        "recommendation.recommend",
        recommend.define_flags,
        "Top-k recommendations from an export ([serving](../serving.md)).",
    ),
)


def program_flags(program: Program) -> list[flags.Flag]:
    """The flags `program` defines, by name (an alias is a flag of its own)."""
    flag_values = flags.FlagValues()
    program.define(flag_values)
    by_name = {flag_values[name].name: flag_values[name] for name in flag_values}
    return [by_name[name] for name in sorted(by_name)]


def reference_page(program: Program) -> str:
    """The Markdown page of `program`'s flags: a row each, by name."""
    rows = "\n".join(_row(flag) for flag in program_flags(program))
    return (
        f"# {program.name} flags\n\n"
        f"`python -m {program.module}`. {program.about}\n\n"
        "Generated from the program's flag definitions when this site is built; "
        f"`--helpfull` prints the same. Every program also takes {ABSL_FLAGS}.\n\n"
        "| flag | default | values | meaning |\n"
        "|---|---|---|---|\n"
        f"{rows}\n"
    )


def on_files(files, config):
    """MkDocs hook: adds each program's page to the site's files."""
    from mkdocs.structure.files import File

    for program in PROGRAMS:
        files.append(File.generated(config, program.page, content=reference_page(program)))
    return files


def _row(flag: flags.Flag) -> str:
    name = f"`--{flag.name}`"
    if flag.short_name:
        name += f" (`-{flag.short_name}`)"
    help_text = flag.help
    values = _values(flag)
    enum_values = getattr(flag.parser, "enum_values", None)
    if enum_values:
        # absl writes an enum's values in front of its help; they have their own column.
        help_text = help_text.removeprefix(f"<{'|'.join(enum_values)}>: ")
    return f"| {name} | {_default(flag.default)} | {values} | {_text(help_text)} |"


def _values(flag: flags.Flag) -> str:
    enum_values = getattr(flag.parser, "enum_values", None)
    if enum_values:
        return ", ".join(f"`{value}`" for value in enum_values)
    if flag.boolean:
        return f"`--{flag.name}`, `--no{flag.name}`"
    return _text(flag.parser.syntactic_help) or "text"


def _default(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list | tuple):
        value = ",".join(str(item) for item in value)
    return f"`{value}`" if value != "" else "`''`"


def _text(text: str) -> str:
    """`text` on one line, as literal Markdown: no HTML, emphasis or table cell ends."""
    text = html.escape(" ".join(text.split()), quote=False)
    return re.sub(r"([\\`*_\[\]|])", r"\\\1", text)
