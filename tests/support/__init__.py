"""Shared helpers of the tests: modules, batches, trainers, scenarios (no tests here)."""
