"""Builds the optional C parts (zgossip/_kernels.c, zgossip/_zsend.c); everything else is in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and zgossip uses numpy for the
same arithmetic (slower; `zgossip.kernels.NATIVE` tells which path runs) and pyzmq's own zero-copy
sends (`zgossip.zmq_driver.FAST_SEND`)."""
import sys

from setuptools import Extension, setup

# no fused multiply-add: the C path must round exactly like numpy's separate multiply and add
flags = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-fast-math"]
ext = [Extension("zgossip._kernels", ["zgossip/_kernels.c"], extra_compile_args=flags, optional=True)]
if sys.platform.startswith("linux"):
    # zero-copy sends through the libzmq pyzmq loaded, without pyzmq's release thread (zgossip/zmq_driver.py)
    ext.append(Extension("zgossip._zsend", ["zgossip/_zsend.c"], extra_compile_args=["-O2"], libraries=["dl"],
                         optional=True))
setup(ext_modules=ext)
