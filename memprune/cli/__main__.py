"""`python -m memprune.cli`: the `memprune` command."""

from memprune.cli import main

main()
