"""Command line of colls-run (also ``python -m colls.run``): torchrun's flags, a LaunchConfig out.

Only the static, single-attempt part of torchrun is offered: a fixed number of nodes, each
starting ``--nproc-per-node`` workers that meet at ``--master-addr:--master-port``. There is no
elastic rendezvous and no restart of the whole job; ``--on-failure shrink|replace`` (colls' own)
lets the job go on when a worker dies, and replaces it. See docs/launcher.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from colls import env
from colls.run.config import (
    DEFAULT_MAX_REPLACEMENTS,
    ON_FAILURE_MODES,
    START_METHODS,
    STORE_HOSTS,
    LaunchConfig,
    find_free_port,
    job_token,
)
from colls.run.processes import SignalCatcher, launch

PROG = "colls-run"

EPILOG = """\
Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT, COLLS_STORE_PORT (when the launcher serves the store) and COLLS_ERROR_FILE.
When a worker fails, the others are stopped and the first failing rank is reported with its
exit code and traceback; colls-run exits with that code. With --on-failure shrink or replace,
the others go on instead (a replacement gets COLLS_JOIN=1 and COLLS_INCARNATION=n).
"""


def _count(flag: str, hint: str = "") -> Callable[[str], int]:
    """Return an argparse type that accepts a positive integer for ``flag``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a positive integer, got {text!r}{hint}"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
        return value

    parse.__name__ = flag  # argparse names the type in some messages
    return parse


def _non_negative(flag: str) -> Callable[[str], int]:
    """Return an argparse type that accepts an integer >= 0 for ``flag``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= 0, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
        return value

    parse.__name__ = flag
    return parse


def _pet(dest: str, default: object) -> object:
    """Return the default of flag ``dest``: ``$PET_<DEST>`` if set, as torchrun reads it.

    Kubeflow's Trainer v2 and JobSet pass torchrun's arguments as these variables. A string
    default is parsed by the flag's type, as a value given on the command line would be.
    """
    value = os.environ.get(f"PET_{dest.upper()}", "").strip()
    return value if value else default


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of colls-run (torchrun's spelling of every flag it shares)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Start N worker processes per node for colls (torchrun-compatible flags).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # a script's --n must never be taken for --nproc-per-node
    )
    parser.add_argument(
        "--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", metavar="N",
        type=_count("nproc-per-node", " (torchrun's auto/cpu/gpu are not supported)"),
        default=_pet("nproc_per_node", 1),
        help="workers to start on this node (default: $PET_NPROC_PER_NODE, else 1)",
    )
    parser.add_argument(
        "--nnodes", metavar="N", default=_pet("nnodes", 1),
        type=_count("nnodes", " (elastic ranges such as 1:4 are not supported)"),
        help="nodes in the job (default: $PET_NNODES, else 1)",
    )
    parser.add_argument(
        "--node-rank", "--node_rank", dest="node_rank", metavar="R", type=int,
        default=_pet("node_rank", 0),
        help="rank of this node, 0 <= R < nnodes (default: $PET_NODE_RANK, else 0)",
    )
    parser.add_argument(
        "--master-addr", "--master_addr", dest="master_addr", metavar="HOST",
        default=_pet("master_addr", "127.0.0.1"),
        help="address of the node running rank 0 (default: $PET_MASTER_ADDR, else 127.0.0.1)",
    )
    parser.add_argument(
        "--master-port", "--master_port", dest="master_port", metavar="PORT", type=int,
        default=_pet("master_port", None),
        help="port on the master address; default: $PET_MASTER_PORT, else a free port (single "
        "node only; required with --nnodes > 1)",
    )
    parser.add_argument(
        "--standalone", action="store_true",
        help="single node, with a free port chosen for the workers' rendezvous",
    )
    parser.add_argument(
        "--store-host", dest="store_host", choices=STORE_HOSTS, default=None,
        help="who serves the job's TCPStore. launcher: colls-run on node 0, on --master-addr "
        ":--store-port, exported as COLLS_STORE_PORT (no rank then holds a connection per "
        "rank, and MASTER_PORT stays free for torch.distributed). rank0: rank 0, on "
        "--master-port, as torch's env://. Default: launcher on a single node, and with "
        "--nnodes > 1 when --store-port is given; rank0 otherwise",
    )
    parser.add_argument(
        "--store-port", dest="store_port", metavar="PORT", type=int, default=None,
        help="port of the launcher's store on --master-addr; default: a free port (single "
        "node only; with --nnodes > 1 give every node the same one)",
    )
    parser.add_argument(
        "-m", "--module", action="store_true",
        help="run the script argument as a Python module, like 'python -m'",
    )
    parser.add_argument(
        "--no-python", "--no_python", dest="no_python", action="store_true",
        help="run the script argument as a program, not through the Python interpreter",
    )
    parser.add_argument(
        "--tag-output", "--tag_output", dest="tag_output", action="store_true",
        help="prefix every output line of a worker with '[rank N]: '",
    )
    parser.add_argument(
        "--start-method", "--start_method", dest="start_method", choices=START_METHODS,
        default=None,
        help="fork: Python workers are forked from colls-run after it imported NumPy and colls "
        "once (fast startup); exec: each worker is a fresh interpreter. Default: "
        "$COLLS_START_METHOD, else fork. --no-python and PYTHON_EXEC always exec",
    )
    parser.add_argument(
        "--on-failure", dest="on_failure", choices=ON_FAILURE_MODES, default="stop",
        help="when a worker dies (non-zero exit or a signal) while others of this node run: "
        "stop them all and report it (stop, the default, as torchrun); let the job go on "
        "without it (shrink: the survivors call colls.shrink_group); or go on and start a "
        "replacement in its slot that joins the job (replace: COLLS_JOIN=1, "
        "COLLS_INCARNATION=n; the survivors call colls.grow_group). shrink and replace need "
        "--store-host launcher",
    )
    parser.add_argument(
        "--max-replacements", dest="max_replacements", metavar="N",
        type=_non_negative("max-replacements"), default=DEFAULT_MAX_REPLACEMENTS,
        help="with --on-failure replace: replacements this colls-run starts at most; later "
        f"deaths are survived as with shrink (default: {DEFAULT_MAX_REPLACEMENTS})",
    )
    parser.add_argument("script", help="the script (module with -m, program with --no-python)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    return parser


def _resolve_port(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Return the MASTER_PORT to export, choosing a free one where that is allowed."""
    if args.standalone:
        if args.nnodes != 1:
            parser.error(f"--standalone means a single node, but --nnodes is {args.nnodes}")
        if args.master_port is not None:
            print(
                f"{PROG}: --standalone chooses a free port; ignoring --master-port "
                f"{args.master_port}",
                file=sys.stderr,
            )
        args.master_port = None
    if args.master_port is not None:
        return int(args.master_port)
    if args.nnodes > 1:
        parser.error(
            f"--master-port is required when --nnodes > 1 (got --nnodes {args.nnodes}): every "
            "node must be given the same port on --master-addr"
        )
    try:
        return find_free_port(args.master_addr)
    except ValueError as exc:
        parser.error(str(exc).removeprefix(f"{PROG}: "))


def _resolve_store_port(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int | None:
    """Return where the launcher serves the job's store (0: a free port), or None: rank 0 does."""
    host = args.store_host
    if host is None:  # a multi-node job serves it from a launcher only when told where
        host = "launcher" if args.nnodes == 1 or args.store_port is not None else "rank0"
    if host == "rank0":
        if args.store_port is not None:
            parser.error(f"--store-port {args.store_port} is for --store-host launcher, but "
                         "--store-host is rank0 (rank 0 serves the store on --master-port)")
        return None
    if args.store_port is None and args.nnodes > 1:
        parser.error(f"--store-host launcher with --nnodes {args.nnodes} needs --store-port: "
                     "every node must be given the same port on --master-addr")
    return 0 if args.store_port is None else int(args.store_port)


def _resolve_start_method(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """Return --start-method, or COLLS_START_METHOD's value (default fork) when not given."""
    if args.start_method is not None:
        return str(args.start_method)
    try:
        return str(env.get("COLLS_START_METHOD"))
    except ValueError as exc:
        parser.error(str(exc))


def split_at_script(parser: argparse.ArgumentParser, argv: Sequence[str]
                    ) -> tuple[list[str], list[str]]:
    """Split ``argv`` into colls-run's own arguments (up to the script) and the script's.

    Everything after the script goes to it unchanged, even options that colls-run also has
    (``heat.py --nnodes 5``) or that argparse would read as one of its flags; argparse alone
    parses options wherever they stand. The script is the first argument that is neither an
    option nor an option's value (after ``--``, the next argument).
    """
    takes_value = {
        name for action in parser._actions for name in action.option_strings
        if action.nargs != 0
    }
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]) + list(argv[i + 1:i + 2]), list(argv[i + 2:])
        if not arg.startswith("-") or arg == "-":
            return list(argv[:i + 1]), list(argv[i + 1:])
        if arg in takes_value:
            i += 1  # its value, whatever it looks like
        i += 1
    return list(argv), []


def parse_config(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Parse a colls-run command line into a LaunchConfig.

    Raises:
        SystemExit: the command line is invalid (status 2, with a message naming the flag and
            value), or --help was given (status 0).
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher, script_args = split_at_script(parser, argv)
    args = parser.parse_args(launcher)
    args.script_args = script_args
    port = _resolve_port(parser, args)
    start_method = _resolve_start_method(parser, args)
    if not (args.module or args.no_python or os.path.exists(args.script)):
        parser.error(
            f"script {args.script!r} does not exist (use -m to run a module, --no-python to run "
            "a program)"
        )
    try:
        return LaunchConfig(
            script=args.script,
            script_args=tuple(args.script_args),
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=port,
            module=args.module,
            no_python=args.no_python,
            tag_output=args.tag_output,
            start_method=start_method,
            auth_token=job_token(args.nnodes, os.environ),
            store_port=_resolve_store_port(parser, args),
            on_failure=args.on_failure,
            max_replacements=args.max_replacements,
        )
    except ValueError as exc:
        parser.error(str(exc).removeprefix(f"{PROG}: "))


def main(argv: Sequence[str] | None = None) -> int:
    """Run colls-run with ``argv`` (``sys.argv[1:]`` when None) and return its exit code.

    Returns:
        0 when every worker succeeded (with --on-failure shrink or replace: when every failure
        was survived, see colls.run.replacing); the first failing worker's exit code (128 + N
        when it was killed by signal N); 128 + N when colls-run itself got signal N (130 for
        Ctrl-C); 2 for a bad command line.
    """
    try:
        config = parse_config(argv)
    except SystemExit as exc:  # argparse's --help and usage errors
        return exc.code if isinstance(exc.code, int) else 1
    with SignalCatcher() as signals:
        return launch(config, signals)
