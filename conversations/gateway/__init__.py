"""The gateway: provider-compatible endpoints that keep every harness session as a tree
and compact it with the ladder, without the harness knowing (DESIGN.md §6b)."""
