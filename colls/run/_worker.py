"""The wrapper every Python worker of colls-run runs: ``python -u -m colls.run._worker ...``.

It runs the user's program as ``python script.py args`` or ``python -m module args`` would (same
``sys.argv``, the script's directory first on ``sys.path``, ``__name__ == "__main__"``), and adds
one thing: when the program raises, the traceback also goes to the per-rank error file named by
``COLLS_ERROR_FILE``, so that the launcher can report which rank failed first and why.

Command line (built by colls.run.processes, not meant for people)::

    python -u -m colls.run._worker SCRIPT [ARG ...]
    python -u -m colls.run._worker -m MODULE [ARG ...]

Under ``--start-method fork`` there is no new interpreter: colls.run.forking calls :func:`main` with
the same arguments in a child forked from the launcher.

Only the standard library is imported here, and only what Python loads anyway on the success path,
because every worker pays this at startup.
"""

from __future__ import annotations

import os
import runpy
import sys
from types import TracebackType

#: Variable holding this rank's error file; set by colls-run (registered in colls.env.SETTINGS,
#: read straight from os.environ here so the wrapper does not import colls.env at startup).
ERROR_FILE_VAR = "COLLS_ERROR_FILE"

USAGE = "usage: python -m colls.run._worker (SCRIPT | -m MODULE) [ARG ...]"

#: Exit codes Python itself uses: uncaught exception, bad command line / missing script.
EXIT_EXCEPTION = 1
EXIT_USAGE = 2


def _parse(argv: list[str]) -> tuple[bool, str, list[str]] | None:
    """Return (is_module, script_or_module, args), or None when ``argv`` names no program."""
    if argv and argv[0] == "-m":
        return (True, argv[1], argv[2:]) if len(argv) > 1 else None
    return (False, argv[0], argv[1:]) if argv else None


def _script_path_entry(script: str) -> str:
    """Return what ``python script`` puts first on sys.path: the script's real directory.

    A directory or zip file with a ``__main__.py`` is itself put on sys.path (runpy does that too).
    """
    real = os.path.realpath(script)
    if os.path.isdir(real) or (not real.endswith(".py") and _is_zip(real)):
        return real
    return os.path.dirname(real)


def _is_zip(path: str) -> bool:
    import zipfile  # only for the rare zip-application case

    return zipfile.is_zipfile(path)


def _run(is_module: bool, target: str, args: list[str]) -> None:
    """Run the user's program in this interpreter as ``__main__``."""
    sys.argv = [target, *args]
    if is_module:
        if not getattr(sys.flags, "safe_path", False):  # -P / PYTHONSAFEPATH: python -m adds none
            # What ``python -m module`` does. ``python -m colls.run._worker`` did it already; a
            # worker forked from the launcher has the launcher's own first entry there instead.
            sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = _script_path_entry(target)
        # An absolute path gives __file__ and tracebacks the absolute path, as in Python >= 3.9.
        runpy.run_path(os.path.abspath(target), run_name="__main__")


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """Drop the frames of this wrapper and of runpy, as ``python script.py`` shows none of them."""
    own = (globals(), vars(runpy))
    while tb is not None and any(tb.tb_frame.f_globals is g for g in own):
        tb = tb.tb_next
    return tb


def _record_failure(exc: Exception, is_module: bool) -> int:
    """Print ``exc`` as Python would, write it to the error file, and return the exit code."""
    tb = _user_traceback(exc.__traceback__)
    printed = False
    if tb is None and is_module and isinstance(exc, ImportError):
        # runpy could not find the module: Python prints one line, not a traceback.
        print(f"{sys.executable}: {exc}", file=sys.stderr)
    else:
        # The default hook prints exc.__traceback__ when set, so trim it on the exception itself.
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        printed = True  # by the hook (Python's, or one chained to it as colls' are)
    path = os.environ.get(ERROR_FILE_VAR)
    if path:
        import traceback

        from colls.run.failures import write_error_file

        text = "".join(traceback.format_exception(type(exc), exc, tb))
        try:
            write_error_file(path, exc, text, printed=printed)
        except OSError as write_exc:
            print(f"colls-run: cannot write error file {path!r}: {write_exc}", file=sys.stderr)
    return EXIT_EXCEPTION


def main(argv: list[str] | None = None) -> int:
    """Run the program named on the command line; return 0, or 1 when it raised.

    SystemExit (``sys.exit(3)``) and KeyboardInterrupt pass through untouched, so the exit code
    is the program's own.
    """
    parsed = _parse(sys.argv[1:] if argv is None else argv)
    if parsed is None:
        print(USAGE, file=sys.stderr)
        return EXIT_USAGE
    is_module, target, args = parsed
    if not is_module and not os.path.exists(target):
        print(
            f"{sys.executable}: can't open file {os.path.abspath(target)!r}: "
            "[Errno 2] No such file or directory",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        _run(is_module, target, args)
    except Exception as exc:  # any uncaught error of the user's program, as Python reports it
        return _record_failure(exc, is_module)
    return 0


if __name__ == "__main__":
    sys.exit(main())
