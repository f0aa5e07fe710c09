"""Public operators, one folder per op family (API, request types, reference kernels)."""
