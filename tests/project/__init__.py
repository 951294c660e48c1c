"""Tests of the project rather than a package folder: docs, examples, release, scripts, benchmarks, the ME build."""
