"""Stand-ins for libraries that cannot be installed here (Apex)."""
