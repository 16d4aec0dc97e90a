"""`python -m hydra_supervisor` runs the CLI."""

from hydra_supervisor.cli import main

main()
