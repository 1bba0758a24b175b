"""kiln's tests: a package, so test packages import as tests.<name> and none of them (tests/kernels above all) shadows
an installed top-level module of the same name (transformers >= 5.25 imports Hugging Face's `kernels`)."""
