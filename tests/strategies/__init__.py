"""Tests of lightning_sparse_dp/strategies/: whole fits of sparse_dp against plain Lightning on one device."""
