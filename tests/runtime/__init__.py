"""Tests of lightning_sparse_dp/runtime/: threads, cores, devices and streams, the executor, stalls."""
