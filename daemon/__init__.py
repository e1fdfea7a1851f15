"""hicache.daemon: the hicache-daemon sidecar (owns the cache, serves engines over ZeroMQ)."""
