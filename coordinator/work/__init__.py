"""The coordinator's vocabulary: GEMMs, work units, results, hosts, log events, and the
wire protocol, as frozen records."""
