"""Tests of lightning_sparse_dp/step/: the stages of one sparse_dp step."""
