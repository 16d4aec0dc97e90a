"""The running hydra: the daemon, its control API, notify, metrics."""
