"""The HTTP side of serving (nanoserve/serve.py)."""
