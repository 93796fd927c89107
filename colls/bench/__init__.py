"""colls-bench: an nccl-tests-style sweep (size, count, dtype, time, algbw, busbw, #wrong).

``colls-bench`` (:mod:`colls.bench.cli`) measures any colls backend and op over a range of sizes,
prints the table and optionally writes CSV, JSON and a busbw plot. :mod:`colls.bench.ops` defines
the ops, :mod:`colls.bench.sweep` the timing, :mod:`colls.bench.report` the output and
:mod:`colls.bench.memory` the huge-page-backed buffers. docs/benchmarks.md shows it in use.
"""
