"""The mpi backend: colls over any MPI library, through mpi4py (MPICH from PyPI by default).

:mod:`~colls_plugins.mpi.plugin` declares it to colls (entry point ``mpi``) without importing
mpi4py; :mod:`~colls_plugins.mpi.runtime` loads and initialises MPI lazily;
:class:`~colls_plugins.mpi.backend.MpiBackend` maps every collective to the native MPI call;
:mod:`~colls_plugins.mpi.messages` its sends, receives and batches;
:mod:`~colls_plugins.mpi.communicators` builds each group's communicator;
:mod:`~colls_plugins.mpi.datatypes` maps dtypes and reduce ops; :mod:`~colls_plugins.mpi.progress`
completes point-to-point requests on a thread; :mod:`~colls_plugins.mpi.staging` keeps device
memory away from an MPI that is not CUDA-aware. See docs/backends.md.
"""
