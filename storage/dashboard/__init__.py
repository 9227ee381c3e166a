"""What the proxy's dashboard (proxy/dashboard/) reads: rewarded sessions for the reward curves, the
policy versions with their steps, staleness histograms, throughput over recent windows, and sessions
paged with filters. Read-only queries returning narrow typed records; every result is bounded (a limit,
a recent span, a page), and time windows are computed from stored timestamps, so every proxy on one
database answers the same.
"""
