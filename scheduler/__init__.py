"""unipage.scheduler — see docs/design.md."""
