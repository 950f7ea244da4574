"""The volunteer side of tilehive: the daemon that pulls, computes and returns tiles."""
