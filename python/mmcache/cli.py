"""The ``mmcache`` command: ``simulate`` (the main job), ``bench``, ``inspect`` and ``prune``.

It needs the ``cli`` extra (``pip install 'mmcache[cli]'``: rich for its tables, msgpack for
simulate's messages); this module imports neither until :func:`main` has checked them.

Exit status: 0 on success; 1 when a run failed (wrong tensors, an unrecovered drift, a
process that died, a segment that cannot be read) or its ``--json``/``--plot`` file could not
be written after it (the table is still shown); 2 for invalid flags (an output file that cannot
be created among them, found before the run), a configuration that cannot run or a missing
``cli`` extra, with one line on stderr saying why; 130 after Ctrl-C; 143 after SIGTERM, which
stops a run as Ctrl-C does; 141 (128 + SIGPIPE), quietly, when stdout was closed before the
output was written (``| head -1``; the files of ``--json`` and ``--plot`` are written before
the table).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from textwrap import fill
from typing import TYPE_CHECKING, Any, NoReturn

from mmcache.signals import Terminated, sigterm_raises

if TYPE_CHECKING:
    from rich.console import Console

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
#: What the shell reports for a command that SIGTERM killed.
EXIT_TERMINATED = 128 + 15
#: What the shell reports for a command that SIGPIPE killed.
EXIT_BROKEN_PIPE = 128 + 13

CLI_EXTRA_MODULES = ("rich", "msgpack")
"""What the ``cli`` extra installs and the commands import."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _UsageError(Exception):
    """A flag combination that cannot work, found after parsing (exit status 2)."""


_SIMULATE_EXAMPLES = """\
examples:
  mmcache simulate                          the default workload in shm mode (under a minute)
  mmcache simulate --compare --json out.json --plot out.png
                                            none, processor_only, lru and shm side by side
  mmcache simulate --mode lru --inject-drift 0.05
                                            lose 5% of P0's updates and watch the retries
  mmcache simulate --requests 200 --catalogue 100 --workers 4 --capacity-gb 0.25
  mmcache simulate --remote redis://auto --hosts 2 --compare
                                            two hosts sharing a real Valkey started for the
                                            run, with and without the remote tier
  mmcache simulate --remote redis://cache.internal:6379 --hosts 2
  mmcache simulate --frontends 2 --compare
                                            two P0s sharing one store (single flight) beside
                                            one P0, and the other modes
"""
_BENCH_EXAMPLES = """\
examples:
  mmcache bench                 put/get/lookup for 4 KiB .. 16 MiB, 1 to 4 reader processes
  mmcache bench --quick --json bench.json
"""
_INSPECT_EXAMPLES = """\
examples:
  mmcache inspect               list the segments mmcache created on this host
  mmcache inspect NAME          one of them, e.g. while `mmcache simulate` runs in another shell
  mmcache inspect NAME --json
"""
_PRUNE_EXAMPLES = """\
examples:
  mmcache prune --dry-run       list the segments whose writers all died
  mmcache prune                 remove them
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _parser() -> _Parser:
    from mmcache.simulate import MODES, SimulationConfig

    defaults = SimulationConfig()
    parser = _Parser(
        prog="mmcache",
        description="Multimodal processor caches and a shared-memory object store for LLM serving.",
        epilog="Run `mmcache COMMAND --help` for a command's options and examples.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    formatter = argparse.RawDescriptionHelpFormatter

    sim = commands.add_parser(
        "simulate",
        help="run a real multi-process serving pipeline and report what the cache saves",
        description=fill(
            "Run P0 (frontend), P1 (engine core) and worker processes on this machine over a "
            "seeded stream of image requests, with real processing, and report throughput, "
            "latency, hit ratio, bytes moved and saved, retries and wrong tensors (which must "
            "be 0)."
        ),
        epilog=_SIMULATE_EXAMPLES,
        formatter_class=formatter,
    )
    sim.add_argument("--mode", choices=MODES, help=f"cache mode (default: {defaults.mode})")
    sim.add_argument(
        "--compare",
        action="store_true",
        help="run every mode on the same workload, side by side; with --remote: the mode "
        "with and without the remote tier; with --frontends N: also the mode with one frontend",
    )
    sim.add_argument(
        "--requests",
        type=_positive_int,
        default=defaults.requests,
        help="requests to serve (default: %(default)s)",
    )
    sim.add_argument(
        "--catalogue",
        type=_positive_int,
        default=defaults.catalogue,
        help="distinct images (default: %(default)s)",
    )
    sim.add_argument(
        "--zipf",
        type=float,
        default=defaults.zipf,
        help="popularity skew; 0 is uniform (default: %(default)s)",
    )
    sim.add_argument(
        "--max-items",
        type=_positive_int,
        default=defaults.max_items,
        help="images per request, at most (default: %(default)s)",
    )
    sim.add_argument(
        "--capacity-gb",
        type=float,
        default=defaults.capacity_gb,
        help="cache capacity in GiB (default: %(default)s)",
    )
    sim.add_argument(
        "--workers",
        type=int,
        default=defaults.workers,
        help="worker processes, i.e. readers (default: %(default)s)",
    )
    sim.add_argument(
        "--inflight",
        type=_positive_int,
        default=defaults.inflight,
        help="requests in flight at once, at most 256 (default: %(default)s)",
    )
    sim.add_argument(
        "--inject-drift",
        type=float,
        default=defaults.inject_drift,
        metavar="RATE",
        help="fraction of requests lost after P0 updated its cache (default: %(default)s)",
    )
    sim.add_argument(
        "--seed", type=int, default=defaults.seed, help="workload seed (default: %(default)s)"
    )
    sim.add_argument(
        "--remote",
        metavar="URL",
        help="share processed items between the hosts through this store: redis://HOST:PORT, "
        "valkey://HOST:PORT, mooncake://HOST:PORT, or redis://auto (valkey://auto, "
        "mooncake://auto) to start a server for the run",
    )
    sim.add_argument(
        "--hosts",
        type=_positive_int,
        default=defaults.hosts,
        help="independent pipelines (each its own P0, P1, workers and ring) standing in for "
        "hosts; requests are per host (default: %(default)s)",
    )
    sim.add_argument(
        "--frontends",
        type=_positive_int,
        default=defaults.frontends,
        help="P0 processes per host, each serving its turn of the requests, all sending to "
        "the same P1 and workers; in shm mode they share one store, in single flight (lru "
        "cannot: its P1 mirrors one P0; with --compare it runs with one) (default: %(default)s)",
    )
    sim.add_argument(
        "--claim-wait-s",
        type=float,
        default=defaults.claim_wait_s,
        metavar="SECONDS",
        help="how long a frontend waits for an item another frontend (or host, with --remote) "
        "is processing before processing it itself (default: %(default)s)",
    )
    sim.add_argument("--json", type=Path, metavar="PATH", help="write the figures as JSON")
    sim.add_argument(
        "--plot",
        type=Path,
        metavar="PATH",
        help="write a chart of throughput and latency: a PNG, or the format PATH's extension "
        "names (.svg, .pdf, ...) (needs matplotlib)",
    )
    sim.set_defaults(run=_simulate, command_parser=sim)

    bench = commands.add_parser(
        "bench",
        help="micro-benchmarks of the shared-memory store",
        description=fill(
            "Time put, get (copy and zero-copy) and lookup of the shared-memory store "
            "by payload size and number of reader processes, each also as a multiple of a numpy "
            "memcpy of the same size measured in the same run."
        ),
        epilog=_BENCH_EXAMPLES,
        formatter_class=formatter,
    )
    bench.add_argument(
        "--quick", action="store_true", help="a short run (fewer sizes' repetitions, 1-2 readers)"
    )
    bench.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    bench.set_defaults(run=_bench, command_parser=bench)

    inspect = commands.add_parser(
        "inspect",
        help="show a live segment's occupancy, objects, references and counters",
        description=fill(
            "Read a live segment's header (without attaching as a reader or writing "
            "to it) and print its capacity, bytes in use, objects, counters, its writer slots "
            "(who lives) and outstanding references per reader."
        ),
        epilog=_INSPECT_EXAMPLES,
        formatter_class=formatter,
    )
    inspect.add_argument(
        "name", nargs="?", help="the segment's name; without it, list the segments"
    )
    inspect.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    inspect.set_defaults(run=_inspect, command_parser=inspect)

    prune = commands.add_parser(
        "prune",
        help="remove segments left behind by dead processes",
        description=fill(
            "Find the segments mmcache created on this host whose writers all died, and "
            "remove them."
        ),
        epilog=_PRUNE_EXAMPLES,
        formatter_class=formatter,
    )
    prune.add_argument("--dry-run", action="store_true", help="only list them")
    prune.set_defaults(run=_prune, command_parser=prune)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mmcache`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit
    status."""
    missing = _missing_cli_module()
    if missing is not None:
        print(
            f"mmcache: error: the command needs {missing}, which is not installed: "
            "pip install 'mmcache[cli]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Refused by the command's own parser, so the message sends the user to the help
        # that lists its flags (the top-level parser would name `mmcache --help`).
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    prog = f"mmcache {args.command}"
    try:
        with sigterm_raises():
            status = int(args.run(args))
            sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return status
    except _UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except BrokenPipeError:
        # Whoever read stdout has gone (`| head -1`): stop quietly, as a tool killed by
        # SIGPIPE. What is still buffered goes to /dev/null, or the flush at exit fails
        # again (https://docs.python.org/3/library/signal.html#note-on-sigpipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _missing_cli_module() -> str | None:
    """The first module of the ``cli`` extra that cannot be imported, or ``None``."""
    for name in CLI_EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return None


def _stdout_console() -> Console:
    """A rich console on stdout that lets :func:`main` handle a closed pipe (rich's own
    handling exits with status 1, which says a run failed)."""
    from rich.console import Console

    class _StdoutConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True  # nothing more to draw
            raise BrokenPipeError

    return _StdoutConsole()


def _check_output(path: Path | None, flag: str) -> None:
    """Refuse an output path before the run, not after it."""
    if path is None:
        return
    try:
        if path.is_dir():
            raise _UsageError(f"{flag} {path}: is a directory (give a file name)")
        if not path.parent.is_dir():
            raise _UsageError(f"{flag} {path}: directory {path.parent} does not exist")
        if path.exists():
            # Not opened: it may be a FIFO or a device, which an open could block on or
            # disturb. What the run writes into it is checked then (`_write_output`).
            if not os.access(path, os.W_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        else:
            # A file the directory cannot take (a read-only directory or file system, a name
            # too long): found by making it, and removed again so a run that fails leaves
            # nothing behind.
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            path.unlink()
    except OSError as exc:
        raise _UsageError(f"{flag} {path}: cannot be written ({exc.strerror or exc})") from None


def _check_plot_format(path: Path) -> None:
    """Refuse, before the run, a ``--plot`` name whose extension matplotlib cannot write (it
    picks the format by the extension; none is a PNG: see ``write_plot``)."""
    from matplotlib.backend_bases import FigureCanvasBase

    from mmcache.simulate.report import plot_format

    if plot_format(path) not in FigureCanvasBase.get_supported_filetypes():
        raise _UsageError(
            f"--plot {path}: matplotlib cannot write a {path.suffix} file; "
            "name it .png (or .svg, .pdf, ...)"
        )


def _write_output(path: Path, flag: str, write: Callable[[], object]) -> str | None:
    """Run ``write`` (which writes ``path``); the one-line error to print if it failed (a
    disk that filled up during the run), so that the run's table is still shown."""
    try:
        write()
    except OSError as exc:
        return f"{flag} {path}: cannot be written ({exc.strerror or exc})"
    return None


# --------------------------------------------------------------------------------------------
# simulate


def _simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from mmcache.simulate import ConfigError, SimulationConfig, SimulationError, run_configs
    from mmcache.simulate.report import render, write_json, write_plot

    _check_output(args.json, "--json")
    _check_output(args.plot, "--plot")
    if args.json and args.plot and args.json.resolve() == args.plot.resolve():
        # The chart would be written over the figures.
        raise _UsageError(
            f"--json {args.json} and --plot {args.plot} name the same file (give each its own)"
        )
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise _UsageError("--plot needs matplotlib: pip install 'mmcache[plot]'")
    if args.plot is not None:
        _check_plot_format(args.plot)
    if args.compare and args.mode is not None and args.remote is None:
        raise _UsageError(
            "argument --compare: not allowed with argument --mode (it runs every mode; with "
            "--remote it compares one mode with and without the remote tier)"
        )
    config = SimulationConfig(
        mode=args.mode or SimulationConfig.mode,
        requests=args.requests,
        catalogue=args.catalogue,
        zipf=args.zipf,
        max_items=args.max_items,
        capacity_gb=args.capacity_gb,
        workers=args.workers,
        inflight=args.inflight,
        inject_drift=args.inject_drift,
        seed=args.seed,
        remote=args.remote,
        hosts=args.hosts,
        frontends=args.frontends,
        claim_wait_s=args.claim_wait_s,
    )
    configs = config.compared() if args.compare else [config]
    out = _stdout_console()
    err = Console(stderr=True)
    columns = (
        TextColumn("{task.description:<24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as progress:
        tasks: dict[str, Any] = {}

        def on_progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = progress.add_task(f"{label} requests", total=total)
            progress.update(tasks[label], completed=done)

        try:
            runs = run_configs(configs, on_progress)
        except ConfigError as exc:
            raise _UsageError(str(exc)) from None
        except SimulationError as exc:
            print(f"mmcache simulate: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
    # The files first: a table drawn into a pipe closed early must not lose them.
    unwritten = []
    if args.json is not None:
        unwritten.append(
            _write_output(args.json, "--json", lambda: write_json(args.json, config, runs))
        )
    if args.plot is not None:
        unwritten.append(_write_output(args.plot, "--plot", lambda: write_plot(args.plot, runs)))
    render(config, runs, out)
    failed = [run for run in runs if not run.ok]
    for run in failed:
        print(
            f"mmcache simulate: error: {run.label}: {run.wrong_tensors} wrong tensors, "
            f"{run.unrecovered} requests not recovered by one retry",
            file=sys.stderr,
        )
    errors = [error for error in unwritten if error is not None]
    for error in errors:
        print(
            f"mmcache simulate: error: {error}; the figures are in the table above",
            file=sys.stderr,
        )
    return EXIT_FAILED if failed or errors else 0


# --------------------------------------------------------------------------------------------
# bench


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mmcache.bench import render, run_benchmarks
    from mmcache.errors import ShmTooSmallError

    _check_output(args.json, "--json")
    err = Console(stderr=True)
    status = (
        err.status("benchmarking the shared-memory store") if err.is_terminal else nullcontext()
    )
    try:
        with status:
            results = run_benchmarks(quick=args.quick)
    except ShmTooSmallError as exc:
        # Docker's default /dev/shm (64 MiB) holds none of the benchmarks' larger rings.
        print(f"mmcache bench: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    error = None
    if args.json is not None:  # before the table (see `_simulate`)
        rows = json.dumps([r.to_dict() for r in results], indent=2) + "\n"
        error = _write_output(args.json, "--json", lambda: args.json.write_text(rows))
    render(results, _stdout_console())
    if error is not None:
        print(f"mmcache bench: error: {error}; the figures are in the table above", file=sys.stderr)
        return EXIT_FAILED
    return 0


# --------------------------------------------------------------------------------------------
# inspect and prune


def _shown(name: str) -> str:
    """A segment name as the commands print it: as it is, or, if it has control characters,
    as a Python string literal. Anyone may name a file in ``/dev/shm`` (and ``mmc_`` files are
    listed whatever they hold): its escape sequences must not drive the reader's terminal."""
    return name if name.isprintable() else ascii(name)


def _inspect(args: argparse.Namespace) -> int:
    from rich.table import Table
    from rich.text import Text

    from mmcache import MmcacheError
    from mmcache.maintenance import inspect

    if args.name is None:
        return _list_segments(as_json=args.json)
    try:
        info = inspect(args.name)
    except FileNotFoundError:
        print(f"mmcache inspect: error: no segment named {args.name!r}", file=sys.stderr)
        return EXIT_FAILED
    except (MmcacheError, OSError, ValueError) as exc:
        # Not a segment (a FIFO, a directory, a link, a path outside /dev/shm), or corrupt.
        print(f"mmcache inspect: error: {_shown(args.name)}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    console = _stdout_console()
    if args.json:
        console.print_json(json.dumps(info, default=str))
        return 0
    readers = info.pop("readers", [])
    writers = info.pop("writers", [])
    # A `Text`, not a string: rich would take markup (`[bold]`) and emoji codes in the name
    # for its own and print another name.
    summary = Table(
        title=Text(f"segment {_shown(args.name)}"), title_justify="left", show_header=False
    )
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    for key in ("capacity", "bytes_in_use", "occupancy", "objects", "creator_pid", "creator_alive"):
        if key in info:
            summary.add_row(key, _format_value(key, info.pop(key)))
    info.pop("name", None)
    for key, value in sorted(info.items()):
        summary.add_row(key, _format_value(key, value))
    console.print(summary)
    for title, slots, wanted in (
        ("writers", writers, _WRITER_COLUMNS),
        ("readers", readers, _READER_COLUMNS),
    ):
        if slots:
            table = Table(title=title, title_justify="left")
            columns = [c for c in wanted if any(c in slot for slot in slots)]
            for column in columns:
                table.add_column(column, justify="right")
            for slot in slots:
                table.add_row(*(_format_value(c, slot.get(c, "")) for c in columns))
            console.print(table)
    return 0


def _list_segments(*, as_json: bool) -> int:
    """Every segment on this host and its status: lines, or (``--json``) a JSON list of
    ``{"name", "status", "why"}``."""
    from mmcache import MmcacheError, _core

    listed = []
    for name in sorted(_core.list_segments()):
        try:
            status, why = _core.segment_status(name)
        except (OSError, MmcacheError) as exc:
            status, why = "unreadable", str(exc)
        listed.append({"name": name, "status": status, "why": why})
    if as_json:
        print(json.dumps(listed, indent=2))
        return 0
    if not listed:
        print("no mmcache segment on this host")
    for entry in listed:
        state = {
            "live": "live",
            "orphaned": f"orphaned ({entry['why']}: `mmcache prune` removes it)",
            "undecided": f"left alone ({entry['why']})",
            "unreadable": f"unreadable ({entry['why']})",
        }[entry["status"]]
        print(f"{_shown(entry['name'])}  {state}")
    return 0


_SIZES = ("capacity", "max_object_size", "total_len")
# ``claimed`` is left out: ``state`` says it (and more).
_READER_COLUMNS = ("slot", "state", "pid", "alive", "refs", "acks", "outstanding", "stale")
_WRITER_COLUMNS = ("slot", "state", "pid", "epoch", "alive")


def _format_value(key: str, value: object) -> str:
    """A figure of ``inspect``: sizes in bytes and MiB, counts with separators."""
    if key == "occupancy" and isinstance(value, float):
        return f"{value:.1%}"
    if not isinstance(value, int) or isinstance(value, bool):
        return str(value)
    if "bytes" in key or key in _SIZES:
        return f"{value:,} B ({value / 2**20:,.1f} MiB)"
    return f"{value:,}"


def _prune(args: argparse.Namespace) -> int:
    from mmcache.maintenance import prune

    names = prune(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for name in names:
        print(f"{verb} {_shown(name)}")
    if not names:
        print("no segment left behind by a dead process")
    return 0
