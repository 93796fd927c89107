"""The docs speak to users about the software, not to its developers about their work.

docs/*.md and README.md carry no issue numbers, no development sessions, no stories of the
build machine's load, no paths outside the repository and no GPU status outside docs/gpu.md;
docs/benchmarks.md stays a page of latest figures (the dated runs live in benchmarks/results/);
and design.md's layer map names every module of the ``colls`` package, so a module added
without a place in the map fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts) + [ROOT / "README.md"]

#: An upstream project's own issue, named as such ("NCCL issue #1260", a GitHub issue link's
#: text): allowed, since it points the reader at someone else's tracker, not at this project's.
UPSTREAM_ISSUE = re.compile(
    r"\b(?:NCCL|NumPy|CPython|Python|PyTorch|torch|JAX|XLA|jaxlib|MPICH|Open MPI|mpi4py|CuPy|"
    r"pluggy|pytest|UCX|Gloo|gloo|mpi4jax|GitHub)\s+issues?\s+#\d+",
)

#: (pattern, what it is). Each is narrow enough that ordinary prose does not match: "session" alone
#: is allowed (a POSIX session, an ssh session), "agent" alone too (torchrun's agent).
FORBIDDEN = [
    (re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE), "an issue number of this project"),
    (
        re.compile(r"\bthe issue's\b", re.IGNORECASE),
        "a reference to an issue the reader cannot see",
    ),
    (
        re.compile(
            r"\b(?:this|that|the same|same|other|another|earlier|later|previous|next|"
            r"development|dev)\s+sessions?\b",
            re.IGNORECASE,
        ),
        "a development session",
    ),
    (
        re.compile(
            r"\bsessions?'s?\s+(?:tests?|test runs?|test suites?|changes?|work|tree)\b",
            re.IGNORECASE,
        ),
        "a development session's work",
    ),
    (
        re.compile(
            r"\b(?:other|another)\s+(?:agents?|engineers?)\b",
            re.IGNORECASE,
        ),
        "a story of who else used the build machine",
    ),
    (
        re.compile(
            r"\bshared with (?:up to \d+ )?other (?:development |test )?"
            r"(?:sessions?|agents?|jobs|engineers?|work|test runs|tests)\b",
            re.IGNORECASE,
        ),
        "a story of the build machine's load",
    ),
    (
        re.compile(r"\b(?:development|dev|build) (?:VM|machine|host)\b", re.IGNORECASE),
        "the development machine",
    ),
    (re.compile(r"\bsandbox\b", re.IGNORECASE), "the development sandbox"),
    (
        re.compile(r"\blent\b|\bloans?\b", re.IGNORECASE),
        "a story of lending machines to the project",
    ),
    (re.compile(r"\bshared/(?:anchors|[\w.-]+\.md)\b"), "a path outside the repository"),
    (re.compile(r"(?<![\w.])/work/"), "a path outside the repository"),
]

#: A relative path that climbs (`../x`); where it lands is checked against the page's folder.
CLIMBING_PATH = re.compile(r"(?<![\w.])((?:\.\./)+[^\s)`'\"\]>]*)")

#: The GPU status is stated once, in docs/gpu.md; other pages link to it.
GPU_STATUS = re.compile(
    r"not (?:yet )?(?:been )?run on (?:a GPU|one)|on a GPU yet|have not run on one|\bno GPU path\b|"
    r"\bunrun\b|none has been lent",
    re.IGNORECASE,
)
GPU_PAGE = DOCS / "gpu.md"

BENCHMARKS_MAX_LINES = 500


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if ROOT in path.parents else path.name


def _offences(path: Path) -> list[str]:
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        cleaned = UPSTREAM_ISSUE.sub("", line)
        for pattern, what in FORBIDDEN:
            for match in pattern.finditer(cleaned):
                found.append(
                    f"{_rel(path)}:{number}: {what}: {match.group(0)!r} in {line.strip()!r}"
                )
        home = DOCS if DOCS in path.parents else ROOT
        for match in CLIMBING_PATH.finditer(line):
            target = (path.parent / match.group(1).split("#")[0]).resolve()
            if home != target and home not in target.parents:
                found.append(
                    f"{_rel(path)}:{number}: a path outside "
                    f"{'the docs' if home == DOCS else 'the repository'}: {match.group(1)!r}"
                )
        if path != GPU_PAGE:
            for match in GPU_STATUS.finditer(line):
                found.append(
                    f"{_rel(path)}:{number}: GPU status outside docs/gpu.md (link to it instead): "
                    f"{match.group(0)!r}"
                )
    return found


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_a_page_speaks_to_users(page: Path) -> None:
    offences = _offences(page)
    assert not offences, "\n".join(offences)


def test_the_patterns_flag_what_they_should_and_spare_upstream_issues(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    bad = [
        "as issue 15 asks",
        "Issue 3's target",
        "the issue's target is 2x",
        "this session's changes",
        "shared with up to 7 other development sessions",
        "four other agents' tests",
        "see shared/anchors/RESULTS.md",
        "in ../shared/notes.md",
        "none has been lent to this project yet",
        "not yet run on a GPU",
    ]
    good = [
        "NCCL issue #1260 describes the hang",
        "Each worker has its own session: Ctrl-C reaches only colls-run",
        "as torchrun's agent does",
        "it fails silently",
        "the output's tail (`.../_ffi_native....so`)",
        "colls issues one request per rank",
    ]
    for text in bad:
        page.write_text(text + "\n")
        assert _offences(page), text
    for text in good:
        page.write_text(text + "\n")
        assert not _offences(page), text


def test_benchmarks_md_shows_latest_figures_only() -> None:
    lines = (DOCS / "benchmarks.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < BENCHMARKS_MAX_LINES, (
        f"docs/benchmarks.md has {len(lines)} lines (limit {BENCHMARKS_MAX_LINES}): keep the "
        "latest table of each benchmark there and move earlier runs to benchmarks/results/"
    )
    assert (ROOT / "benchmarks" / "results" / "README.md").is_file()


def _layer_map() -> list[tuple[str, str]]:
    """Return design.md's layer map as (head, entry text) pairs, one per entry of the block."""
    text = (DOCS / "design.md").read_text(encoding="utf-8")
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    entries: list[list[str]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        if line[0].isspace() and entries:
            entries[-1].append(line)
        else:
            entries.append([line])
    return [(lines[0].split()[0].rstrip(":,"), "\n".join(lines)) for lines in entries]


def _names(module: str) -> list[str]:
    if module.startswith("__"):
        return [module]
    bare = module.lstrip("_")
    # A private module and its public rename (`_dispatch`, `dispatch`) are the same module.
    return sorted({module, bare, "_" + bare})


def _named_in(module: str, text: str) -> bool:
    return any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) for name in _names(module))


def _is_core_row(head: str, subpackages: set[str]) -> bool:
    """Whether an entry of the map is a row of top-level ``colls`` modules (not a subpackage's)."""
    if head == "colls":
        return True
    return head.startswith("colls.") and head.split(".")[1] not in subpackages


def test_the_layer_map_names_every_module_of_colls() -> None:
    package = ROOT / "colls"
    subpackages = {p.parent.name for p in package.glob("*/__init__.py")}
    entries = _layer_map()
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if "__pycache__" in relative.parts or path.name == "__init__.py":
            continue
        if len(relative.parts) == 1:
            texts = [body for head, body in entries if _is_core_row(head, subpackages)]
        else:
            texts = [body for head, body in entries if head == "colls." + relative.parts[0]]
        if not any(_named_in(path.stem, body) for body in texts):
            missing.append(_rel(path))
    assert not missing, (
        "docs/design.md's layer map (## Layers) does not name these modules; add each to its row "
        "(a module of a subpackage to the row that starts with colls.<subpackage>):\n  "
        + "\n  ".join(missing)
    )
