"""Compaction records, snapshot pages and jobs live here (see DESIGN.md §5)."""
