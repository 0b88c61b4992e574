"""`halfmoon` command line: generate, serve, client, profile, bench, sim, dashboard."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from types import ModuleType

# Before grpc is imported: gRPC's fork handlers only matter to a child that goes on using gRPC
# without exec. Ray starts its processes with fork + exec while the driver's gRPC threads run,
# and with the handlers on, gRPC logs "Other threads are currently calling into gRPC, skipping
# fork() handlers" for each one (ray-project/ray#24917) — noise in `halfmoon serve`'s first lines.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from halfmoon.core.errors import HalfmoonError  # noqa: E402

# Command -> (module, one-line help). A command's module adds its parser (`add_parser`) and runs
# it (`run`); only the command being run builds its parser, so `halfmoon client` never imports
# torch to build the engine commands' flags.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("halfmoon.cli.generate", "generate from one prompt with the local engine"),
    "serve": ("halfmoon.cli.serve", "serve the model over gRPC and OpenAI-compatible HTTP (Ctrl-C stops)"),
    "client": ("halfmoon.cli.client", "call a running server over gRPC (generate, chat, models, tokenize)"),
    "profile": ("halfmoon.cli.profile", "profile the engine and write its cost model (JSON)"),
    "bench": ("halfmoon.cli.bench", "benchmarks (each measures its baseline in the same run)"),
    "sim": ("halfmoon.cli.sim", "replay a trace through a simulated cluster (sim sweep: size the pools)"),
    "dashboard": ("halfmoon.cli.dashboard", "print (--open: open) the operator dashboard of a running cluster"),
}


def command_module(name: str) -> ModuleType:
    import importlib

    return importlib.import_module(COMMANDS[name][0])


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or only of command `only` (the others, all of them when
    `only` is no command, are listed for --help without their options)."""
    parser = argparse.ArgumentParser(prog="halfmoon", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        if only is None or name == only:
            command_module(name).add_parser(sub.add_parser(name, help=help_text))
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of one command inside `build_parser()`'s."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; a `--config` YAML fills the options no flag or env var set."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    parser = build_parser(only=command)
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is not None:
        from halfmoon.cli.flags import apply_config_file

        module = command_module(args.command)
        apply_config_file(subparser(parser, args.command), args.config, module.env_dests())
        args = parser.parse_args(argv)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        return command_module(args.command).run(args)
    except HalfmoonError as e:
        print(f"halfmoon: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
