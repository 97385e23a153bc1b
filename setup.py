"""Builds the optional C kernels (zgossip/_kernels.c); everything else is in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and zgossip uses numpy for the
same arithmetic (slower; `zgossip.kernels.NATIVE` tells which path runs)."""
import sys

from setuptools import Extension, setup

# no fused multiply-add: the C path must round exactly like numpy's separate multiply and add
flags = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-fast-math"]
setup(ext_modules=[Extension("zgossip._kernels", ["zgossip/_kernels.c"], extra_compile_args=flags, optional=True)])
