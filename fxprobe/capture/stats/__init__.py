"""Statistics of captured values: the math and its CPU, numba and Triton paths."""
