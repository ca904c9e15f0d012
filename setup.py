"""The compiled part of the package: `storage/_transpose.c` (import-hf's transposing copy, and
the bfloat16 sum of an adapter it merges).

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
            # no fused multiply-add: a merge's product and sum are each rounded, as NumPy's
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
