"""Structured output: the grammar compiler and its dead-rule check (both processes: the front end
compiles to validate, the core to sample) and the matchers and masks (manager.py: engine-core process)."""
