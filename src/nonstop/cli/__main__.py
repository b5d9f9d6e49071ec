"""`python -m nonstop.cli ...`: the command line, as the `nonstop` script runs it."""

from nonstop.cli import main

main()
