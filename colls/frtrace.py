"""colls-frtrace: read the flight recorder dumps of a job and say which rank is stuck, and where.

``colls-frtrace DIR`` reads every rank's dump (:mod:`colls.flight_recorder`; torch's format, so
dumps of torch's own recorder are read too) and prints a one-line verdict first, then the
details: for each group, the first call where the ranks diverge, which ranks never entered it
and what each was doing instead (its last call and its stack, and where its main thread was
when it dumped), op, size and dtype mismatches, and the ranks whose dump is absent (a rank that
holds the GIL in its own compute cannot dump: it is then the likely culprit). ``--json`` prints
the same as one JSON object.

Needs nothing but the standard library: the dumps are pickles of plain dicts, lists and strings.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

_RANK_FILE = re.compile(r"^([\w\-]*?)(\d+)$")

#: How the verdict names the kinds of divergence, most telling first.
ABSENT, MISMATCH, MISSING, UNFINISHED = "absent", "mismatch", "missing", "unfinished"


@dataclass
class Divergence:
    """The first call of one group where the ranks' records disagree."""

    group: str
    desc: str
    ranks: list[int]
    seq: int
    kind: str
    op: str
    #: ranks that entered the call, by what they called ("all_reduce float32[2]": [0, 1]).
    variants: dict[str, list[int]] = field(default_factory=dict)
    culprits: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    absent: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    site: str = ""
    verdict: str = ""


def load(directory: str) -> dict[int, dict[str, Any]]:
    """Return the dumps in ``directory`` by rank (files named ``<prefix><rank>``)."""
    dumps: dict[int, dict[str, Any]] = {}
    for name in sorted(os.listdir(directory)):
        match = _RANK_FILE.match(name)
        path = os.path.join(directory, name)
        if match is None or not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as infile:
                data = pickle.load(infile)  # noqa: S301 - the user's own dumps
        except Exception as exc:  # a partial or foreign file: say so, read the rest
            print(f"colls-frtrace: skipping {path}: {exc}", file=sys.stderr)
            continue
        if isinstance(data, dict) and "entries" in data and "pg_config" in data:
            dumps[int(match.group(2))] = data
    return dumps


#: Frames of the standard library, skipped when saying where a thread is.
_STDLIB = re.compile(r"^<frozen |[/\\]lib[/\\]python3[\d.]*[/\\](?!site-packages)")


def _frame_text(frames: Sequence[dict[str, Any]], *, skip_stdlib: bool = False) -> str:
    if not frames:
        return "an unknown place"
    chosen = frames[0]
    if skip_stdlib:
        chosen = next((f for f in frames if not _STDLIB.search(str(f["filename"]))), chosen)
    return f"{os.path.basename(str(chosen['filename']))}:{chosen['line']}"


def _op(entry: dict[str, Any]) -> str:
    return str(entry.get("colls_op") or entry["profiling_name"].split(":", 1)[-1].split(" ")[0])


def _shape(entry: dict[str, Any]) -> str:
    dtypes = entry.get("input_dtypes") or entry.get("output_dtypes") or []
    sizes = entry.get("input_sizes") or entry.get("output_sizes") or []
    parts = [f"{d}{list(s)}" for d, s in zip(dtypes, sizes, strict=False)]
    return ", ".join(parts)


def _variant(entry: dict[str, Any]) -> str:
    shape = _shape(entry)
    return f"{_op(entry)} {shape}".strip()


def _group_name(pg: str, desc: str) -> str:
    return f"group {pg}" + (" (the world)" if desc == "default_pg" else "")


class Job:
    """The dumps of one job, indexed for the analysis."""

    def __init__(self, dumps: dict[int, dict[str, Any]]) -> None:
        self.dumps = dumps
        self.groups: dict[str, tuple[str, list[int]]] = {}
        world = 0
        for data in dumps.values():
            world = max(world, int(data.get("colls", {}).get("world_size", 0) or 0))
            for pg, config in data["pg_config"].items():
                ranks = [int(r) for r in json.loads(str(config["ranks"]))]
                self.groups.setdefault(str(pg), (str(config.get("desc", "")), ranks))
        everyone = {r for _, ranks in self.groups.values() for r in ranks} | set(range(world))
        self.world = sorted(everyone | set(dumps))
        self.absent = sorted(set(self.world) - set(dumps))
        #: collective entries per (group, rank): {seq: entry}
        self.calls: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
        for rank, data in dumps.items():
            for entry in data["entries"]:
                if entry.get("is_p2p"):
                    continue
                pg = str(entry["process_group"][0])
                self.calls.setdefault((pg, rank), {})[int(entry["collective_seq_id"])] = entry

    def last_entry(self, rank: int) -> dict[str, Any] | None:
        entries = self.dumps[rank]["entries"]
        return entries[-1] if entries else None

    def progress(self, rank: int) -> dict[str, dict[str, str]]:
        """Return rank ``rank``'s last started and last completed call of each group."""
        out: dict[str, dict[str, str]] = {}
        for entry in self.dumps[rank]["entries"]:
            pg = str(entry["process_group"][0])
            number = entry["p2p_seq_id"] if entry.get("is_p2p") else entry["collective_seq_id"]
            text = f"{_op(entry)} #{number} at {_frame_text(entry.get('frames', []))}"
            slot = out.setdefault(pg, {"started": "-", "completed": "-"})
            if entry["state"] in ("started", "completed"):
                slot["started"] = text
            if entry["state"] == "completed":
                slot["completed"] = text
        return out

    def now(self, rank: int) -> list[dict[str, Any]]:
        threads = self.dumps[rank].get("colls", {}).get("threads", {})
        return threads.get("MainThread") or next(iter(threads.values()), [])

    def seen(self, rank: int) -> str:
        """Describe rank ``rank``'s last call: "broadcast #4116 of group 0 at train.py:88"."""
        entry = self.last_entry(rank)
        if entry is None:
            return "it recorded no call"
        pg = entry["process_group"]
        number = entry["p2p_seq_id"] if entry.get("is_p2p") else entry["collective_seq_id"]
        return (f"{_op(entry)} #{number} of {_group_name(str(pg[0]), str(pg[1]))} at "
                f"{_frame_text(entry.get('frames', []))} ({entry['state']})")

    def diverge(self, pg: str) -> Divergence | None:
        """Return the first call of group ``pg`` where the ranks' records disagree."""
        desc, members = self.groups[pg]
        present = [r for r in members if r in self.dumps]
        absent = [r for r in members if r not in self.dumps]
        if not present:
            return None
        calls = {r: self.calls.get((pg, r), {}) for r in present}
        firsts = [min(c) for c in calls.values() if c]
        if not firsts:
            return None
        start = max(firsts)
        end = max(max(c) for c in calls.values() if c)
        for seq in range(start, end + 1):
            have = {r: calls[r][seq] for r in present if seq in calls[r]}
            missing = [r for r in present if seq not in calls[r]]
            variants: dict[str, list[int]] = {}
            for r, entry in have.items():
                variants.setdefault(_variant(entry), []).append(r)
            unfinished = any(e["state"] != "completed" for e in have.values())
            if len(variants) <= 1 and not missing and not (absent and unfinished):
                if unfinished and seq == end:
                    return self._describe(pg, desc, members, seq, UNFINISHED, have, variants,
                                          [], [])
                continue
            kind = MISMATCH if len(variants) > 1 else (MISSING if missing else ABSENT)
            return self._describe(pg, desc, members, seq, kind, have, variants, missing, absent)
        return None

    def _describe(self, pg: str, desc: str, members: list[int], seq: int, kind: str,
                  have: dict[int, dict[str, Any]], variants: dict[str, list[int]],
                  missing: list[int], absent: list[int]) -> Divergence:
        d = Divergence(group=pg, desc=desc, ranks=members, seq=seq, kind=kind, op="",
                       variants={k: sorted(v) for k, v in variants.items()},
                       missing=missing, absent=absent, waiting=sorted(have))
        gname = _group_name(pg, desc)
        if kind == MISMATCH:
            expected, odd = self._majority(pg, seq, variants)
            d.culprits = odd
            sample = have[expected[1][0]]
            d.op = _op(sample)
            d.site = _frame_text(sample.get("frames", []))
            culprit = odd[0]
            theirs = have[culprit]
            differs = _op(theirs) != d.op
            what = _op(theirs) if differs else _variant(theirs)
            d.op = d.op if differs else expected[0]
            d.verdict = (
                f"rank {_ranks(odd)} never entered {d.op} #{seq} of {gname}; "
                f"{'it' if len(odd) == 1 else 'they'} called {what} #{seq} instead at "
                f"{_frame_text(theirs.get('frames', []))}, where {_plural(expected[1])} "
                f"called {d.op} at {d.site}"
            )
            return d
        sample: dict[str, Any] | None = next(iter(have.values()), None)
        d.op = _op(sample) if sample else "?"
        d.site = _frame_text(sample.get("frames", [])) if sample else ""
        if kind == MISSING:
            d.culprits = missing
            culprit = missing[0]
            d.verdict = (f"rank {_ranks(missing)} never entered {d.op} #{seq} of {gname}; "
                         f"{'it' if len(missing) == 1 else f'rank {culprit}'} was last seen in "
                         f"{self.seen(culprit)}")
            now = self.now(culprit)
            if now:
                d.verdict += f", and was at {_frame_text(now, skip_stdlib=True)} when it dumped"
        elif kind == ABSENT:
            d.culprits = absent
            d.verdict = (f"rank {_ranks(absent)} never entered {d.op} #{seq} of {gname} and "
                         f"left no dump: likely stuck in its own code holding the GIL "
                         f"({_plural(sorted(have))} waited in {d.op} #{seq} at {d.site})")
        else:
            d.verdict = (f"every rank of {gname} entered {d.op} #{seq} at {d.site}, and it "
                         f"has not completed (stuck in the transport, or still running)")
        return d

    def _majority(self, pg: str, seq: int, variants: dict[str, list[int]]
                  ) -> tuple[tuple[str, list[int]], list[int]]:
        """Return (the expected variant and its ranks, the odd ranks): the most common call;
        on a tie, the one that repeats the group's previous call."""
        previous = None
        for (g, _r), calls in self.calls.items():
            if g == pg and seq - 1 in calls:
                previous = _variant(calls[seq - 1])
                break

        def score(item: tuple[str, list[int]]) -> tuple[int, int, int]:
            name, ranks = item
            return (len(ranks), int(previous is not None and name == previous),
                    -min(ranks))

        ordered = sorted(variants.items(), key=score, reverse=True)
        expected = ordered[0]
        odd = sorted(r for _, ranks in ordered[1:] for r in ranks)
        return (expected[0], sorted(expected[1])), odd


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _plural(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"


def analyze(directory: str) -> dict[str, Any]:
    """Return the analysis of the dumps in ``directory`` (what ``--json`` prints)."""
    dumps = load(directory)
    if not dumps:
        return {"verdict": f"no flight recorder dumps in {directory}", "groups": [],
                "absent": [], "ranks": {}}
    job = Job(dumps)
    found = [d for d in (job.diverge(pg) for pg in sorted(job.groups, key=_group_key))
             if d is not None]
    verdict = _choose(job, found)
    return {
        "verdict": verdict,
        "directory": directory,
        "world": job.world,
        "absent": job.absent,
        "groups": [asdict(d) for d in found],
        "ranks": {
            str(r): {"last": job.seen(r),
                     "now": _frame_text(job.now(r), skip_stdlib=True) if job.now(r) else None,
                     "reason": dumps[r].get("colls", {}).get("reason", ""),
                     "groups": job.progress(r),
                     "entries": len(dumps[r]["entries"])}
            for r in sorted(dumps)
        },
    }


def _group_key(pg: str) -> tuple[int, str]:
    return (0, f"{int(pg):09d}") if pg.isdigit() else (1, pg)


def _choose(job: Job, found: list[Divergence]) -> str:
    """Pick the verdict: an absent rank, then a mismatch, then a rank that is missing while
    not blocked in another group's call (the root of a chain of waits), then any."""
    if not found:
        if job.absent:
            return (f"rank {_ranks(job.absent)} left no dump (likely stuck holding the GIL); "
                    "the other ranks' records agree")
        return "no divergence: every rank's records agree"
    for kind in (ABSENT, MISMATCH):
        for d in found:
            if d.kind == kind:
                return d.verdict
    missing = [d for d in found if d.kind == MISSING]
    for d in missing:  # a culprit that is not itself waiting in a call of another group
        last = job.last_entry(d.culprits[0])
        if last is None or last["state"] == "completed":
            return d.verdict
    return (missing or found)[0].verdict


def render(report: dict[str, Any]) -> str:
    """Return the human-readable report: the verdict first, then the details."""
    lines = [report["verdict"], ""]
    if report.get("absent"):
        lines.append(f"absent dumps: rank {_ranks(report['absent'])}")
    for g in report["groups"]:
        name = _group_name(g["group"], g["desc"])
        lines.append(f"{name}, ranks {g['ranks']}: first divergence at #{g['seq']} ({g['kind']})")
        for variant, ranks in g["variants"].items():
            lines.append(f"  {_plural(ranks)} called {variant}")
        if g["missing"]:
            lines.append(f"  never entered it: rank {_ranks(g['missing'])}")
        if g["absent"]:
            lines.append(f"  no dump: rank {_ranks(g['absent'])}")
    lines.append("")
    for rank, info in report.get("ranks", {}).items():
        now = f"; main thread at {info['now']}" if info.get("now") else ""
        lines.append(f"rank {rank}: last call {info['last']}{now}")
    return "\n".join(lines)


def render_live(report: dict[str, Any]) -> str:
    """Return the live view: each rank's last started and completed call per group."""
    lines = []
    for rank, info in report.get("ranks", {}).items():
        now = f" (main thread at {info['now']})" if info.get("now") else ""
        lines.append(f"rank {rank}{now}:")
        for pg, calls in sorted(info.get("groups", {}).items()):
            lines.append(f"  group {pg}: last started {calls['started']}; "
                         f"last completed {calls['completed']}")
    if report.get("absent"):
        lines.append(f"no answer from rank {_ranks(report['absent'])} (busy holding the GIL?)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``colls-frtrace`` command."""
    parser = argparse.ArgumentParser(
        prog="colls-frtrace",
        description="Read a job's flight recorder dumps (COLLS_FR_DUMP_DIR) and name the rank "
                    "and the call where it hangs.")
    parser.add_argument("directory", help="the directory of the dumps (one file per rank)")
    parser.add_argument("--json", action="store_true", help="print the analysis as JSON")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        print(f"colls-frtrace: {args.directory} is not a directory", file=sys.stderr)
        return 2
    report = analyze(args.directory)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
