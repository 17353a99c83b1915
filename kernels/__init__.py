"""unipage.kernels — see docs/design.md."""
