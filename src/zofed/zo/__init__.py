"""The zeroth-order engine: seeded perturbations, the two-point estimator, local ZO optimizers."""
