"""Help text for the command lines (`python -m strata_jax`, `python -m strata_jax.bench`): every option's help
states its default, written once by the formatter instead of by hand in each help string."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any


def shown_default(value: Any) -> str:
    """A default as the command line would take it: lists and tuples comma-separated."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


class DefaultsFormatter(argparse.HelpFormatter):
    """Wraps description and epilog paragraphs but keeps blocks with indented lines (lists, tables) as written;
    appends "(default: X)" to an option's help unless the help already says what its default is. Switches
    (`store_true`) read "(default: off)"."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks = []
        for block in text.split("\n\n"):
            lines = block.splitlines()
            if any(line[:1].isspace() for line in lines[1:]) or any(line[:1].isspace() for line in lines[:1]):
                blocks.append("\n".join(indent + line for line in lines))
            else:
                blocks.append(textwrap.fill(" ".join(lines), width, initial_indent=indent, subsequent_indent=indent))
        return "\n\n".join(blocks)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text.lower():
            return text
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            return text
        if action.const is True and action.default is False:
            return f"{text} (default: off)"
        if action.default is None or action.required:
            return text
        return f"{text} (default: {shown_default(action.default).replace('%', '%%')})"


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """Options of `parser` (and its subcommands) whose help is missing or does not state a default that they have:
    what a test asserts is empty."""
    missing = []
    formatter = DefaultsFormatter(parser.prog)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                missing += undocumented(sub)
            continue
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        text = formatter._get_help_string(action)
        if not (action.help or "").strip():
            missing.append(f"{parser.prog} {action.option_strings[-1]}: no help")
        elif action.default not in (None, argparse.SUPPRESS) and "default" not in text.lower():
            missing.append(f"{parser.prog} {action.option_strings[-1]}: default {action.default!r} not stated")
        elif action.default is None and not action.required and "default" not in text.lower() and \
                action.nargs != 0:
            missing.append(f"{parser.prog} {action.option_strings[-1]}: no default stated (say what leaving it "
                           "out does)")
    return missing
