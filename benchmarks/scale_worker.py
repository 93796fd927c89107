"""One rank of ``bench_scale.py``'s launches: colls-run starts this file on every rank.

It is a few lines long, as the issue's own worker is (/work/shared/anchors/scale_colls.py):
every rank compiles the file it is started with, and compiling the 250 lines of bench_scale.py
cost each rank 5.5 ms of CPU time, about 0.7 s of the startup of 256 ranks on two cores, which
is the benchmark's cost, not colls'. The measurement is ``bench_scale.worker``, imported from the
module's compiled cache (bench_scale.py writes it before it launches).
"""

import sys

from bench_scale import worker

worker(int(sys.argv[1]))
