"""The `halfmoon` command (`cli.main:main`): one module per command over the SDK, the engine,
the Conductor and the benchmarks. At the top of the package graph: nothing imports `cli`."""
