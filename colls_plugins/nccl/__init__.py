"""The nccl backend: colls collectives on CUDA arrays through NCCL (CuPy's ``cupy.cuda.nccl``).

Importing this package imports neither CuPy nor libnccl; :mod:`.plugin` declares the backend and
imports them only when colls asks whether NCCL is available or creates a group.
"""
