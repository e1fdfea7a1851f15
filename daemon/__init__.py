"""hicache.daemon: the hicache-daemon sidecar (owns the cache, serves engines over ZeroMQ)."""

from hicache.kernels.shadowing import defer_to_installed

defer_to_installed(__name__, __file__)
