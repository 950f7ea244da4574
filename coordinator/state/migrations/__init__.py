"""Numbered schema migrations of the SQLite store, applied in order (store_sqlite.py)."""
