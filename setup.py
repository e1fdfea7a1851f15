"""Builds the optional C helpers (hicache/_fast.c, _tree.c, _copy.c); the rest is in pyproject.

``optional=True``: without a C compiler the install still succeeds and hicache uses its numpy
fallback (hicache/tree/fastpath.py), which behaves the same, only slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # -O3: the scans (smallest token id, common prefix) vectorize
        Extension("hicache._fast", ["hicache/_fast.c"], extra_compile_args=["-O3"], optional=True),
        Extension("hicache._tree", ["hicache/_tree.c"], extra_compile_args=["-O3"], optional=True),
        Extension(
            "hicache._copy",
            ["hicache/_copy.c"],
            libraries=["pthread"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
