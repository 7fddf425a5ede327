"""The `spyglass` command line, on the top floor of the house: it composes the core library (spyglass/), the Ray
Serve deployments (services/) and the Ray training jobs (actors/), and nothing imports it but the entry points
(`spyglass` in pyproject.toml, `python -m spyglass`). The layers: docs/architecture.md, "Floor plan"."""
