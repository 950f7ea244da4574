"""Build the Cython kernels; everything else about the package lives in pyproject.toml.

Each extension is a thin Cython shell (`*.pyx`, compiled to C at build time and never
committed) around hand-written C in the top-level `csrc/`, outside the Python packages."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

# Determinism depends on these flags (docs/kernels.md): no fast-math, and no implicit
# contraction of a*b+c into an FMA, so that the only FMAs are the ones the kernels write.
DETERMINISTIC_CFLAGS = [
    "-O3",
    "-std=c11",
    "-fno-fast-math",
    "-fno-unsafe-math-optimizations",
    "-ffp-contract=off",
    "-fno-math-errno",
]

extensions = [
    Extension(
        "kernels._gemm",
        ["kernels/_gemm.pyx", "csrc/gemm_impl.c"],
        include_dirs=["csrc", numpy.get_include()],
        extra_compile_args=DETERMINISTIC_CFLAGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
    Extension(
        "kernels._nn",
        ["kernels/_nn.pyx", "csrc/nn_impl.c"],
        include_dirs=["csrc", numpy.get_include()],
        depends=["csrc/nn_body.h", "csrc/nn_impl.h"],
        # -Wno-psabi: the 16-lane vectors of nn_body.h never cross a call (all inlined).
        extra_compile_args=[*DETERMINISTIC_CFLAGS, "-Wno-psabi"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
    Extension(
        "validation._probe",
        ["validation/_probe.pyx", "csrc/probe_impl.c"],
        include_dirs=["csrc", numpy.get_include()],
        extra_compile_args=DETERMINISTIC_CFLAGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
]

setup(ext_modules=cythonize(extensions, language_level=3))
