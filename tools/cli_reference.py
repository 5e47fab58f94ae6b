"""Write the CLI reference (docs/reference/cli.md) from the commands themselves: each command's help, usage, every
argument and option with its value, default and whether it is required, and the examples its --help ends with.

    python tools/cli_reference.py > docs/reference/cli.md

Plain Markdown, so the page reads the same on the docs site and on GitHub; tests/test_docs.py fails when the
committed page is not what this writes.
"""

from __future__ import annotations

import html

import click
from click.core import UNSET

from dattn_export.cli import main

ORDER = (
    "demo", "info", "convert", "verify", "quantize", "push", "onnx", "validate", "generate", "retrieve", "score",
    "analyze", "trt", "serve",
)  # fmt: skip
HEADER = """# CLI reference

Every command, argument and option, written from the commands themselves by `tools/cli_reference.py` (the tests
check that this page is current); every command also takes `-h`/`--help`. [What each command does](../commands.md)
says what they read and write.
"""


def text(value: str) -> str:
    """Help text as Markdown: `<image>` stays visible (not an HTML tag) and a table cell keeps its pipes."""
    return html.escape(" ".join(value.split()), quote=False).replace("|", "\\|")


def value_of(param: click.Parameter, context: click.Context) -> str:
    if isinstance(param, click.Option) and param.is_flag:
        return "flag"
    if isinstance(param.type, click.Choice):
        return " \\| ".join(f"`{choice}`" for choice in param.type.choices)
    if isinstance(param.type, click.types._NumberRangeBase):
        kind = "INTEGER" if isinstance(param.type, click.IntRange) else "FLOAT"
        return f"`{kind}` ({param.type._describe_range()})"
    metavar = param.type.get_metavar(param, context) or param.type.name.upper()
    return f"`{metavar}`" + (" (repeatable)" if getattr(param, "multiple", False) else "")


def default_of(param: click.Parameter, context: click.Context) -> str:
    default = param.get_default(context, call=False)
    if (
        default is None
        or default is UNSET
        or (isinstance(param, click.Option) and param.is_flag and not default)
        or default == ()
    ):
        return ""
    return f"`{default}`"


def names_of(param: click.Parameter) -> str:
    if isinstance(param, click.Argument):
        return f"`{param.make_metavar(click.Context(click.Command(''))).strip('[].')}` (argument)"
    return ", ".join(f"`{name}`" for name in [*param.opts, *param.secondary_opts])


def command_section(name: str, command: click.Command, parent: click.Context) -> str:
    context = click.Context(command, info_name=name, parent=parent)
    help_text, _, _ = (command.help or "").partition("\f")
    rows = []
    for param in command.get_params(context):
        if "--help" in getattr(param, "opts", ()):  # every command has it: said once, above
            continue
        required = "yes" if param.required else ""
        help_cell = text(getattr(param, "help", None) or "")
        rows.append(f"| {names_of(param)} | {value_of(param, context)} | {default_of(param, context)} | {required} | "
                    f"{help_cell} |")  # fmt: skip
    examples = [line.strip() for line in (command.epilog or "").splitlines() if line.strip().startswith("dattn-")]
    usage = " ".join(command.collect_usage_pieces(context))
    return "\n".join(
        [
            f"## dattn-export {name}",
            "",
            text(help_text),
            "",
            "```",
            f"dattn-export {name} {usage}",
            "```",
            "",
            "| argument or option | value | default | required | what it does |",
            "| --- | --- | --- | --- | --- |",
            *rows,
            "",
            "Examples:",
            "",
            "```bash",
            *examples,
            "```",
            "",
        ]
    )


def reference() -> str:
    context = click.Context(main, info_name="dattn-export")
    if set(ORDER) != set(main.list_commands(context)):  # a new command takes its place in the pipeline's order
        raise SystemExit(f"ORDER lists {sorted(ORDER)}, the CLI has {main.list_commands(context)}")
    sections = [command_section(name, main.get_command(context, name), context) for name in ORDER]
    return HEADER + "\n" + "\n".join(sections)


if __name__ == "__main__":
    print(reference(), end="")
