"""The shared DEQ block: solvers, phantom and implicit backward, Frobenius normalisation (pure torch)."""
