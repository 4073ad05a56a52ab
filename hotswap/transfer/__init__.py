"""Weight transports: a receiving engine in the worker plus a trainer-side sender, one transport per file."""
