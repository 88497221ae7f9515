"""tensord_server: the daemon that owns every Storage in a caching pool."""
