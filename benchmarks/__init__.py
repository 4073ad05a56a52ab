"""Benchmarks: each module is a script run from the repository root as `python -m benchmarks.<name>`, printing
human-readable figures and ending with one JSON line. Modules import each other as `benchmarks.<name>`, and tests
import them the same way; nothing here edits `sys.path`."""
