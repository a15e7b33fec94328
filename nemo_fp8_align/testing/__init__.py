"""Test harness pieces (not used by the plugin itself): see host_staging.py."""
