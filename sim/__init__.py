"""unipage.sim — see docs/design.md."""
