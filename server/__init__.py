"""unipage.server — see docs/design.md."""
