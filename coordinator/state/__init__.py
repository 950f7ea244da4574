"""Durable and live state: the Store interface and its SQLite implementation, the ledger,
the blob store."""
