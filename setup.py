"""The compiled part of the package: `storage/_transpose.c` (import-hf's transposing copy).

Optional: where it cannot be built (no C compiler), the install goes on without it and the
package copies with NumPy instead (`orbax_maxtext_layout.storage.transpose`). Everything
else about the package is in ``pyproject.toml``.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "orbax_maxtext_layout.storage._transpose",
            ["orbax_maxtext_layout/storage/_transpose.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
