"""The `hydra` command line."""
