"""`rlhf-dist serve`: the generation engine behind HTTP (docs/serving.md). `policy` holds
the served model, `app` the FastAPI endpoints, `main` the command."""
