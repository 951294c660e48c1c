"""Tests of lightning_sparse_dp/split/: cutting a batch into chunks of whole samples and merging them back."""
