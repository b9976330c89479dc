"""What memtui keeps on this host: where (the XDG paths), files read back only when they are the
user's own, YAML read safely, the registry of live runs, the user's configuration file."""
