"""The package's version, in a module of its own that imports nothing: checkpoints record it (`checkpoint`) and
setup.cfg reads it without importing the package."""

__version__ = "0.1.0"
