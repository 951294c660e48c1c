"""Tests of lightning_sparse_dp/loss/: captured loss terms and loss weighting."""
