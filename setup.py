"""Builds kvsparse._core: the Cython bridge in cython_src/ linked with csrc/.

KVSPARSE_DEBUG=1 builds with Cython bounds checks on and -O0 -g; the default
is -O3 with the checks off (set once here, not per file).
"""

import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("KVSPARSE_DEBUG", "") not in ("", "0")

# -fno-math-errno: kvsparse never reads errno, and without it GCC cannot
# vectorize std::sqrt (Adagrad/Adam/RMSProp were 11 ns per element, scalar).
# -fno-trapping-math: kvsparse never reads floating-point exception flags; without
# it GCC keeps the float16 conversions of csrc/half.cc scalar (it will not
# if-convert a float add that might trap). Results are unchanged.
compile_args = [
    "-std=c++17",
    "-fvisibility=hidden",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-Wall",
    "-Wno-unused-function",
]
if DEBUG:
    compile_args += ["-O0", "-g", "-UNDEBUG"]
else:
    compile_args += ["-O3", "-DNDEBUG"]

directives = {
    "language_level": "3",
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
}

core = Extension(
    "kvsparse._core",
    sources=["cython_src/_core.pyx"] + sorted(glob.glob("csrc/*.cc")),
    include_dirs=["csrc", "cython_src", numpy.get_include()],
    language="c++",
    extra_compile_args=compile_args,
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
)

setup(
    ext_modules=cythonize(
        [core],
        compiler_directives=directives,
        include_path=["cython_src"],
        # One folder per mode: Cython's timestamp check ignores directives, so
        # a debug-generated _core.cpp must never be reused by a release build.
        build_dir=os.path.join("build", "cython-debug" if DEBUG else "cython-release"),
    ),
)
