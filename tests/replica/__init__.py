"""Tests of lightning_sparse_dp/replica/: what a replica's step leaves on the module, its metrics, logs and loggers."""
