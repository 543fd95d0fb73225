"""Builds kvsparse._core: the Cython bridge in cython_src/ linked with csrc/.

KVSPARSE_DEBUG=1 builds with Cython bounds checks on and -O0 -g; the default
is -O3 with the checks off (set once here, not per file).

KVSPARSE_SANITIZE=address,undefined (or thread) builds with those sanitizers
(-fsanitize=..., -O1 -g -fno-omit-frame-pointer). Python itself is not
instrumented: the runtime must be preloaded (LD_PRELOAD=libasan.so or
libtsan.so), which `.ci/sanitize` does for a copy built outside the tree.
"""

import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("KVSPARSE_DEBUG", "") not in ("", "0")
SANITIZE = os.environ.get("KVSPARSE_SANITIZE", "").strip()
_SANITIZERS = {"address", "undefined", "thread", "leak"}
if SANITIZE and not set(SANITIZE.split(",")) <= _SANITIZERS:
    raise SystemExit(
        f"KVSPARSE_SANITIZE={SANITIZE!r}: expected a comma-separated subset of "
        f"{sorted(_SANITIZERS)} (thread cannot be combined with address)"
    )

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
link_args = []
if SANITIZE:
    # -O1: fast enough for the test suite, and frames stay readable in reports.
    # -fno-sanitize-recover: a UBSan finding fails the run instead of scrolling by.
    sanitize = [f"-fsanitize={SANITIZE}", "-fno-sanitize-recover=all"]
    compile_args += ["-O1", "-g", "-fno-omit-frame-pointer", *sanitize]
    link_args += sanitize
elif DEBUG:
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
    extra_link_args=link_args,
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
