"""`python -m nanoserve.serve`: the OpenAI-compatible server (nanoserve/entrypoints/)."""

from nanoserve.entrypoints.api_server import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    main()
