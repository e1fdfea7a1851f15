"""Builds the optional C helpers (hicache/_fast.c, hicache/_copy.c); the rest is in pyproject.

``optional=True``: without a C compiler the install still succeeds and hicache uses its numpy
fallback (hicache/fastpath.py), which behaves the same, only slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("hicache._fast", ["hicache/_fast.c"], optional=True),
        Extension("hicache._copy", ["hicache/_copy.c"], libraries=["pthread"], optional=True),
    ]
)
