"""Build the optional C extensions of colls; the metadata lives in pyproject.toml.

``colls_plugins.tcp.shm._native`` (the shared-memory hot loop, docs/design.md) is optional: when
no C compiler is there, or the build fails for any reason, the install goes on without it and the
tcp backend runs its pure-Python path. ``colls_jax._ffi_native`` (the XLA FFI handler of
colls_jax's jit path, docs/jax.md) is optional the same way: without it jitted colls_jax
collectives run as ordered host callbacks. It needs only Python's headers (it declares the few
XLA FFI structs it reads), not jaxlib.
"""

from __future__ import annotations

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing: the extension only makes colls faster."""

    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, ExecError, PlatformError, OSError) as exc:
            self._skip(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except (CCompilerError, ExecError, PlatformError, OSError) as exc:
            self._skip(exc)

    def _skip(self, exc: BaseException) -> None:
        self.warn(f"colls: an optional C extension was not built ({exc}); the tcp "
                  "backend's shared memory and colls_jax's jit path use their fallbacks")


setup(
    ext_modules=[Extension("colls_plugins.tcp.shm._native",
                           ["colls_plugins/tcp/shm/_native.c"], optional=True),
                 Extension("colls_jax._ffi_native",
                           ["adapters/colls_jax/_ffi_native.c"], optional=True)],
    cmdclass={"build_ext": OptionalBuildExt},
)
