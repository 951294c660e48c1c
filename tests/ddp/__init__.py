"""Tests of lightning_sparse_dp/ddp/ and sparse_ddp: the sampler, the exchange, real gloo processes."""
