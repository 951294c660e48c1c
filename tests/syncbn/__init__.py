"""Tests of lightning_sparse_dp/syncbn/: synchronized batch norm and the thread collective."""
