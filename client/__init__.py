"""hicache.client: the engine-side client library and the `hicache` CLI."""
