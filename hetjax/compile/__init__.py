"""Lowering and compiling the step ahead of time."""
