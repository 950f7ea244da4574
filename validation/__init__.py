"""Deciding whether a volunteer's tile is right: Freivalds checks (and, later, quorums)."""
