"""Launchers: start every process of a multi-island job (local.py: on this machine)."""
